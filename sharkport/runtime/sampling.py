"""Choosing the next token on the host: the generation config and pure logits processors.

The processors follow the usual definitions (those of `transformers`' RepetitionPenalty-
LogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, applied in that
order) on one float32 row of logits [V]. Filtered tokens get -inf, so the processed scores show
exactly which candidates were left.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import SharkportError


@dataclass(frozen=True)
class GenerationConfig:
    """How to continue a prompt. Greedy by default; `do_sample=True` samples from the processed
    distribution, with `seed` making the result repeat (each sequence has its own generator, so
    a sequence's tokens do not depend on what it is batched with).

    `stop` strings end a generation when its text contains one (the text is cut before it);
    `stop_token_ids` end it on those ids (the tokenizer's EOS is added by the generator).
    `output_scores` keeps, per step, the raw `logits` [V] and the processed `scores` [V]."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no top-p filter
    repetition_penalty: float = 1.0  # 1.0: none; > 1 discourages tokens already in the sequence
    seed: int | None = None
    num_return_sequences: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    output_scores: bool = False

    def __post_init__(self):
        # Lists from JSON or kwargs become tuples, so the config stays hashable and frozen.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        checks = [
            (self.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (self.temperature >= 0, "temperature must be >= 0 (0 means greedy)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, "top_p must lie in (0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 turns it off)"),
            (self.num_return_sequences >= 1, "num_return_sequences must be >= 1"),
            (all(self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise SharkportError(f"generation config: {message}, got {self}")
        if self.num_return_sequences > 1 and not self.sampling:
            raise SharkportError("generation config: num_return_sequences > 1 needs do_sample=True "
                                 "(greedy decoding would return the same sequence each time)")

    @property
    def sampling(self) -> bool:
        """True when tokens are drawn at random (do_sample with a temperature above 0)."""
        return self.do_sample and self.temperature > 0

    @classmethod
    def make(cls, config: "GenerationConfig | Mapping[str, Any] | None" = None,
             **overrides: Any) -> "GenerationConfig":
        """A config from another config or a dict, with keyword overrides; unknown keys are errors."""
        base = dataclasses.asdict(config) if isinstance(config, GenerationConfig) else dict(config or {})
        base.update(overrides)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(base) - known)
        if unknown:
            raise SharkportError(f"generation config: unknown option(s) {', '.join(unknown)}; "
                                 f"known: {', '.join(sorted(known))}")
        return cls(**base)


# ---------------------------------------------------------------------------------------------
# Logits processors: [V] float32 → [V] float32
# ---------------------------------------------------------------------------------------------

def repetition_penalty(logits: np.ndarray, previous_ids: Iterable[int], penalty: float) -> np.ndarray:
    """Tokens already in the sequence (prompt included): positive logits divided by `penalty`,
    negative ones multiplied by it (CTRL, Keskar et al. 2019)."""
    out = logits.copy()
    ids = np.unique(np.fromiter(previous_ids, np.int64))
    ids = ids[ids < len(out)]
    seen = out[ids]
    out[ids] = np.where(seen < 0, seen * penalty, seen / penalty)
    return out


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keeps the k largest logits (and any tied with the k-th), -inf elsewhere."""
    if k <= 0 or k >= len(logits):
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits < kth, -np.inf, logits).astype(logits.dtype)


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Keeps the smallest set of most likely tokens whose probabilities sum to at least p
    (nucleus sampling, Holtzman et al. 2019), -inf elsewhere; the most likely token always stays."""
    if p >= 1.0:
        return logits
    order = np.argsort(logits, kind="stable")  # ascending, as transformers sorts
    probs = softmax(logits[order].astype(np.float64))
    remove_sorted = np.cumsum(probs) <= 1 - p
    remove_sorted[-1] = False
    remove = np.empty_like(remove_sorted)
    remove[order] = remove_sorted
    return np.where(remove, -np.inf, logits).astype(logits.dtype)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def process_logits(logits: np.ndarray, previous_ids: Iterable[int], config: GenerationConfig) -> np.ndarray:
    """The scores a token is chosen from: repetition penalty, then (when sampling) temperature,
    top-k and top-p."""
    scores = logits.astype(np.float32, copy=True)
    if config.repetition_penalty != 1.0:
        scores = repetition_penalty(scores, previous_ids, config.repetition_penalty)
    if config.sampling:
        if config.temperature != 1.0:
            scores = scores / np.float32(config.temperature)
        scores = top_p_filter(top_k_filter(scores, config.top_k), config.top_p)
    return scores


def choose(scores: np.ndarray, config: GenerationConfig, rng: np.random.Generator) -> int:
    """The next token: argmax of the scores, or a draw from their softmax when sampling."""
    if not config.sampling:
        return int(np.argmax(scores))
    probs = softmax(scores.astype(np.float64))
    return int(rng.choice(len(probs), p=probs))
