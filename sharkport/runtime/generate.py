"""One generate loop for every session: page allocation, batched prefill, then decode steps.

Prompts of different lengths share a batch; each keeps its own length (right padding is never
attended: prefill is causal and decode masks keys at positions ≥ seq_lens). Batches that are not
full are topped up with dummy rows that own pages of their own, so they never touch a real
sequence's cache.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import SharkportError
from .session import Session


class PageAllocator:
    """Hands out cache pages; every page, 0 included, is an ordinary page."""

    def __init__(self, pages: int):
        self._free = list(range(pages - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise SharkportError(
                f"the KV cache has {len(self._free)} free pages but {n} are needed; "
                "raise --device-block-count at export (or --pages), or send fewer/shorter prompts")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass
class GenerateStats:
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    generated_tokens: int = 0
    first_token_s: float = 0.0

    def summary(self) -> str:
        lines = [f"prefill: {self.prefill_tokens} tokens in {self.prefill_s * 1e3:.1f} ms "
                 f"({self.prefill_tokens / max(self.prefill_s, 1e-9):.1f} tokens/s)",
                 f"time to first token: {self.first_token_s * 1e3:.1f} ms"]
        if self.decode_steps:
            per_step = self.decode_s / self.decode_steps
            lines.append(f"decode: {self.decode_steps} steps, {per_step * 1e3:.1f} ms/step, "
                         f"{self.generated_tokens / max(self.decode_s, 1e-9):.1f} tokens/s")
        return "\n".join(lines)


@dataclass
class _Seq:
    tokens: list[int]
    prompt_len: int
    pages: list[int] = field(default_factory=list)
    done: bool = False


def _pick(sizes: list[int], n: int, what: str) -> int:
    if not sizes:
        raise SharkportError(f"the module exports no {what} function")
    fitting = [b for b in sorted(sizes) if b >= n]
    return fitting[0] if fitting else max(sizes)


def generate(session: Session, prompts: list[list[int]], max_new_tokens: int,
             eos_ids: set[int] = frozenset(), on_token: Callable[[int, int], None] | None = None,
             stats: GenerateStats | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt (token ids). Returns the new ids of each prompt, ending
    at the first EOS (included) or after max_new_tokens. `on_token(prompt_index, id)` sees each
    new token as it is chosen."""
    stats = stats if stats is not None else GenerateStats()
    if max_new_tokens < 0:
        raise SharkportError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    if any(len(p) == 0 for p in prompts):
        raise SharkportError("empty prompt: give at least one token (or a BOS token)")
    config = session.config
    limit = config.max_seq_len
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > limit:
            raise SharkportError(
                f"prompt {i} has {len(p)} tokens; with {max_new_tokens} new tokens it exceeds the "
                f"exported max_seq_len {limit}; shorten it or lower --max-new-tokens")
    group = max(config.decode_batch_sizes or config.prefill_batch_sizes)
    results: list[list[int]] = []
    allocator = PageAllocator(session.pages)
    for start in range(0, len(prompts), group):
        chunk = prompts[start:start + group]
        results += _generate_group(session, allocator, chunk, max_new_tokens, eos_ids,
                                   stats, lambda i, t: on_token and on_token(start + i, t))
    return results


def _generate_group(session, allocator, prompts, max_new_tokens, eos_ids, stats, on_token):
    config = session.config
    stride = config.block_seq_stride
    prefill_blocks = math.ceil(max(len(p) for p in prompts) / stride)
    decode_bs = _pick(config.decode_batch_sizes, len(prompts), "decode") if max_new_tokens > 1 else 0
    rows = max(len(prompts), decode_bs)
    seqs = [_Seq(list(p), len(p)) for p in prompts]
    seqs += [_Seq([0], 1, done=True) for _ in range(rows - len(prompts))]  # dummy rows
    try:
        for s in seqs:
            total = len(s.tokens) + max_new_tokens if not s.done else 1
            s.pages = allocator.alloc(max(math.ceil(total / stride), prefill_blocks))
        _prefill(session, allocator, seqs[:len(prompts)], prefill_blocks, stats)
        for i, s in enumerate(seqs[:len(prompts)]):
            on_token(i, s.tokens[-1])
            s.done = s.tokens[-1] in eos_ids or max_new_tokens == 1
        for _ in range(max_new_tokens - 1):
            if all(s.done for s in seqs):
                break
            _decode_step(session, seqs, decode_bs, eos_ids, stats, on_token)
            for s in seqs[:len(prompts)]:
                if len(s.tokens) - s.prompt_len >= max_new_tokens:
                    s.done = True
        return [s.tokens[s.prompt_len:] for s in seqs[:len(prompts)]]
    finally:
        for s in seqs:
            allocator.free(s.pages)


def _prefill(session, allocator: PageAllocator, seqs: list[_Seq], blocks: int,
             stats: GenerateStats) -> None:
    config = session.config
    bs = _pick(config.prefill_batch_sizes, len(seqs), "prefill")
    stride = config.block_seq_stride
    for start in range(0, len(seqs), bs):
        part = seqs[start:start + bs]
        tokens = np.zeros((bs, blocks * stride), np.int64)
        lens = np.ones(bs, np.int64)
        ids = np.zeros((bs, blocks), np.int64)
        spare = []
        for r in range(bs):
            if r < len(part):
                s = part[r]
                tokens[r, :len(s.tokens)] = s.tokens
                lens[r] = len(s.tokens)
                ids[r] = s.pages[:blocks]
            else:  # padding rows write into pages of their own, freed right after
                ids[r] = pages = allocator.alloc(blocks)
                spare += pages
        t0 = time.perf_counter()
        logits = session.prefill(tokens, lens, ids)
        stats.prefill_s += time.perf_counter() - t0
        stats.prefill_tokens += int(sum(len(s.tokens) for s in part))
        for r, s in enumerate(part):
            s.tokens.append(int(np.argmax(logits[r, len(s.tokens) - 1])))
            stats.generated_tokens += 1
        allocator.free(spare)
        if not stats.first_token_s:  # the first group's first tokens are out now
            stats.first_token_s = stats.prefill_s


def _decode_step(session, seqs: list[_Seq], bs: int, eos_ids, stats: GenerateStats, on_token) -> None:
    stride = session.config.block_seq_stride
    positions = np.array([len(s.tokens) - 1 for s in seqs], np.int64)
    blocks = int(positions.max()) // stride + 1
    ids = np.zeros((bs, blocks), np.int64)
    for r, s in enumerate(seqs):
        ids[r] = (s.pages + [s.pages[0]] * blocks)[:blocks]  # tail entries are masked, any page will do
    tokens = np.array([[s.tokens[-1]] for s in seqs], np.int64)
    t0 = time.perf_counter()
    logits = session.decode(tokens, positions + 1, positions, ids)
    stats.decode_s += time.perf_counter() - t0
    stats.decode_steps += 1
    for r, s in enumerate(seqs):
        if s.done:
            continue
        nxt = int(np.argmax(logits[r, 0]))
        s.tokens.append(nxt)
        stats.generated_tokens += 1
        on_token(r, nxt)
        s.done = nxt in eos_ids
