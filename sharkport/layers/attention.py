"""Self-attention over the paged KV cache: GQA, rotary, optional Q/K/V biases, and the options
later families added (a sliding window, Q/K RMSNorm, a custom scale and soft-capping, a fused
QKV projection)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..archive.tensors import Theta
from ..ops import apply_rope, attention, causal_mask, length_mask
from .linear import Linear, RMSNorm
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
    """Projects Q/K/V by `attn_q`, `attn_k`, `attn_v` (or one fused `attn_qkv`), applies rotary
    embedding (unless `rope` is None), stores K/V in the paged cache, attends, and projects back
    by `attn_output`. Its K/V go to cache layer `layer` (an int, or a 0-d int64 tensor when one
    traced block serves every layer)."""

    def __init__(self, theta: Theta, config: AttentionConfig, cache: PagedCache, layer: int | torch.Tensor):
        super().__init__()
        self.config, self.cache, self.layer = config, cache, layer
        if "attn_qkv.weight" in theta:  # GPT-2: one [q; k; v] projection
            self.qkv = Linear(theta["attn_qkv.weight"], theta.get("attn_qkv.bias"))
        else:
            self.qkv = None
            self.q, self.k, self.v = (Linear(theta[f"attn_{p}.weight"], theta.get(f"attn_{p}.bias")) for p in "qkv")
        self.output = Linear(theta["attn_output.weight"], theta.get("attn_output.bias"))
        eps = config.qk_norm_eps
        self.q_norm = RMSNorm(theta["attn_q_norm.weight"], eps) if eps is not None else None
        self.k_norm = RMSNorm(theta["attn_k_norm.weight"], eps) if eps is not None else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [..., H*D], k and v [..., Hkv*D] of x [..., E]."""
        if self.qkv is not None:
            c = self.config
            return self.qkv(x).split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        return self.q(x), self.k(x), self.v(x)

    def heads(self, x_shape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [B, S, H, D], k and v [B, S, Hkv, D] (before rotary) of projections of x [B, S, E]."""
        c = self.config
        B, S, _ = x_shape
        q = q.reshape(B, S, c.heads, c.head_dim)
        k = k.reshape(B, S, c.kv_heads, c.head_dim)
        v = v.reshape(B, S, c.kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def rotated(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        if rope is None:
            return q, k
        cos, sin = rope
        layout = self.config.rope_layout
        return apply_rope(q, cos, sin, layout), apply_rope(k, cos, sin, layout)

    def attend(self, q, k, v, mask) -> torch.Tensor:
        """attention [B, S, H, D] of rotated q to k, v under an additive mask."""
        c = self.config
        return attention(q, k, v, mask, c.scale, c.logit_cap)

    def prefill_heads(self, q, k, v, rope, cache_state: torch.Tensor, seq_block_ids: torch.Tensor):
        """Rotates q and k, writes k and v into the pages; (q, k, v) as prefill attends with them."""
        q, k = self.rotated(q, k, rope)
        self.cache.write_blocks(cache_state, self.layer, k, v, seq_block_ids)
        return q, k, v

    def prefill(self, x: torch.Tensor, rope, cache_state: torch.Tensor, seq_block_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, E] from position 0; attends causally to itself and fills the pages."""
        q, k, v = self.prefill_heads(*self.heads(x.shape, *self.project(x)), rope, cache_state, seq_block_ids)
        a = self.attend(q, k, v, causal_mask(x.shape[1], q.dtype, q.device, self.config.window))
        return self.output(a.flatten(2))

    def decode_attend(self, q, k, v, rope, cache_state, seq_block_ids, start_positions, seq_lens) -> torch.Tensor:
        """Rotates q and k at start_positions, writes k and v there, and attends to the cached
        positions < seq_lens (and within the window) → [B, 1, H, D]."""
        q, k = self.rotated(q, k, rope)
        self.cache.write_positions(cache_state, self.layer, k, v, seq_block_ids, start_positions)
        k_all, v_all = self.cache.read(cache_state, self.layer, seq_block_ids, q.dtype)
        return self.attend(q, k_all, v_all, length_mask(seq_lens, k_all.shape[1], q.dtype, self.config.window))

    def decode(self, x: torch.Tensor, rope, cache_state: torch.Tensor, seq_block_ids: torch.Tensor,
               start_positions: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """x [B, 1, E] at start_positions."""
        q, k, v = self.heads(x.shape, *self.project(x))
        a = self.decode_attend(q, k, v, rope, cache_state, seq_block_ids, start_positions, seq_lens)
        return self.output(a.flatten(2))
