"""Gemma-3 (text): the llama skeleton with Gemma's differences, all kept here.

* Embeddings scaled by sqrt(hidden); GeGLU (tanh-GELU) feed-forward.
* Four RMSNorms per block: before and after attention (`attn_norm`, `post_attention_norm`) and
  before and after the feed-forward (`ffn_norm`, `post_ffw_norm`), plus RMSNorm of each head's
  q and k (`attn_q_norm`, `attn_k_norm`). HF scales by (1 + w); GGUF files (and HF imports,
  see formats/hf.py) store 1 + w, so every norm here is a plain RMSNorm.
* Interleaved local / global attention: local layers see the last `sliding_window` keys and use
  rope base `rope.freq_base_swa` (10000); global layers see everything with `rope.freq_base`.
  llama.cpp makes every 6th layer global; HF imports record `layer_types` per layer.
* head_dim (`attention.key_length`, 256 for the released models) need not be hidden / heads;
  q·k is scaled by `attention.scale` (HF query_pre_attn_scalar ** -0.5, default head_dim ** -0.5).
* Optional soft-capping of attention scores and final logits.
* HF's rotary layout: llama.cpp does not permute Gemma's Q/K rows.
"""

from __future__ import annotations

import torch

from ..archive import Dataset
from ..errors import SharkportError
from ..formats.keys import Gemma3HParams
from ..archive.tensors import Theta
from ..layers import AttentionConfig, GeGLU, Linear, PagedAttention, PagedCache, RMSNorm
from ..ops import embedding, rope_angles, softcap
from .base import CausalLM, ModelConfig


class Gemma3Block(torch.nn.Module):
    """A norm before and after each of attention and the feed-forward, the residual adds after
    them; local (sliding) layers rotate by the first rope of their inputs, global ones the second."""

    def __init__(self, theta: Theta, hp: Gemma3HParams, attention: AttentionConfig, cache: PagedCache, layer,
                 sliding: bool):
        super().__init__()
        self.sliding = sliding
        self.attn_norm, self.post_attention_norm, self.ffn_norm, self.post_ffw_norm = (
            RMSNorm(theta[f"{n}.weight"], hp.rms_eps)
            for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"))
        self.attention = PagedAttention(theta, attention, cache, layer)
        self.ffn = GeGLU(theta)

    def _rope(self, cos_local, sin_local, cos_global, sin_global):
        return (cos_local, sin_local) if self.sliding else (cos_global, sin_global)

    def prefill(self, h, cos_l, sin_l, cos_g, sin_g, seq_block_ids, cache_state):
        a = self.attention.prefill(self.attn_norm(h), self._rope(cos_l, sin_l, cos_g, sin_g), cache_state,
                                   seq_block_ids)
        h = h + self.post_attention_norm(a)
        return h + self.post_ffw_norm(self.ffn(self.ffn_norm(h)))

    def decode(self, h, cos_l, sin_l, cos_g, sin_g, seq_block_ids, start_positions, seq_lens, cache_state):
        a = self.attention.decode(self.attn_norm(h), self._rope(cos_l, sin_l, cos_g, sin_g), cache_state,
                                  seq_block_ids, start_positions, seq_lens)
        h = h + self.post_attention_norm(a)
        return h + self.post_ffw_norm(self.ffn(self.ffn_norm(h)))


class Gemma3(CausalLM):
    def __init__(self, dataset: Dataset, config: ModelConfig):
        super().__init__()
        hp = Gemma3HParams.from_metadata(dataset.hparams)
        self.hp, self.config, self.theta = hp, config, dataset.theta
        scaling = dataset.hparams.get(f"{hp.arch}.rope.scaling.type", "none")
        if scaling != "none" and float(dataset.hparams.get(f"{hp.arch}.rope.scaling.factor", 1.0)) != 1.0:
            # Gemma-3 4B and larger scale the global layers' positions; not implemented yet.
            raise SharkportError(f"{dataset.path}: gemma3 rope scaling ({scaling}) is not supported yet; "
                                 "only unscaled models (such as Gemma-3-270M and 1B) run")
        E, F, V, D = hp.embedding_length, hp.feed_forward_length, hp.vocab_size, hp.head_dim
        Q, KV = hp.head_count * D, hp.head_count_kv * D
        block = {"attn_norm": (E,), "attn_q": (Q, E), "attn_k": (KV, E), "attn_v": (KV, E), "attn_q_norm": (D,),
                 "attn_k_norm": (D,), "attn_output": (E, Q), "post_attention_norm": (E,), "ffn_norm": (E,),
                 "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F), "post_ffw_norm": (E,)}
        self._require_tensors(dataset.path, {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
                              | self._present({"output.weight": (V, E)})
                              | {f"blk.{i}.{n}.weight": s for i in range(hp.block_count) for n, s in block.items()})
        self.cache = PagedCache(hp.block_count, hp.head_count_kv, hp.head_dim, config.block_seq_stride)
        self.sliding = [hp.is_sliding(i) for i in range(hp.block_count)]
        self.rope_layout = dataset.rope_layout
        self._build_blocks()
        self.output_norm = RMSNorm(self.theta["output_norm.weight"], hp.rms_eps)
        self.output = Linear(self._output_weight())

    def make_block(self, theta: Theta, index: int, layer=None) -> Gemma3Block:
        sliding = self.sliding[index]
        return Gemma3Block(theta, self.hp, self.attention_config(sliding), self.cache,
                           index if layer is None else layer, sliding)

    def attention_config(self, sliding: bool) -> AttentionConfig:
        hp = self.hp
        return AttentionConfig(hp.head_count, hp.head_count_kv, hp.head_dim, self.rope_layout,
                               window=hp.sliding_window if sliding else 0, scale=hp.attention_scale,
                               logit_cap=hp.attn_logit_softcapping, qk_norm_eps=hp.rms_eps)

    def block_key(self, layer: int) -> bool:
        return self.sliding[layer]

    def _ropes(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos and sin of local layers, then of global ones: they rotate with different bases."""
        hp = self.hp
        return (*rope_angles(positions, hp.rope_dim, hp.rope_freq_base_swa),
                *rope_angles(positions, hp.rope_dim, hp.rope_freq_base))

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = embedding(tokens, self.theta["token_embd.weight"], self.config.dtype)
        # HF multiplies by sqrt(hidden) rounded to the activation dtype.
        return h * torch.tensor(self.hp.embedding_length ** 0.5, dtype=h.dtype)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return softcap(self.output(self.output_norm(h)).to(torch.float32), self.hp.final_logit_softcapping)

    def prefill(self, tokens, seq_lens, seq_block_ids, cache_state):
        B, S = tokens.shape
        ropes = self._ropes(torch.arange(S, device=tokens.device).unsqueeze(0).expand(B, S))
        h = self.run_blocks("prefill", self._embed(tokens), (*ropes, seq_block_ids), cache_state)
        return self._logits(self._prefill_rows(h, seq_lens))

    def decode(self, tokens, seq_lens, start_positions, seq_block_ids, cache_state):
        ropes = self._ropes(start_positions.unsqueeze(1))
        h = self.run_blocks("decode", self._embed(tokens), (*ropes, seq_block_ids, start_positions, seq_lens),
                            cache_state)
        return self._logits(h)
