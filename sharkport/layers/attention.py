"""Self-attention over the paged KV cache: GQA, rotary, optional Q/K/V biases, and the options
later families added (a sliding window, Q/K RMSNorm, a custom scale and soft-capping, a fused
QKV projection)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..archive.tensors import Theta
from ..ops import Normed, apply_rope, attention, causal_mask, length_mask, linear, linear3, materialized, rms_norm
from .paged_cache import PagedCache


@dataclass(frozen=True)
class AttentionConfig:
    heads: int
    kv_heads: int
    head_dim: int
    rope_layout: str  # "interleaved" (GGUF) or "half" (HF)
    window: int = 0               # sliding window (keys i - j < window); 0: all earlier keys
    scale: float | None = None    # q·k scale; None: head_dim ** -0.5
    logit_cap: float = 0.0        # soft-capping of the scores (0: none)
    qk_norm_eps: float | None = None  # RMSNorm of each head's q and k by attn_{q,k}_norm (Gemma-3)


class PagedAttention(torch.nn.Module):
    """Projects Q/K/V from `attn_q`, `attn_k`, `attn_v` (or one fused `attn_qkv`), applies rotary
    embedding (unless `rope` is None), stores K/V in the paged cache, attends, and projects back
    through `attn_output`, adding the residual if one is given. Its K/V go to cache layer `layer`
    (an int, or a 0-d int64 tensor when one traced block serves every layer). Its input x may be
    ops.normed (the block's norm, computed by the q/k/v product where a kernel applies)."""

    def __init__(self, theta: Theta, config: AttentionConfig, cache: PagedCache, layer: int | torch.Tensor):
        super().__init__()
        self.theta, self.config, self.cache, self.layer = theta, config, cache, layer

    def _project(self, x: torch.Tensor | Normed):
        t, c = self.theta, self.config
        if "attn_qkv.weight" in t:  # GPT-2: one [q; k; v] projection
            qkv = linear(x, t["attn_qkv.weight"], t.get("attn_qkv.bias"))
            return qkv.split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        biases = [t.get(f"attn_{p}.bias") for p in "qkv"]
        if all(b is None for b in biases):
            return linear3(x, t["attn_q.weight"], t["attn_k.weight"], t["attn_v.weight"])
        x = materialized(x)
        return tuple(linear(x, t[f"attn_{p}.weight"], b) for p, b in zip("qkv", biases))

    def _qkv(self, x: torch.Tensor | Normed):
        """q [B, S, H, D], k and v [B, S, Hkv, D] before rotary."""
        t, c = self.theta, self.config
        B, S, _ = x.shape
        q, k, v = self._project(x)
        q = q.reshape(B, S, c.heads, c.head_dim)
        k = k.reshape(B, S, c.kv_heads, c.head_dim)
        v = v.reshape(B, S, c.kv_heads, c.head_dim)
        if c.qk_norm_eps is not None:
            q = rms_norm(q, t["attn_q_norm.weight"], c.qk_norm_eps)
            k = rms_norm(k, t["attn_k_norm.weight"], c.qk_norm_eps)
        return q, k, v

    def _rotated(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        if rope is None:
            return q, k
        cos, sin = rope
        layout = self.config.rope_layout
        return apply_rope(q, cos, sin, layout), apply_rope(k, cos, sin, layout)

    def _attend(self, q, k, v, mask, residual) -> torch.Tensor:
        c = self.config
        return self._output(attention(q, k, v, mask, c.scale, c.logit_cap), residual)

    def _output(self, a: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return linear(a.flatten(2), self.theta["attn_output.weight"], self.theta.get("attn_output.bias"), residual)

    def prefill(self, x: torch.Tensor | Normed, rope, cache_state: torch.Tensor, seq_block_ids: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, E] from position 0; attends causally to itself and fills the pages."""
        q, k, v = self._qkv(x)
        q, k = self._rotated(q, k, rope)
        self.cache.write_blocks(cache_state, self.layer, k, v, seq_block_ids)
        c = self.config
        a = kernels.prefill_attention(q, k, v, c.scale, c.window, c.logit_cap)
        if a is not None:  # export --matvec-kernels: one kernel dispatch
            return self._output(a, residual)
        return self._attend(q, k, v, causal_mask(x.shape[1], q.dtype, q.device, c.window), residual)

    def decode(self, x: torch.Tensor | Normed, rope, cache_state: torch.Tensor, seq_block_ids: torch.Tensor,
               start_positions: torch.Tensor, seq_lens: torch.Tensor,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, 1, E] at start_positions; attends to the cached positions < seq_lens (and within
        the window)."""
        y = self._decode_block(x, rope, cache_state, seq_block_ids, start_positions, seq_lens, residual)
        if y is not None:  # export --matvec-kernels: the whole of it, norm and residual add too, in one dispatch
            return y
        q, k, v = self._qkv(x)
        c = self.config
        a = kernels.decode_attention(q, k, v, cache_state, self.cache, self.layer, seq_block_ids, start_positions,
                                     seq_lens, rope, c.rope_layout, c.scale, c.window, c.logit_cap)
        if a is not None:  # export --matvec-kernels: rotary, the cache write and attention in one kernel dispatch
            return self._output(a, residual)
        q, k = self._rotated(q, k, rope)
        self.cache.write_positions(cache_state, self.layer, k, v, seq_block_ids, start_positions)
        k_all, v_all = self.cache.read(cache_state, self.layer, seq_block_ids, q.dtype)
        mask = length_mask(seq_lens, k_all.shape[1], q.dtype, self.config.window)
        return self._attend(q, k_all, v_all, mask, residual)

    def decode_layer(self, x: Normed, rope, cache_state: torch.Tensor, seq_block_ids: torch.Tensor,
                     start_positions: torch.Tensor, seq_lens: torch.Tensor, residual: torch.Tensor,
                     ffn_norm: tuple[torch.Tensor, float], gate, up, down) -> torch.Tensor | None:
        """decode (residual x's input), then a SwiGLU FFN block on its output (normed by `ffn_norm`,
        weight and eps, with its residual add), in one dispatch (kernels.layer_block, export
        --matvec-kernels); None where that does not apply, having computed nothing."""
        return self._decode_block(x, rope, cache_state, seq_block_ids, start_positions, seq_lens, residual,
                                  (ffn_norm, gate, up, down))

    def _decode_block(self, x, rope, cache_state, seq_block_ids, start_positions, seq_lens, residual, ffn=None):
        """decode's result by kernels.attention_block (one dispatch; with `ffn`, kernels.layer_block),
        or None where it does not apply: x not normed or the residual not x's input, biases, Q/K
        norms, a fused QKV."""
        t, c = self.theta, self.config
        names = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
        if not (isinstance(x, Normed) and residual is x.x and c.qk_norm_eps is None and all(n in t for n in names)
                and not any(f"attn_{p}.bias" in t for p in ("q", "k", "v", "output"))):
            return None
        operands = (cache_state, self.cache, self.layer, seq_block_ids, start_positions, seq_lens, c.heads, c.head_dim,
                    rope, c.rope_layout, c.scale, c.window, c.logit_cap)
        if ffn is not None:
            return kernels.layer_block(x.x, (x.w, x.eps), *(t[n] for n in names), *ffn, *operands)
        return kernels.attention_block(x.x, (x.w, x.eps), *(t[n] for n in names), *operands)
