"""The paged KV cache: one flat `cache_state [P, page_elems]` owned by the caller.

A page holds `stride` consecutive positions of K and V for every layer, laid out as
[L, 2 (K, V), stride, Hkv, D] (sharktank's order). Writes go in place through views of the
caller's tensor, so exported programs update the cache buffer without copying it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedCache:
    block_count: int
    kv_heads: int
    head_dim: int
    stride: int

    @property
    def page_elems(self) -> int:
        return self.block_count * 2 * self.stride * self.kv_heads * self.head_dim

    def _block_rows(self, cache: torch.Tensor) -> torch.Tensor:
        # [P * L * 2, stride * Hkv * D]: one row per (page, layer, K|V).
        return cache.view(-1, self.stride * self.kv_heads * self.head_dim)

    def _kv_rows(self, page_ids: torch.Tensor, layer: int | torch.Tensor) -> torch.Tensor:
        return (page_ids * self.block_count + layer) * 2

    def write_blocks(self, cache: torch.Tensor, layer: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     page_ids: torch.Tensor) -> None:
        """Writes whole pages: k, v [B, S, Hkv, D] with S = blocks * stride; page_ids [B, blocks]."""
        rows = self._block_rows(cache)
        k_rows = self._kv_rows(page_ids, layer).flatten()
        values = torch.cat([k.reshape(k_rows.shape[0], -1), v.reshape(k_rows.shape[0], -1)])
        rows.index_copy_(0, torch.cat([k_rows, k_rows + 1]), values.to(cache.dtype))

    def write_positions(self, cache: torch.Tensor, layer: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        page_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Writes one position per sequence: k, v [B, 1, Hkv, D] at positions [B]."""
        rows = cache.view(-1, self.kv_heads * self.head_dim)  # one row per (page, layer, K|V, slot)
        pages = torch.gather(page_ids, 1, (positions // self.stride).unsqueeze(1)).squeeze(1)
        k_rows = self._kv_rows(pages, layer) * self.stride + positions % self.stride
        values = torch.cat([k.flatten(1), v.flatten(1)])
        rows.index_copy_(0, torch.cat([k_rows, k_rows + self.stride]), values.to(cache.dtype))

    def read(self, cache: torch.Tensor, layer: int | torch.Tensor, page_ids: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """page_ids [B, blocks] → k, v [B, blocks * stride, Hkv, D] in `dtype`."""
        rows = self._block_rows(cache)
        k_rows = self._kv_rows(page_ids, layer)
        shape = (page_ids.shape[0], -1, self.kv_heads, self.head_dim)
        k = rows[k_rows].reshape(shape).to(dtype)
        v = rows[k_rows + 1].reshape(shape).to(dtype)
        return k, v
