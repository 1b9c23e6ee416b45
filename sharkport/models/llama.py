"""The llama family: RMSNorm, rotary GQA attention over a paged cache, SwiGLU, tied or separate
output. Hyperparameters come from GGUF keys (see formats/keys.py).

The same recipe runs the models llama.cpp files as `llama` and their close cousins:
* Mistral: `llama.attention.sliding_window` > 0 limits every layer to the last `window` keys.
* Mixtral: `llama.expert_count` > 0 swaps SwiGLU for a mixture of experts (`ffn_gate_inp`,
  `ffn_{gate,up,down}_exps`), `expert_used_count` of them per token.
* Qwen2 (`general.architecture = qwen2`): Q/K/V biases (read whenever present) and HF's
  rotary layout in its GGUF files too (recorded as the archive's `rope_layout`).
"""

from __future__ import annotations

import torch

from ..archive import Dataset, Theta
from ..formats.keys import LlamaHParams
from ..layers import AttentionConfig, Linear, MixtureOfExperts, PagedAttention, PagedCache, RMSNorm, SwiGLU
from ..ops import embedding, rope_angles
from .base import CausalLM, ModelConfig


class LlamaBlock(torch.nn.Module):
    """RMSNorm, attention and the residual add; RMSNorm, the feed-forward and the residual add."""

    def __init__(self, theta: Theta, hp: LlamaHParams, attention: AttentionConfig, cache: PagedCache,
                 layer: int | torch.Tensor):
        super().__init__()
        self.attn_norm = RMSNorm(theta["attn_norm.weight"], hp.rms_eps)
        self.attention = PagedAttention(theta, attention, cache, layer)
        self.ffn_norm = RMSNorm(theta["ffn_norm.weight"], hp.rms_eps)
        self.ffn = (MixtureOfExperts(theta, hp.expert_count, hp.expert_used_count) if hp.expert_count
                    else SwiGLU(theta))

    def prefill(self, h, cos, sin, seq_block_ids, cache_state):
        h = h + self.attention.prefill(self.attn_norm(h), (cos, sin), cache_state, seq_block_ids)
        return h + self.ffn(self.ffn_norm(h))

    def decode(self, h, cos, sin, seq_block_ids, start_positions, seq_lens, cache_state):
        h = h + self.attention.decode(self.attn_norm(h), (cos, sin), cache_state, seq_block_ids, start_positions,
                                      seq_lens)
        return h + self.ffn(self.ffn_norm(h))


class Llama(CausalLM):
    def __init__(self, dataset: Dataset, config: ModelConfig):
        super().__init__()
        hp = LlamaHParams.from_metadata(dataset.hparams)
        self.hp, self.config, self.theta = hp, config, dataset.theta
        self._check_tensors(dataset)
        self.cache = PagedCache(hp.block_count, hp.head_count_kv, hp.head_dim, config.block_seq_stride)
        self.attention_config = AttentionConfig(hp.head_count, hp.head_count_kv, hp.head_dim,
                                                dataset.rope_layout, window=hp.sliding_window)
        self._build_blocks()
        # the final norm and the output product as one head (export may fuse them: sharkport.export.kernels)
        self.head = torch.nn.Sequential(RMSNorm(self.theta["output_norm.weight"], hp.rms_eps),
                                        Linear(self._output_weight()))

    def _check_tensors(self, dataset: Dataset) -> None:
        hp = self.hp
        E, F, V, X = hp.embedding_length, hp.feed_forward_length, hp.vocab_size, hp.expert_count
        Q, KV = hp.head_count * hp.head_dim, hp.head_count_kv * hp.head_dim
        ffn = ({"ffn_gate_inp": (X, E), "ffn_gate_exps": (X, F, E), "ffn_up_exps": (X, F, E),
                "ffn_down_exps": (X, E, F)} if X else {"ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F)})
        block = {"attn_norm": (E,), "attn_q": (Q, E), "attn_k": (KV, E), "attn_v": (KV, E),
                 "attn_output": (E, Q), "ffn_norm": (E,), **ffn}
        biases = {"attn_q": (Q,), "attn_k": (KV,), "attn_v": (KV,), "attn_output": (E,)}
        expected = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
        expected |= self._present({"output.weight": (V, E)})
        for i in range(hp.block_count):
            expected |= {f"blk.{i}.{n}.weight": s for n, s in block.items()}
            expected |= self._present({f"blk.{i}.{n}.bias": s for n, s in biases.items()})
        self._require_tensors(dataset.path, expected)

    def make_block(self, theta: Theta, index: int, layer=None) -> LlamaBlock:
        return LlamaBlock(theta, self.hp, self.attention_config, self.cache, index if layer is None else layer)

    def _rope(self, positions: torch.Tensor):
        return rope_angles(positions, self.hp.rope_dim, self.hp.rope_freq_base)

    def prefill(self, tokens, seq_lens, seq_block_ids, cache_state):
        B, S = tokens.shape
        positions = torch.arange(S, device=tokens.device).unsqueeze(0).expand(B, S)
        cos, sin = self._rope(positions)
        h = embedding(tokens, self.theta["token_embd.weight"], self.config.dtype)
        h = self.run_blocks("prefill", h, (cos, sin, seq_block_ids), cache_state)
        return self.head(self._prefill_rows(h, seq_lens)).to(torch.float32)

    def decode(self, tokens, seq_lens, start_positions, seq_block_ids, cache_state):
        cos, sin = self._rope(start_positions.unsqueeze(1))
        h = embedding(tokens, self.theta["token_embd.weight"], self.config.dtype)
        h = self.run_blocks("decode", h, (cos, sin, seq_block_ids, start_positions, seq_lens), cache_state)
        return self.head(h).to(torch.float32)
