"""Self-attention over the paged KV cache (llama family: GQA, rotary, optional Q/K/V biases)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..archive.tensors import Theta
from ..ops import apply_rope, attention, causal_mask, length_mask, linear
from .paged_cache import PagedCache


@dataclass(frozen=True)
class AttentionConfig:
    heads: int
    kv_heads: int
    head_dim: int
    rope_layout: str  # "interleaved" (GGUF) or "half" (HF)


class PagedAttention(torch.nn.Module):
    """Projects Q/K/V from `attn_q`, `attn_k`, `attn_v`, applies rotary embedding, stores K/V in
    the paged cache, attends, and projects back through `attn_output`."""

    def __init__(self, theta: Theta, config: AttentionConfig, cache: PagedCache, layer: int):
        super().__init__()
        self.theta, self.config, self.cache, self.layer = theta, config, cache, layer

    def _qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        t, c = self.theta, self.config
        B, S, _ = x.shape
        q = linear(x, t["attn_q.weight"], t.get("attn_q.bias")).view(B, S, c.heads, c.head_dim)
        k = linear(x, t["attn_k.weight"], t.get("attn_k.bias")).view(B, S, c.kv_heads, c.head_dim)
        v = linear(x, t["attn_v.weight"], t.get("attn_v.bias")).view(B, S, c.kv_heads, c.head_dim)
        cos, sin = rope
        return apply_rope(q, cos, sin, c.rope_layout), apply_rope(k, cos, sin, c.rope_layout), v

    def _out(self, a: torch.Tensor) -> torch.Tensor:
        return linear(a.flatten(2), self.theta["attn_output.weight"], self.theta.get("attn_output.bias"))

    def prefill(self, x: torch.Tensor, rope, cache_state: torch.Tensor,
                seq_block_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, E] from position 0; attends causally to itself and fills the pages."""
        q, k, v = self._qkv(x, rope)
        self.cache.write_blocks(cache_state, self.layer, k, v, seq_block_ids)
        return self._out(attention(q, k, v, causal_mask(x.shape[1], q.dtype, q.device)))

    def decode(self, x: torch.Tensor, rope, cache_state: torch.Tensor, seq_block_ids: torch.Tensor,
               start_positions: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """x [B, 1, E] at start_positions; attends to the cached positions < seq_lens."""
        q, k, v = self._qkv(x, rope)
        self.cache.write_positions(cache_state, self.layer, k, v, seq_block_ids, start_positions)
        k_all, v_all = self.cache.read(cache_state, self.layer, seq_block_ids, q.dtype)
        return self._out(attention(q, k_all, v_all, length_mask(seq_lens, k_all.shape[1], q.dtype)))
