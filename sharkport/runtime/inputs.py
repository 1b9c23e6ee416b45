"""The padded inputs of one prefill or decode call (docs/abi.md), built in one place for the
generate loop, `tools.verify` and `tools.dump_inputs`.

A call holds `batch_size` rows: the sequences given, then padding rows (length 1, position 0)
whose every page-table entry is the scratch page, which no sequence owns. A sequence's
table lists its own pages, and the scratch page for blocks past them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..errors import SharkportError


def pick_batch_size(sizes: Sequence[int], n: int, what: str) -> int:
    """The smallest exported batch size that holds n rows, else the largest."""
    if not sizes:
        raise SharkportError(f"the module exports no {what} function; re-export with --bs-{what}")
    fitting = [b for b in sorted(sizes) if b >= n]
    return fitting[0] if fitting else max(sizes)


def _page_table(pages: Sequence[Sequence[int]], batch_size: int, blocks: int, scratch: int) -> np.ndarray:
    ids = np.full((batch_size, blocks), scratch, np.int64)
    for r, own in enumerate(pages):
        own = own[:blocks]
        ids[r, :len(own)] = own
    return ids


def prefill_inputs(prompts: Sequence[Sequence[int]], pages: Sequence[Sequence[int]], batch_size: int,
                   stride: int, scratch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, seq_lens, seq_block_ids) of a prefill over `prompts`, row r on `pages[r]`:
    tokens right-padded to whole pages of the longest prompt."""
    blocks = math.ceil(max(len(p) for p in prompts) / stride)
    tokens = np.zeros((batch_size, blocks * stride), np.int64)
    lens = np.ones(batch_size, np.int64)
    for r, prompt in enumerate(prompts):
        tokens[r, :len(prompt)] = prompt
        lens[r] = len(prompt)
    return tokens, lens, _page_table(pages, batch_size, blocks, scratch)


def decode_inputs(tokens: Sequence[int], positions: Sequence[int], pages: Sequence[Sequence[int]],
                  batch_size: int, stride: int, scratch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, seq_lens, start_positions, seq_block_ids) of a decode step: row r's token
    `tokens[r]` at `positions[r]`, on `pages[r]`. Table entries past a row's position are
    masked, so every row's table is as long as the furthest position needs."""
    start = np.zeros(batch_size, np.int64)
    start[:len(positions)] = positions
    column = np.zeros((batch_size, 1), np.int64)
    column[:len(tokens), 0] = tokens
    blocks = int(start.max()) // stride + 1
    return column, start + 1, start, _page_table(pages, batch_size, blocks, scratch)
