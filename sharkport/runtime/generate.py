"""One generate loop for every session: a scheduler over the exported batch sizes.

Every prompt (times `num_return_sequences`) becomes a sequence. A sequence is admitted when a
row and the cache pages for its whole length (prompt + max_new_tokens) are free; it is
prefilled with the others admitted at the same time, then decoded one token per step with
every running sequence, and its pages are freed as soon as it finishes. With continuous
batching a waiting sequence takes the row (and pages) of a finished one at the next step;
without it, a new group starts only when the whole previous group has finished.

Calls are padded up to an exported batch size with rows that read and write one scratch page
that no sequence owns. Prompts of different lengths share a call; each keeps its own length
(right padding is never attended: prefill is causal and decode masks keys at positions ≥
seq_lens). Positions past a sequence's end inside its last page hold garbage until decode
writes them, which it does before attending to them.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from ..errors import SharkportError
from .inputs import decode_inputs, pick_batch_size, prefill_inputs
from .sampling import GenerationConfig, choose, process_logits

# How long a run waits for cache pages that other runs on the same session hold.
PAGE_WAIT_S = 600.0

if TYPE_CHECKING:  # sessions load torch / IREE; the loop only calls them
    from .session import Session


class PageAllocator:
    """Hands out cache pages; every page, 0 included, is an ordinary page. Runs on one session in
    several threads share it: a run that needs more pages than are free waits (up to `wait_s`)
    for pages that runs in other threads hold, rather than failing. Pages its own thread holds
    cannot come back while it waits, so they never count."""

    def __init__(self, pages: int, wait_s: float = PAGE_WAIT_S):
        self.pages, self.wait_s = pages, wait_s
        self._free = list(range(pages - 1, -1, -1))
        self._owner: dict[int, int] = {}  # page -> the thread that holds it
        self._changed = threading.Condition()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int, wait: bool = False) -> list[int]:
        """n free pages; with `wait`, once runs in other threads have freed enough (an error after
        wait_s, or at once if even all of theirs would not do)."""
        me = threading.get_ident()
        with self._changed:
            others = sum(owner != me for owner in self._owner.values())
            if n > len(self._free) + (others if wait else 0):
                raise SharkportError(
                    f"the KV cache has {len(self._free)} free pages but {n} are needed; "
                    "raise --device-block-count at export (or --pages), or send fewer/shorter prompts")
            if not self._changed.wait_for(lambda: n <= len(self._free), timeout=self.wait_s):
                raise SharkportError(
                    f"waited {self.wait_s:g} s for {n} free KV cache pages while other sequences held them "
                    f"({len(self._free)} of {self.pages} free); allocate more with --pages, or run fewer at once")
            return self._take(n, me)

    def try_alloc(self, n: int) -> list[int] | None:
        """n free pages, or None (at once) if fewer are free."""
        with self._changed:
            return self._take(n, threading.get_ident()) if n <= len(self._free) else None

    def _take(self, n: int, owner: int) -> list[int]:
        pages = [self._free.pop() for _ in range(n)]
        self._owner.update(dict.fromkeys(pages, owner))
        return pages

    def free(self, pages: list[int]) -> None:
        with self._changed:
            for page in pages:
                self._owner.pop(page, None)
            self._free.extend(reversed(pages))
            self._changed.notify_all()


@dataclass
class GenerateStats:
    """Wall-clock times of the module calls of one run (host sampling included per step)."""

    prefill_s: float = 0.0
    prefill_calls: int = 0
    prefill_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens chosen from decode calls (prefill chooses each first token)
    generated_tokens: int = 0
    first_token_s: float = 0.0  # from the start of the run to the first token of any sequence
    total_s: float = 0.0

    def summary(self) -> str:
        lines = [f"prefill: {self.prefill_tokens} tokens in {self.prefill_calls} call(s), "
                 f"{self.prefill_s * 1e3:.1f} ms ({self.prefill_s / max(self.prefill_calls, 1) * 1e3:.1f} ms "
                 f"per call, {self.prefill_tokens / max(self.prefill_s, 1e-9):.1f} tokens/s)",
                 f"time to first token: {self.first_token_s * 1e3:.1f} ms"]
        if self.decode_steps:
            lines.append(f"decode: {self.decode_tokens} tokens in {self.decode_steps} steps, "
                         f"{self.decode_s / self.decode_steps * 1e3:.1f} ms/step, "
                         f"{self.decode_tokens / max(self.decode_s, 1e-9):.1f} tokens/s, "
                         f"{self.decode_s / max(self.decode_tokens, 1) * 1e3:.1f} ms per output token")
        lines.append(f"total: {self.generated_tokens} tokens generated in {self.total_s:.2f} s")
        return "\n".join(lines)


@dataclass(frozen=True)
class TokenEvent:
    """One chosen token of one sequence, as streaming yields it.

    `text` is the text this token completes (may be "" while a multi-byte character or a
    possible stop string is held back; None without a tokenizer). `finish_reason` is set on the
    sequence's last event: "stop" (a stop token or string) or "length" (max_new_tokens)."""

    prompt_index: int
    sequence_index: int
    token_id: int
    text: str | None
    finish_reason: str | None = None


@dataclass
class Generation:
    """One generated continuation: new token ids (a stop token included), their text (cut
    before a stop string), why it ended, and with output_scores the raw `logits` and processed
    `scores` of every step ([V] float32 each)."""

    token_ids: list[int]
    text: str | None
    finish_reason: str
    logits: list[np.ndarray] | None = field(default=None, repr=False)
    scores: list[np.ndarray] | None = field(default=None, repr=False)
    time_to_first_token_s: float = 0.0
    latency_s: float = 0.0


@dataclass
class _Seq:
    prompt_index: int
    sequence_index: int
    prompt: list[int]
    rng: np.random.Generator
    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logits: list[np.ndarray] = field(default_factory=list)
    scores: list[np.ndarray] = field(default_factory=list)
    decoder: object = None  # tokenizer.StreamDecoder
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    first_token_s: float = 0.0
    latency_s: float = 0.0

    @property
    def position(self) -> int:
        """Position of the last token, the input of the next decode step."""
        return len(self.prompt) + len(self.tokens) - 1


_ALLOCATOR_LOCK = threading.Lock()


def page_allocator(session: Session) -> PageAllocator:
    """The session's allocator: runs on one session share its cache, so they share its pages."""
    with _ALLOCATOR_LOCK:  # two threads' first runs make one allocator, not two
        if getattr(session, "_page_allocator", None) is None:
            session._page_allocator = PageAllocator(session.pages)
    return session._page_allocator


def next_token_logits(logits: np.ndarray, row: int, length: int) -> np.ndarray:
    """The prefill logits [N, S, V] for the token after a prompt of `length` in `row`: at position
    length - 1, or the only position a module exported with --prefill-final-logits returns
    ([N, 1, V]; S is otherwise a whole number of pages, never 1). shortfin tells them apart the
    same way."""
    return logits[row, 0 if logits.shape[1] == 1 else length - 1]


class GenerationRun:
    """Generates continuations of `prompts` (token ids) with `session`. Iterate for TokenEvents
    as tokens are chosen; `results()` runs to the end and returns, per prompt, its
    `num_return_sequences` Generations. Pages are returned to the cache when the run ends,
    also when the caller stops iterating early."""

    def __init__(self, session: Session, prompts: list[list[int]], config: GenerationConfig,
                 tokenizer=None, continuous: bool = True, stats: GenerateStats | None = None):
        self.session, self.config, self.tokenizer = session, config, tokenizer
        self.continuous = continuous
        self.stats = stats if stats is not None else GenerateStats()
        if config.stop and tokenizer is None:
            raise SharkportError("stop strings need a tokenizer; give stop_token_ids instead")
        c = session.config
        for i, p in enumerate(prompts):
            if not p:
                raise SharkportError(f"prompt {i} is empty: give at least one token (or a BOS token)")
            if len(p) + config.new_tokens(len(p)) > c.max_seq_len:
                raise SharkportError(
                    f"prompt {i} has {len(p)} tokens; with {config.new_tokens(len(p))} new tokens it exceeds "
                    f"the exported max_seq_len {c.max_seq_len}; shorten it or lower --max-new-tokens")
        self._stride = c.block_seq_stride
        self._rows = max(c.decode_batch_sizes or c.prefill_batch_sizes)
        self._seqs = [_Seq(i, j, list(p), _rng(config.seed, i, j))
                      for i, p in enumerate(prompts) for j in range(config.num_return_sequences)]
        self._n_prompts = len(prompts)
        self._events: Iterator[TokenEvent] | None = None
        self._done = False

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._events is not None:
            raise SharkportError("a GenerationRun can be iterated only once")
        self._events = self._run()
        return self._events

    def results(self) -> list[list[Generation]]:
        if not self._done:
            for _ in (self if self._events is None else self._events):
                pass
        out: list[list[Generation]] = [[] for _ in range(self._n_prompts)]
        for s in self._seqs:
            scores = self.config.output_scores
            out[s.prompt_index].append(Generation(
                s.tokens, s.text if self.tokenizer is not None else None, s.finish_reason,
                s.logits if scores else None, s.scores if scores else None, s.first_token_s, s.latency_s))
        return out

    # -- scheduling -------------------------------------------------------------------------------
    def _pages_needed(self, s: _Seq) -> int:
        return math.ceil((len(s.prompt) + self.config.new_tokens(len(s.prompt))) / self._stride)

    def _run(self) -> Iterator[TokenEvent]:
        self._t0 = t0 = time.perf_counter()
        for s in self._seqs:
            if self.config.new_tokens(len(s.prompt)) == 0:
                s.finish_reason = "length"
        if all(s.finish_reason for s in self._seqs):
            self._done = True
            return
        allocator = page_allocator(self.session)
        self._scratch = allocator.alloc(1, wait=True)[0]  # written by padding rows only
        waiting, running = deque(s for s in self._seqs if not s.finish_reason), []
        try:
            while waiting or running:
                admitted = self._admit(waiting, running, allocator)
                if waiting and not admitted and not running:  # only another run can free pages for it
                    s = waiting.popleft()
                    s.pages = allocator.alloc(self._pages_needed(s), wait=True)
                    admitted = [s]
                running += admitted
                if admitted:
                    yield from self._prefill(admitted)
                self._release(running, allocator)
                if running:
                    yield from self._decode(running)
                    self._release(running, allocator)
            self._done = True
        finally:  # also when the caller stops iterating (GeneratorExit) or a call fails
            for s in running:
                allocator.free(s.pages)
            allocator.free([self._scratch])
            self.stats.total_s += time.perf_counter() - t0

    def _admit(self, waiting: deque, running: list[_Seq], allocator: PageAllocator) -> list[_Seq]:
        """Sequences that start now, each with the pages for its whole length."""
        if not self.continuous:  # a whole group, once the previous one has finished
            if running or not waiting:
                return []
            group = [waiting.popleft() for _ in range(min(self._rows, len(waiting)))]
            pages = allocator.alloc(sum(self._pages_needed(s) for s in group), wait=True)
            for s in group:
                s.pages, pages = pages[:self._pages_needed(s)], pages[self._pages_needed(s):]
            return group
        admitted = []  # in arrival order: a long prompt is not overtaken forever by short ones
        while waiting and len(running) + len(admitted) < self._rows:
            pages = allocator.try_alloc(self._pages_needed(waiting[0]))
            if pages is None:
                break
            s = waiting.popleft()
            s.pages = pages
            admitted.append(s)
        return admitted

    @staticmethod
    def _release(running: list[_Seq], allocator: PageAllocator) -> None:
        for s in [s for s in running if s.finish_reason]:
            running.remove(s)
            allocator.free(s.pages)
            s.pages = []

    # -- module calls -----------------------------------------------------------------------------
    def _prefill(self, seqs: list[_Seq]) -> Iterator[TokenEvent]:
        bs = pick_batch_size(self.session.config.prefill_batch_sizes, len(seqs), "prefill")
        for start in range(0, len(seqs), bs):
            part = seqs[start:start + bs]
            # a short prompt's tail blocks write to the scratch page
            inputs = prefill_inputs([s.prompt for s in part], [s.pages for s in part], bs, self._stride, self._scratch)
            t = time.perf_counter()
            logits = self.session.prefill(*inputs)
            self.stats.prefill_s += time.perf_counter() - t
            self.stats.prefill_calls += 1
            self.stats.prefill_tokens += sum(len(s.prompt) for s in part)
            for r, s in enumerate(part):
                yield from self._step(s, next_token_logits(logits, r, len(s.prompt)))

    def _decode(self, seqs: list[_Seq]) -> Iterator[TokenEvent]:
        bs = pick_batch_size(self.session.config.decode_batch_sizes, len(seqs), "decode")
        inputs = decode_inputs([s.tokens[-1] for s in seqs], [s.position for s in seqs], [s.pages for s in seqs],
                               bs, self._stride, self._scratch)
        t = time.perf_counter()
        logits = self.session.decode(*inputs)
        self.stats.decode_s += time.perf_counter() - t
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(seqs)
        for r, s in enumerate(seqs):
            yield from self._step(s, logits[r, 0])

    # -- one token ----------------------------------------------------------------------------------
    def _step(self, s: _Seq, logits: np.ndarray) -> Iterator[TokenEvent]:
        config = self.config
        scores = process_logits(logits, s.prompt + s.tokens, config, generated=len(s.tokens))
        token = choose(scores, config, s.rng)
        s.tokens.append(token)
        if config.output_scores:
            s.logits.append(np.array(logits, np.float32, copy=True))
            s.scores.append(scores)
        now = time.perf_counter() - self._t0
        if len(s.tokens) == 1:
            s.first_token_s = now
            if not self.stats.first_token_s:
                self.stats.first_token_s = now
        self.stats.generated_tokens += 1

        finish = "stop" if token in config.stop_token_ids else None
        text = None
        if self.tokenizer is not None:
            if s.decoder is None:
                s.decoder = self.tokenizer.stream_decoder()
            s.text += s.decoder.add(token)
            if finish or len(s.tokens) >= config.new_tokens(len(s.prompt)):
                s.text += s.decoder.flush()  # nothing more comes: release held-back bytes
            if self._cut_at_stop(s):
                finish = "stop"
        if not finish and len(s.tokens) >= config.new_tokens(len(s.prompt)):
            finish = "length"
        if self.tokenizer is not None:
            text = self._emit(s, final=finish is not None)
        if finish:
            s.finish_reason, s.latency_s = finish, now
        yield TokenEvent(s.prompt_index, s.sequence_index, token, text, finish)

    def _cut_at_stop(self, s: _Seq) -> bool:
        """Cuts the text before the first stop string in it; True if there was one."""
        hits = [i for i in (s.text.find(stop) for stop in self.config.stop) if i >= 0]
        if hits:
            s.text = s.text[:min(hits)]
        return bool(hits)

    def _emit(self, s: _Seq, final: bool) -> str:
        """The text not yet streamed, minus (unless final) a tail that may begin a stop string."""
        end = len(s.text)
        if not final:  # hold back a tail that may grow into a stop string
            for stop in self.config.stop:
                for n in range(min(len(stop) - 1, end), 0, -1):
                    if s.text.endswith(stop[:n]):
                        end = min(end, len(s.text) - n)
                        break
        start, s.emitted = s.emitted, max(s.emitted, end)
        return s.text[start:end]


def _rng(seed: int | None, prompt_index: int, sequence_index: int) -> np.random.Generator:
    """Each sequence draws from its own generator, so its tokens do not depend on its batch."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed, prompt_index, sequence_index])


def generate(session: Session, prompts: list[list[int]], max_new_tokens: int,
             eos_ids: set[int] = frozenset(), on_token: Callable[[int, int], None] | None = None,
             stats: GenerateStats | None = None, continuous: bool = True) -> list[list[int]]:
    """Greedy continuation of each prompt (token ids): the new ids of each prompt, ending at the
    first EOS (included) or after max_new_tokens. `on_token(prompt_index, id)` sees each new
    token as it is chosen. A shorthand for GenerationRun with a greedy GenerationConfig."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=tuple(eos_ids))
    run = GenerationRun(session, prompts, config, continuous=continuous, stats=stats)
    for event in run:
        if on_token is not None:
            on_token(event.prompt_index, event.token_id)
    return [gens[0].token_ids for gens in run.results()]
