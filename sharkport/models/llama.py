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
from ..layers import AttentionConfig, MixtureOfExperts, PagedAttention, PagedCache, SwiGLU
from ..ops import embedding, linear, normed, rope_angles
from .base import CausalLM, ModelConfig


class Llama(CausalLM):
    def __init__(self, dataset: Dataset, config: ModelConfig):
        super().__init__()
        hp = LlamaHParams.from_metadata(dataset.hparams)
        self.hp, self.config, self.theta = hp, config, dataset.theta
        self._check_tensors(dataset)
        self.cache = PagedCache(hp.block_count, hp.head_count_kv, hp.head_dim, config.block_seq_stride)
        self.attention_config = AttentionConfig(hp.head_count, hp.head_count_kv, hp.head_dim,
                                                dataset.rope_layout, window=hp.sliding_window)
        self.output = self._output_weight()

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

    def _rope(self, positions: torch.Tensor):
        return rope_angles(positions, self.hp.rope_dim, self.hp.rope_freq_base)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(normed(h, self.theta["output_norm.weight"], self.hp.rms_eps), self.output).to(torch.float32)

    def _block(self, t: Theta, layer, h: torch.Tensor, attend) -> torch.Tensor:
        """One block over weights `t` (blk.{i}.*), its K/V in cache layer `layer` (see run_blocks).
        `attend(attention, x, residual)` runs the attention on x and adds the residual. The norms
        go into the products after them and the residual adds into the products before them
        (ops.normed, linear's residual): decode's matvec kernels take both, and the attention and
        FFN blocks (kernels.attention_block, kernels.ffn_block) make a layer two dispatches, or
        one (kernels.layer_block: see _decode_block)."""
        hp = self.hp
        attention = PagedAttention(t, self.attention_config, self.cache, layer)
        ffn = MixtureOfExperts(t, hp.expert_count, hp.expert_used_count) if hp.expert_count else SwiGLU(t)
        h = attend(attention, normed(h, t["attn_norm.weight"], hp.rms_eps), h)
        return ffn(normed(h, t["ffn_norm.weight"], hp.rms_eps), h)

    def _prefill_block(self, t, layer, h, cos, sin, seq_block_ids, cache_state):
        return self._block(t, layer, h, lambda attn, x, residual: attn.prefill(
            x, (cos, sin), cache_state, seq_block_ids, residual))

    def _decode_block(self, t, layer, h, cos, sin, seq_block_ids, start_positions, seq_lens, cache_state):
        hp = self.hp
        if not hp.expert_count:  # the whole layer in one dispatch, where the kernels apply
            attention = PagedAttention(t, self.attention_config, self.cache, layer)
            y = attention.decode_layer(normed(h, t["attn_norm.weight"], hp.rms_eps), (cos, sin), cache_state,
                                       seq_block_ids, start_positions, seq_lens, h, (t["ffn_norm.weight"], hp.rms_eps),
                                       t["ffn_gate.weight"], t["ffn_up.weight"], t["ffn_down.weight"])
            if y is not None:
                return y
        return self._block(t, layer, h, lambda attn, x, residual: attn.decode(
            x, (cos, sin), cache_state, seq_block_ids, start_positions, seq_lens, residual))

    def prefill(self, tokens, seq_lens, seq_block_ids, cache_state):
        B, S = tokens.shape
        positions = torch.arange(S, device=tokens.device).unsqueeze(0).expand(B, S)
        cos, sin = self._rope(positions)
        h = embedding(tokens, self.theta["token_embd.weight"], self.config.dtype)
        h = self.run_blocks(self._prefill_block, h, (cos, sin, seq_block_ids), cache_state)
        return self._logits(self._prefill_rows(h, seq_lens))

    def decode(self, tokens, seq_lens, start_positions, seq_block_ids, cache_state):
        cos, sin = self._rope(start_positions.unsqueeze(1))
        h = embedding(tokens, self.theta["token_embd.weight"], self.config.dtype)
        h = self.run_blocks(self._decode_block, h, (cos, sin, seq_block_ids, start_positions, seq_lens),
                            cache_state)
        return self._logits(h)
