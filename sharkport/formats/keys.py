"""Hyperparameters of the llama family as one table over GGUF keys (`{arch}.…`).

The archive stores GGUF keys verbatim; this table is the only place that knows their names,
types and defaults, so a recipe reads `LlamaHParams` and never a raw key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import SharkportError

_REQUIRED = object()

# field name -> (GGUF key suffix after "{arch}.", default). A default of None is derived in
# __post_init__ from other fields.
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
}


@dataclass(frozen=True)
class LlamaHParams:
    """Llama-family hyperparameters (names follow the GGUF keys)."""

    arch: str
    block_count: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    head_dim: int
    rope_dim: int
    rope_freq_base: float
    rms_eps: float
    context_length: int
    vocab_size: int

    def __post_init__(self):
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

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], vocab_size: int | None = None) -> "LlamaHParams":
        """Reads the hyperparameters from GGUF-keyed metadata; `vocab_size` fills in when the
        metadata has no `{arch}.vocab_size` (older GGUFs: take it from token_embd)."""
        arch = metadata.get("general.architecture")
        if not arch:
            raise SharkportError("metadata has no general.architecture key; is this a model file?")
        values: dict[str, Any] = {"arch": arch}
        for field, (suffix, default) in LLAMA_KEYS.items():
            key = f"{arch}.{suffix}"
            if key in metadata:
                values[field] = metadata[key]
            elif default is _REQUIRED:
                raise SharkportError(f"metadata is missing the required key {key}")
            else:
                values[field] = default
        if values["head_count_kv"] is None:
            values["head_count_kv"] = values["head_count"]
        if values["head_dim"] is None:
            values["head_dim"] = values["embedding_length"] // values["head_count"]
        if values["rope_dim"] is None:
            values["rope_dim"] = values["head_dim"]
        if values["vocab_size"] is None:
            values["vocab_size"] = vocab_size if vocab_size is not None else _tokenizer_size(metadata)
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        converted = {k: (float(v) if types[k] == "float" else int(v) if types[k] == "int" else v)
                     for k, v in values.items()}
        return cls(**converted)

    def to_metadata(self) -> dict[str, Any]:
        """The inverse of from_metadata: GGUF keys for every field."""
        out: dict[str, Any] = {"general.architecture": self.arch}
        for field, (suffix, _) in LLAMA_KEYS.items():
            out[f"{self.arch}.{suffix}"] = getattr(self, field)
        return out


def _tokenizer_size(metadata: dict[str, Any]) -> int:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise SharkportError(
            "metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens; cannot size the vocabulary"
        )
    return len(tokens)
