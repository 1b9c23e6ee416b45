"""Hyperparameters per architecture as tables over GGUF keys (`{arch}.…`).

The archive stores GGUF keys verbatim; these tables are the only place that knows their names,
types and defaults, so a recipe reads its HParams class and never a raw key:

* `LlamaHParams` — llama, Mistral (`attention.sliding_window`), Mixtral (`expert_count`,
  `expert_used_count`) under `general.architecture = llama`, and `qwen2` (same keys).
* `Gemma3HParams` — the llama keys plus the sliding-window pattern, the local rope base, the
  attention scale and logit soft-capping.
* `GPT2HParams` — LayerNorm epsilon, no rotary keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import SharkportError, is_number, is_whole, short

_REQUIRED = object()

# field name -> (GGUF key suffix after "{arch}.", default). A default of None is derived in
# `_derive` from other fields. Fields listed in OPTIONAL_FIELDS are left out of to_metadata
# while they hold their default (a plain llama file has no expert_count key).
LLAMA_KEYS: dict[str, tuple[str, Any]] = {
    "block_count": ("block_count", _REQUIRED),
    "embedding_length": ("embedding_length", _REQUIRED),
    "feed_forward_length": ("feed_forward_length", _REQUIRED),
    "head_count": ("attention.head_count", _REQUIRED),
    "head_count_kv": ("attention.head_count_kv", None),
    "head_dim": ("attention.key_length", None),
    "rope_dim": ("rope.dimension_count", None),
    "rope_freq_base": ("rope.freq_base", 10000.0),
    "rms_eps": ("attention.layer_norm_rms_epsilon", 1e-5),
    "context_length": ("context_length", 2048),
    "vocab_size": ("vocab_size", None),
    # 0: every position attends to all earlier ones (Mistral: its window, e.g. 4096).
    "sliding_window": ("attention.sliding_window", 0),
    # 0: a dense feed-forward block; > 0: a mixture of experts (Mixtral).
    "expert_count": ("expert_count", 0),
    "expert_used_count": ("expert_used_count", 0),
}

GEMMA3_KEYS: dict[str, tuple[str, Any]] = {
    **LLAMA_KEYS,
    "rms_eps": ("attention.layer_norm_rms_epsilon", 1e-6),
    # llama.cpp reads neither of the next two from Gemma-3 files: every 6th layer is global and
    # local layers use rope base 10000. A list (true = sliding) comes from HF `layer_types`.
    "sliding_window_pattern": ("attention.sliding_window_pattern", 6),
    "rope_freq_base_swa": ("rope.freq_base_swa", 10000.0),
    # Scale of q·k; None: 1/sqrt(head_dim) (HF query_pre_attn_scalar ** -0.5).
    "attention_scale": ("attention.scale", None),
    "final_logit_softcapping": ("final_logit_softcapping", 0.0),
    "attn_logit_softcapping": ("attn_logit_softcapping", 0.0),
}

GPT2_KEYS: dict[str, tuple[str, Any]] = {
    "block_count": ("block_count", _REQUIRED),
    "embedding_length": ("embedding_length", _REQUIRED),
    "feed_forward_length": ("feed_forward_length", None),
    "head_count": ("attention.head_count", _REQUIRED),
    "norm_eps": ("attention.layer_norm_epsilon", 1e-5),
    "context_length": ("context_length", _REQUIRED),
    "vocab_size": ("vocab_size", None),
}

MAX_SIZE = 2**31 - 1  # every size and count a model holds fits in int32 (positions, windows, rows)
_POSITIVE_INTS = {"block_count", "embedding_length", "feed_forward_length", "head_count", "head_count_kv",
                  "head_dim", "rope_dim", "context_length", "vocab_size"}
_POSITIVE_FLOATS = {"rope_freq_base", "rms_eps", "norm_eps", "rope_freq_base_swa"}
_NON_NEGATIVE = {"sliding_window", "expert_count", "expert_used_count", "attention_scale",
                 "final_logit_softcapping", "attn_logit_softcapping"}

OPTIONAL_FIELDS = ("sliding_window", "expert_count", "expert_used_count", "sliding_window_pattern",
                   "rope_freq_base_swa", "attention_scale", "final_logit_softcapping",
                   "attn_logit_softcapping")


@dataclass(frozen=True)
class HParams:
    """Reads and writes a KEYS table; subclasses add fields, KEYS and `_derive`."""

    KEYS: ClassVar[dict[str, tuple[str, Any]]] = {}
    arch: str

    def __post_init__(self):
        """Sizes must be whole numbers above 0 and scales finite and above 0 (a file's word for
        them sizes every allocation and a negative epsilon gives NaN logits); the optional
        counts and caps are at least 0."""
        for f in dataclasses.fields(self):
            _check_range(self.arch, self.KEYS, f.name, getattr(self, f.name))

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], vocab_size: int | None = None):
        """Reads the hyperparameters from GGUF-keyed metadata; `vocab_size` fills in when the
        metadata has no `{arch}.vocab_size` (older GGUFs: take it from token_embd)."""
        arch = metadata.get("general.architecture")
        if not arch:
            raise SharkportError("metadata has no general.architecture key; is this a model file?")
        if not isinstance(arch, str):
            raise SharkportError(f"general.architecture is {short(arch)}, not a name")
        values: dict[str, Any] = {"arch": arch}
        for field, (suffix, default) in cls.KEYS.items():
            key = f"{arch}.{suffix}"
            if metadata.get(key) is not None:
                values[field] = metadata[key]
            elif default is _REQUIRED:
                raise SharkportError(f"metadata is missing the required key {key}")
            else:
                values[field] = default
        if values.get("vocab_size") is None:
            values["vocab_size"] = vocab_size if vocab_size is not None else _tokenizer_size(metadata)
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for field, value in values.items():  # typed and in range before anything is derived from them
            if field != "arch" and value is not None:  # None: derived from the others below
                values[field] = _convert(value, types[field], f"{arch}.{cls.KEYS.get(field, (field,))[0]}")
                _check_range(arch, cls.KEYS, field, values[field])
        cls._derive(values)
        return cls(**values)

    @classmethod
    def _derive(cls, values: dict[str, Any]) -> None:
        """Fills the fields whose default is None from the others."""

    def to_metadata(self) -> dict[str, Any]:
        """The inverse of from_metadata: GGUF keys for every field (optional ones when set)."""
        out: dict[str, Any] = {"general.architecture": self.arch}
        for field, (suffix, default) in self.KEYS.items():
            value = getattr(self, field)
            if field in OPTIONAL_FIELDS and value == default:
                continue
            out[f"{self.arch}.{suffix}"] = value
        return out


@dataclass(frozen=True)
class DecoderHParams(HParams):
    """What every decoder-only recipe has: its depth, widths, heads, context and vocabulary."""

    block_count: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    context_length: int
    vocab_size: int


@dataclass(frozen=True)
class LlamaHParams(DecoderHParams):
    """Llama-family hyperparameters (names follow the GGUF keys)."""

    KEYS: ClassVar[dict[str, tuple[str, Any]]] = LLAMA_KEYS
    head_count_kv: int
    head_dim: int
    rope_dim: int
    rope_freq_base: float
    rms_eps: float
    sliding_window: int = 0
    expert_count: int = 0
    expert_used_count: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.head_count % self.head_count_kv:
            raise SharkportError(
                f"{self.arch}.attention.head_count ({self.head_count}) is not a multiple of "
                f"head_count_kv ({self.head_count_kv}); the model metadata is inconsistent"
            )
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise SharkportError(
                f"{self.arch}.rope.dimension_count ({self.rope_dim}) must be even and at most "
                f"the head dim ({self.head_dim})"
            )
        if self.expert_count and not 0 < self.expert_used_count <= self.expert_count:
            raise SharkportError(
                f"{self.arch}.expert_used_count ({self.expert_used_count}) must be between 1 and "
                f"{self.arch}.expert_count ({self.expert_count})"
            )

    @classmethod
    def _derive(cls, values: dict[str, Any]) -> None:
        if values["head_count_kv"] is None:
            values["head_count_kv"] = values["head_count"]
        if values["head_dim"] is None:
            values["head_dim"] = values["embedding_length"] // values["head_count"]
        if values["rope_dim"] is None:
            values["rope_dim"] = values["head_dim"]


@dataclass(frozen=True)
class Gemma3HParams(LlamaHParams):
    """Gemma-3: llama's fields plus interleaved local (sliding) / global attention."""

    KEYS: ClassVar[dict[str, tuple[str, Any]]] = GEMMA3_KEYS
    sliding_window_pattern: int | list = 6
    rope_freq_base_swa: float = 10000.0
    attention_scale: float = 0.0
    final_logit_softcapping: float = 0.0
    attn_logit_softcapping: float = 0.0

    @classmethod
    def _derive(cls, values: dict[str, Any]) -> None:
        super()._derive(values)
        if values["attention_scale"] is None:
            values["attention_scale"] = values["head_dim"] ** -0.5

    def to_metadata(self) -> dict[str, Any]:
        out = super().to_metadata()
        if self.attention_scale == self.head_dim ** -0.5:  # the derived default
            out.pop(f"{self.arch}.{self.KEYS['attention_scale'][0]}", None)
        return out

    def __post_init__(self):
        super().__post_init__()
        p, key = self.sliding_window_pattern, f"{self.arch}.{self.KEYS['sliding_window_pattern'][0]}"
        if isinstance(p, list) and (len(p) != self.block_count or not all(isinstance(x, (bool, int)) for x in p)):
            raise SharkportError(f"{key} lists {len(p)} values; it needs one true/false per block "
                                 f"({self.block_count})")
        if not isinstance(p, list) and not (is_whole(p) and p > 0):
            raise SharkportError(f"{key} is {short(p)}; it must be a whole number above 0 or one true/false per block")

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window (local) or to everything (global).
        An int pattern n makes every n-th layer global, as llama.cpp does for Gemma-3."""
        if not self.sliding_window:
            return False
        p = self.sliding_window_pattern
        return bool(p[layer]) if isinstance(p, list) else (layer + 1) % p != 0


@dataclass(frozen=True)
class GPT2HParams(DecoderHParams):
    """GPT-2: learned positions, LayerNorm, fused QKV, GELU; heads share E / head_count dims."""

    KEYS: ClassVar[dict[str, tuple[str, Any]]] = GPT2_KEYS
    norm_eps: float

    def __post_init__(self):
        super().__post_init__()
        if self.embedding_length % self.head_count:
            raise SharkportError(f"{self.arch}.attention.head_count ({self.head_count}) does not divide "
                                 f"{self.arch}.embedding_length ({self.embedding_length}); the model metadata "
                                 "is inconsistent")

    @classmethod
    def _derive(cls, values: dict[str, Any]) -> None:
        if values["feed_forward_length"] is None:
            values["feed_forward_length"] = 4 * values["embedding_length"]

    @property
    def head_dim(self) -> int:
        return self.embedding_length // self.head_count

    @property
    def head_count_kv(self) -> int:
        return self.head_count


# general.architecture → its hyperparameter class (recipes and importers look it up here).
HPARAMS: dict[str, type[HParams]] = {
    "llama": LlamaHParams,
    "qwen2": LlamaHParams,
    "gemma3": Gemma3HParams,
    "gpt2": GPT2HParams,
}


def _convert(value: Any, type_name: str, key: str) -> Any:
    """A metadata value as its field's type: an int field takes whole numbers, a float field any
    number; else one SharkportError naming the key."""
    if value is None or (isinstance(value, list) and "list" in type_name):
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)  # inf and NaN: _check_range
    if type_name.startswith("float") and number:
        return float(value)
    if type_name.startswith("int") and number and (isinstance(value, int) or float(value).is_integer()):
        return int(value)
    kind = "a whole number" if type_name.startswith("int") else "a number"
    raise SharkportError(f"{key} is {short(value)}; it must be {kind}")


def _check_range(arch: str, keys: dict[str, tuple[str, Any]], field: str, value: Any) -> None:
    name = f"{arch}.{keys.get(field, (field,))[0]}"
    if field in _POSITIVE_INTS and not (is_whole(value) and value > 0):
        raise SharkportError(f"{name} is {short(value)}; it must be a whole number above 0")
    if field in _POSITIVE_INTS | _NON_NEGATIVE and isinstance(value, int) and value > MAX_SIZE:
        raise SharkportError(f"{name} is {value}; sizes and counts above {MAX_SIZE} are not supported")
    if field in _POSITIVE_FLOATS and not (is_number(value) and value > 0):
        raise SharkportError(f"{name} is {short(value)}; it must be a finite number above 0")
    if field in _NON_NEGATIVE and isinstance(value, (int, float)) and not value >= 0:
        raise SharkportError(f"{name} is {short(value)}; it must be at least 0")


def _tokenizer_size(metadata: dict[str, Any]) -> int:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise SharkportError(
            "metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens; cannot size the vocabulary"
        )
    return len(tokens)
