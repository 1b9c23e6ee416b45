"""What every recipe provides: the two ABI entry points over a paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SharkportError
from ..layers.paged_cache import PagedCache


@dataclass(frozen=True)
class ModelConfig:
    """How a recipe is instantiated (not what the weights say)."""

    block_seq_stride: int = 32
    dtype: torch.dtype = torch.float32  # activations
    kv_cache_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.block_seq_stride <= 0 or self.block_seq_stride % 8:
            raise SharkportError(
                f"--block-seq-stride must be a positive multiple of 8, got {self.block_seq_stride}"
            )


class CausalLM(torch.nn.Module):
    """A decoder-only LM with `prefill` and `decode` as in DESIGN.md §3.

    prefill(tokens [B, S], seq_lens [B], seq_block_ids [B, S/stride], cache_state [P, E]) → [B, S, V]
    decode(tokens [B, 1], seq_lens [B], start_positions [B], seq_block_ids [B, N], cache_state) → [B, 1, V]
    Both write K/V into cache_state in place and return float32 logits."""

    config: ModelConfig
    cache: PagedCache

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def context_length(self) -> int:
        raise NotImplementedError

    def new_cache(self, pages: int) -> torch.Tensor:
        return torch.zeros(pages, self.cache.page_elems, dtype=self.config.kv_cache_dtype)
