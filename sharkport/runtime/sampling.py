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

    `max_new_tokens` bounds the new tokens; without it, `max_length` bounds prompt plus new
    tokens (as in transformers, max_new_tokens wins when both are set). `stop` strings end a
    generation when its text contains one (the text is cut before it); `stop_token_ids` end it
    on those ids (the tokenizer's EOS is added by the generator), and `min_new_tokens` holds
    them off until that many tokens are generated. `output_scores` keeps, per step, the raw
    `logits` [V] and the processed `scores` [V].

    `make` also takes transformers' names (eos_token_id, stop_strings) and a
    `transformers.GenerationConfig` (docs/generation.md has the table)."""

    max_new_tokens: int | None = 32
    max_length: int | None = None
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no top-p filter
    min_p: float = 0.0  # 0.0: no min-p filter
    repetition_penalty: float = 1.0  # 1.0: none; > 1 discourages tokens already in the sequence
    seed: int | None = None
    num_return_sequences: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    output_scores: bool = False

    def __post_init__(self):
        # Lists from JSON or kwargs become tuples, so the config stays hashable and frozen.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        ids = self.stop_token_ids
        object.__setattr__(self, "stop_token_ids", (int(ids),) if isinstance(ids, int) else tuple(int(i) for i in ids))
        checks = [
            (self.max_new_tokens is not None or self.max_length is not None,
             "give max_new_tokens or max_length"),
            (_whole(self.max_new_tokens, allow_none=True), "max_new_tokens must be a whole number >= 0"),
            (_whole(self.max_length, allow_none=True), "max_length must be a whole number >= 0"),
            (_whole(self.min_new_tokens), "min_new_tokens must be a whole number >= 0"),
            (self.temperature >= 0, "temperature must be >= 0 (0 means greedy)"),
            (_whole(self.top_k), "top_k must be a whole number >= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, "top_p must lie in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must lie in [0, 1] (0 turns it off)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 turns it off)"),
            (_whole(self.seed, allow_none=True), "seed must be a whole number >= 0"),
            (_whole(self.num_return_sequences) and self.num_return_sequences >= 1,
             "num_return_sequences must be a whole number >= 1"),
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

    def new_tokens(self, prompt_length: int) -> int:
        """The most tokens a prompt of this length is continued by."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return max(self.max_length - prompt_length, 0)

    @classmethod
    def make(cls, config: Any = None, **overrides: Any) -> "GenerationConfig":
        """A config from another config, a dict or a `transformers.GenerationConfig`, with keyword
        overrides; transformers' names are taken too, unknown keys are errors."""
        if isinstance(config, GenerationConfig):
            base = dataclasses.asdict(config)
        elif _is_transformers_config(config):
            base = _from_transformers(config)
        elif config is None or isinstance(config, Mapping):
            base = dict(config or {})
        else:
            raise SharkportError(f"generation config: expected a GenerationConfig, a dict or a "
                                 f"transformers.GenerationConfig, got {type(config).__name__}")
        base, overrides = _renamed(base), _renamed(overrides)
        given = {**base, **overrides}
        if "max_length" in overrides and "max_new_tokens" not in overrides:
            given["max_new_tokens"] = None  # max_length alone bounds the sequence
        elif "max_length" in given and "max_new_tokens" not in given:
            given["max_new_tokens"] = None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise SharkportError(f"generation config: unknown option(s) {', '.join(unknown)}; "
                                 f"known: {', '.join(sorted(known | set(ALIASES)))}")
        return cls(**given)


# transformers' names for our fields
ALIASES = {"eos_token_id": "stop_token_ids", "stop_strings": "stop"}
# transformers.GenerationConfig fields that do not change which tokens are generated
_TRANSFORMERS_IGNORED = {"transformers_version", "pad_token_id", "bos_token_id", "decoder_start_token_id",
                         "use_cache", "return_dict_in_generate", "output_logits", "output_attentions",
                         "output_hidden_states", "_from_model_config", "cache_implementation"}


def _whole(value: Any, allow_none: bool = False) -> bool:
    if value is None:
        return allow_none
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0


def _renamed(options: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in options.items():
        name = ALIASES.get(key, key)
        if name in out and key != name:
            raise SharkportError(f"generation config: {key} and {name} name the same option; give one")
        out[name] = value
    return out


def _is_transformers_config(config: Any) -> bool:
    return type(config).__name__ == "GenerationConfig" and type(config).__module__.startswith("transformers.")


def _from_transformers(config: Any) -> dict[str, Any]:
    """A transformers.GenerationConfig, meaning what it means to transformers' generate(): unset
    fields take transformers' defaults (top_k 50, max_length 20); settings that would change the
    tokens and that this generator does not have (beam search, ...) are errors."""
    ours = {f.name for f in dataclasses.fields(GenerationConfig)} | set(ALIASES)
    values = {k: v for k, v in config.to_dict().items() if v is not None}
    defaults = getattr(type(config), "_get_default_generation_params", dict)()
    unsupported = sorted(k for k, v in values.items() if k not in ours and k not in _TRANSFORMERS_IGNORED
                         and not k.startswith("_") and v != defaults.get(k))
    if unsupported:
        raise SharkportError("generation config: transformers setting(s) "
                             f"{', '.join(f'{k}={values[k]!r}' for k in unsupported)} are not supported; "
                             f"supported: {', '.join(sorted(ours))}")
    base = {k: v for k, v in values.items() if k in ours}
    base.setdefault("top_k", defaults.get("top_k", 50))
    if "max_new_tokens" not in base:
        base.setdefault("max_length", defaults.get("max_length", 20))
    if "output_scores" in base:
        base["output_scores"] = bool(base["output_scores"])
    return base


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


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Keeps the tokens whose probability is at least min_p times the most likely one's, -inf
    elsewhere; the most likely token always stays."""
    if min_p <= 0.0:
        return logits
    probs = softmax(logits.astype(np.float64))
    remove = probs < min_p * probs.max()
    remove[np.argmax(probs)] = False
    return np.where(remove, -np.inf, logits).astype(logits.dtype)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def process_logits(logits: np.ndarray, previous_ids: Iterable[int], config: GenerationConfig,
                   generated: int = 0) -> np.ndarray:
    """The scores a token is chosen from, in transformers' order: repetition penalty, the stop
    tokens held off while fewer than min_new_tokens are `generated`, then (when sampling)
    temperature, top-k, top-p and min-p."""
    scores = logits.astype(np.float32, copy=True)
    if config.repetition_penalty != 1.0:
        scores = repetition_penalty(scores, previous_ids, config.repetition_penalty)
    if generated < config.min_new_tokens and config.stop_token_ids:
        ids = np.array(config.stop_token_ids, np.int64)
        scores[ids[ids < len(scores)]] = -np.inf
    if config.sampling:
        if config.temperature != 1.0:
            scores = scores / np.float32(config.temperature)
        scores = top_p_filter(top_k_filter(scores, config.top_k), config.top_p)
        scores = min_p_filter(scores, config.min_p)
    return scores


def choose(scores: np.ndarray, config: GenerationConfig, rng: np.random.Generator) -> int:
    """The next token: argmax of the scores, or a draw from their softmax when sampling."""
    if not config.sampling:
        return int(np.argmax(scores))
    probs = softmax(scores.astype(np.float64))
    return int(rng.choice(len(probs), p=probs))
