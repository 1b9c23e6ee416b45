"""The tokenizer metadata of a GGUF file (llama.cpp's `tokenizer.*` keys) and typed readers of it.

The metadata is a dict from GGUF key to plain Python value, as made by
``{k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}`` (a JSON round trip of it
works too). It comes from someone else's file, so every value is read through a reader that
checks its kind and reports a wrong one as one SharkportError naming the key.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable, Mapping

from ..errors import SharkportError, is_whole, short

# llama.cpp's token types (the same numbering as SentencePiece's piece types).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# The types that decoding with skip_special_tokens leaves out.
SPECIAL_TYPES = (TOKEN_CONTROL, TOKEN_UNKNOWN)

KEY_MODEL = "tokenizer.ggml.model"
KEY_PRE = "tokenizer.ggml.pre"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_SCORES = "tokenizer.ggml.scores"
KEY_TYPES = "tokenizer.ggml.token_type"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_HF_JSON = "tokenizer.huggingface.json"
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
SPECIAL_ROLES = ("bos", "eos", "unk", "pad")
ID_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
           "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # the text of a byte token (TOKEN_BYTE)


def tokenizer_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of `metadata` whose keys start with ``"tokenizer."`` (enough to rebuild the
    tokenizer with `Tokenizer.from_gguf_metadata`, e.g. after storing it in an archive)."""
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


# What each kind of tokenizer value must be: (test, what the error calls it).
_KINDS: dict[type, tuple[Callable[[Any], bool], str]] = {
    str: (lambda v: isinstance(v, str), "a string"),
    int: (is_whole, "a whole number"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v), "a number"),
    bool: (lambda v: isinstance(v, bool) or v in (0, 1), "true or false"),
}


def bad_value(key: str, value: Any, kind: type) -> SharkportError:
    """The error for `value` under `key` not being of `kind` (str, int, float, bool)."""
    return SharkportError(f"GGUF key {key} holds {short(value)}, not {_KINDS[kind][1]}; the file is corrupt, "
                          "re-convert it")


def get_list(metadata: Mapping[str, Any], key: str, kind: type, required: bool = True) -> list[Any] | None:
    """The array `key`, every item of `kind` (str, int, float); None when it is absent and not
    `required`."""
    value = metadata.get(key)
    if value is None:
        if required:
            raise SharkportError(
                f"GGUF tokenizer metadata has no {key}: the file carries no usable vocabulary; "
                "re-convert the model with a current llama.cpp convert script"
            )
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or isinstance(value, Mapping):
        raise SharkportError(f"GGUF key {key} should be an array, got {type(value).__name__}")
    value, test = list(value), _KINDS[kind][0]
    bad = next((i for i, v in enumerate(value) if not test(v)), None)
    if bad is not None:
        raise bad_value(f"{key}[{bad}]", value[bad], kind)
    return [float(v) for v in value] if kind is float else value


def get_id(metadata: Mapping[str, Any], key: str, n_vocab: int, default: int | None) -> int | None:
    """The token id `key` (`default` when absent); None when it names no token of the
    `n_vocab` tokens."""
    value = metadata.get(key, default)
    if value is None:
        return None
    if not _KINDS[int][0](value):
        raise bad_value(key, value, int)
    if value < 0 or value >= n_vocab:  # llama.cpp treats an out-of-range id as absent
        return None
    return value


def get_bool(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    """The flag `key` (`default` when absent); 0 and 1 count as false and true."""
    value = metadata.get(key)
    if value is not None and not _KINDS[bool][0](value):
        raise bad_value(key, value, bool)
    return default if value is None else bool(value)


def literal_tokens(tokens: list[str], types: list[int], kinds: tuple[int, ...]) -> list[tuple[str, int]]:
    """(text, id) of every non-empty token whose type is in `kinds`, longest first: the tokens
    recognised as themselves where the text to encode spells them out (llama.cpp's
    special-token cache)."""
    found = [(text, i) for i, (text, t) in enumerate(zip(tokens, types)) if t in kinds and text]
    found.sort(key=lambda s: -len(s[0]))
    return found
