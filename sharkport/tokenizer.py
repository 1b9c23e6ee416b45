"""A tokenizer built from the tokenizer metadata a GGUF file carries (llama.cpp's `tokenizer.*` keys),
or from a Hugging Face checkpoint's tokenizer files (see `tokenizer_metadata_from_hf`).

Two vocabulary kinds are supported, named by `tokenizer.ggml.model`:

* ``"gpt2"``: byte-level BPE (tokens, merges). Text is split by the pre-tokenizer regexes that
  llama.cpp uses for the model's `tokenizer.ggml.pre`, then encoded with a `tokenizers` BPE model.
* ``"llama"``: SentencePiece BPE (tokens, scores, token types). A `ModelProto` is assembled from
  the metadata and loaded into a `sentencepiece.SentencePieceProcessor`.

A third kind has no `tokenizer.ggml.model` but the GGUF key `tokenizer.huggingface.json` (a whole
HF `tokenizer.json`): it is loaded as it is into `tokenizers`, so it encodes exactly as
`transformers` does with the same file.

As in llama.cpp, control, user-defined and unknown tokens written literally in the text
(e.g. ``"<|im_start|>"``) are recognised as single tokens before the rest is encoded, and
decoding works on bytes so a multi-byte character split over tokens comes out whole; see
`Tokenizer.stream_decoder` for decoding one token at a time while generating.

The input everywhere is `metadata`: a dict from GGUF key to plain Python value, as made by
``{k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}`` (a JSON round trip of it
works too).
"""

from __future__ import annotations

import codecs
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from sharkport.errors import SharkportError, is_whole, json_type, short

__all__ = ["Tokenizer", "StreamDecoder", "tokenizer_metadata", "tokenizer_metadata_from_hf",
           "write_hf_tokenizer", "KNOWN_PRE_TOKENIZERS"]

# llama.cpp's token types (the same numbering as SentencePiece's piece types).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

_KEY_MODEL = "tokenizer.ggml.model"
_KEY_PRE = "tokenizer.ggml.pre"
_KEY_TOKENS = "tokenizer.ggml.tokens"
_KEY_SCORES = "tokenizer.ggml.scores"
_KEY_TYPES = "tokenizer.ggml.token_type"
_KEY_MERGES = "tokenizer.ggml.merges"
_KEY_HF_JSON = "tokenizer.huggingface.json"
_KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
_SPECIAL_ROLES = ("bos", "eos", "unk", "pad")
_ID_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
            "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}


# ---------------------------------------------------------------------------------------------
# Pre-tokenizers of byte-level BPE vocabularies
# ---------------------------------------------------------------------------------------------

# The regexes are applied one after another, each splitting every piece left by the previous
# one into matched and unmatched parts (llama.cpp's unicode_regex_split; in `tokenizers` terms a
# Sequence of Split(..., "isolated")). They are written for Oniguruma (the `tokenizers` engine).
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS_ANY_CASE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_LLAMA3 = (
    _CONTRACTIONS_ANY_CASE
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    _CONTRACTIONS_ANY_CASE
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPERISH = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWERISH = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_RE_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN35 = (
    _CONTRACTIONS_ANY_CASE
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
# Cased letters, as in DeepSeek LLM's tokenizer.json (escaped: the literal characters include
# compatibility forms that editors silently normalise).
_RE_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How llama.cpp treats one `tokenizer.ggml.pre` value of a byte-level BPE vocabulary."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True  # detokenizer drops the space in " ?", " !", " .", " ,", " 's" ...
    ignore_merges: bool = False  # a piece that is itself in the vocabulary is one token
    add_bos: bool = False  # default of tokenizer.ggml.add_bos_token


_DEFAULT = _PreTokenizer(
    (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
)
_GPT2 = _PreTokenizer((_RE_GPT2,))
_LLAMA3 = _PreTokenizer((_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_DBRX = _PreTokenizer((_RE_LLAMA3,))
_DIGITS_GPT2 = _PreTokenizer((r"\p{N}", _RE_GPT2))
_QWEN2 = _PreTokenizer((_RE_QWEN2,), clean_spaces=False)

# Every `tokenizer.ggml.pre` value known here, grouped the way llama.cpp groups them.
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4"], _GPT2),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"], _LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _DBRX),
    "chatglm-bpe": _PreTokenizer((_RE_LLAMA3,)),
    "glm4": _PreTokenizer((_RE_LLAMA3,)),
    **dict.fromkeys(["starcoder", "refact", "codeshell", "exaone", "minerva-7b"], _DIGITS_GPT2),
    **dict.fromkeys(["smollm", "command-r"], _PreTokenizer((r"\p{N}", _RE_GPT2), clean_spaces=False)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "hunyuan"], _QWEN2),
    "stablelm2": _PreTokenizer((_RE_QWEN2,)),
    **dict.fromkeys(
        ["gpt-4o", "llama4"], _PreTokenizer((_RE_GPT4O,), clean_spaces=False)
    ),
    "tekken": _PreTokenizer((_RE_TEKKEN,), clean_spaces=False, ignore_merges=True, add_bos=True),
    "falcon": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, r"[0-9][0-9][0-9]")),
    "deepseek-coder": _PreTokenizer(
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
        clean_spaces=False,
    ),
    "deepseek-llm": _PreTokenizer(
        (
            r"[\r\n]",
            _RE_DEEPSEEK_LLM_LETTERS,
            r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
            r"\s+$",
            r"[一-龥ࠀ-一가-퟿]+",
            r"\p{N}+",
        ),
        clean_spaces=False,
    ),
    "deepseek-v3": _PreTokenizer(
        (
            r"\p{N}{1,3}",
            r"[一-龥぀-ゟ゠-ヿ]+",
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        clean_spaces=False,
    ),
    "qwen35": _PreTokenizer((_RE_QWEN35,), clean_spaces=False),
    **dict.fromkeys(["bloom", "gpt3-finnish"], _PreTokenizer((_RE_PORO,))),
    "poro-chat": _PreTokenizer((_RE_PORO,), clean_spaces=False),
    "viking": _PreTokenizer((_RE_PORO, r"\p{N}"), clean_spaces=False),
}

KNOWN_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_PRE_TOKENIZERS))
"""The `tokenizer.ggml.pre` values a "gpt2" (byte-level BPE) vocabulary may name."""


# ---------------------------------------------------------------------------------------------
# Metadata helpers
# ---------------------------------------------------------------------------------------------


def tokenizer_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of `metadata` whose keys start with ``"tokenizer."`` (enough to rebuild the
    tokenizer with `Tokenizer.from_gguf_metadata`, e.g. after storing it in an archive)."""
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


def tokenizer_metadata_from_hf(files: Mapping[str, Any], where: Any = "") -> dict[str, Any]:
    """GGUF tokenizer keys for an HF checkpoint's tokenizer files, as `hf_tokenizer_files` in
    sharkport.formats.hf returns them (`tokenizer.json` text, `tokenizer.model` base64,
    `tokenizer_config.json` / `special_tokens_map.json` objects, `chat_template.jinja` text).

    With a `tokenizer.json` the whole file is kept under `tokenizer.huggingface.json` (run by
    `tokenizers` exactly as transformers runs it). With only a `tokenizer.model`, its pieces
    become a "llama" (SentencePiece) vocabulary as llama.cpp's converter makes it. Special
    tokens (BOS, EOS, UNK, PAD, added tokens), `add_bos_token` / `add_eos_token` and the chat
    template come from `tokenizer_config.json`. Returns {} when there is no tokenizer."""
    config = dict(files.get("special_tokens_map.json") or {}) | dict(files.get("tokenizer_config.json") or {})
    template = files.get("chat_template.jinja") or config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if "tokenizer.json" in files:
        tk = _load_hf_json(files["tokenizer.json"], f"{where or 'the checkpoint'}: its tokenizer.json")
        meta: dict[str, Any] = {_KEY_HF_JSON: files["tokenizer.json"]}
        lookup = tk.token_to_id
    elif "tokenizer.model" in files:
        meta = _spm_metadata(files["tokenizer.model"], config, where)
        index = {t: i for i, t in enumerate(meta[_KEY_TOKENS])}
        lookup = index.get
    else:
        return {}
    for role in _SPECIAL_ROLES:
        token = config.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None and lookup(str(token)) is not None:
            meta[_ID_KEYS[role]] = lookup(str(token))
    if template:
        meta[_KEY_CHAT_TEMPLATE] = template
    return meta


def _load_hf_json(text: str, what: str):
    """A tokenizer.json's text as a `tokenizers.Tokenizer`; one SharkportError naming `what` if
    `tokenizers` cannot load it."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return HFTokenizer.from_str(text)
    except BaseException as e:  # noqa: BLE001 - the Rust side also panics (a BaseException) on bad input
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        message = " ".join(str(e).split())
        raise SharkportError(f"{what} is not a tokenizer.json that `tokenizers` can load "
                             f"({message[:200]}); re-import the model") from None


def _spm_metadata(model_b64: str, config: Mapping[str, Any], where: Any) -> dict[str, Any]:
    """A SentencePiece tokenizer.model (+ tokenizer_config.json) as "llama" GGUF vocabulary keys."""
    import base64

    from sentencepiece import sentencepiece_model_pb2 as pb

    try:
        proto = pb.ModelProto.FromString(base64.b64decode(model_b64))
    except Exception as e:
        raise SharkportError(f"{where}: tokenizer.model is not a SentencePiece model ({e}); re-download it") from None
    if proto.trainer_spec.model_type != pb.TrainerSpec.BPE:
        raise SharkportError(
            f"{where}: tokenizer.model is a SentencePiece "
            f"{pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)} model; only BPE (Llama's) is supported"
        )
    # SentencePiece piece types use llama.cpp's token type numbers (NORMAL=1 ... BYTE=6).
    tokens = [p.piece for p in proto.pieces]
    scores = [p.score for p in proto.pieces]
    types = [int(p.type) for p in proto.pieces]
    added = sorted((int(i), t) for i, t in (config.get("added_tokens_decoder") or {}).items())
    for i, token in added:  # tokens added on top of the model (chat markers, ...)
        kind = TOKEN_CONTROL if token.get("special") else TOKEN_USER_DEFINED
        if i < len(tokens):
            if tokens[i] == token["content"] and types[i] == TOKEN_NORMAL:
                types[i] = kind
        elif i == len(tokens):
            tokens.append(token["content"])
            scores.append(0.0)
            types.append(kind)
        else:
            raise SharkportError(
                f"{where}: tokenizer_config.json adds token {token['content']!r} as id {i}, past the "
                f"{len(tokens)} pieces of tokenizer.model; the files do not belong together"
            )
    spec = proto.trainer_spec
    return {
        _KEY_MODEL: "llama",
        _KEY_TOKENS: tokens,
        _KEY_SCORES: scores,
        _KEY_TYPES: types,
        _ID_KEYS["bos"]: spec.bos_id, _ID_KEYS["eos"]: spec.eos_id, _ID_KEYS["unk"]: spec.unk_id,
        _ID_KEYS["pad"]: spec.pad_id,
        "tokenizer.ggml.add_bos_token": bool(config.get("add_bos_token", True)),
        "tokenizer.ggml.add_eos_token": bool(config.get("add_eos_token", False)),
        "tokenizer.ggml.add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
        "tokenizer.ggml.remove_extra_whitespaces": proto.normalizer_spec.remove_extra_whitespaces,
    }


# What each kind of tokenizer value must be: (test, what the error calls it).
_KINDS: dict[type, tuple[Callable[[Any], bool], str]] = {
    str: (lambda v: isinstance(v, str), "a string"),
    int: (is_whole, "a whole number"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v), "a number"),
    bool: (lambda v: isinstance(v, bool) or v in (0, 1), "true or false"),
}


def _bad_value(key: str, value: Any, kind: type) -> SharkportError:
    return SharkportError(f"GGUF key {key} holds {short(value)}, not {_KINDS[kind][1]}; the file is corrupt, "
                          "re-convert it")


def _get_list(metadata: Mapping[str, Any], key: str, kind: type, required: bool = True) -> list[Any] | None:
    """The array `key`, every item of `kind` (str, int, float)."""
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
        raise _bad_value(f"{key}[{bad}]", value[bad], kind)
    return [float(v) for v in value] if kind is float else value


def _get_id(metadata: Mapping[str, Any], key: str, n_vocab: int, default: int | None) -> int | None:
    value = metadata.get(key, default)
    if value is None:
        return None
    if not _KINDS[int][0](value):
        raise _bad_value(key, value, int)
    if value < 0 or value >= n_vocab:  # llama.cpp treats an out-of-range id as absent
        return None
    return value


def _get_bool(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key)
    if value is not None and not _KINDS[bool][0](value):
        raise _bad_value(key, value, bool)
    return default if value is None else bool(value)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character (byte-level BPE alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}  # byte-level character -> byte


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """Encodes text to token ids and back, as llama.cpp does for the GGUF's vocabulary.

    Build one with `Tokenizer.from_gguf_metadata`. Attributes: `model` ("gpt2" or "llama"),
    `pre` (the pre-tokenizer name, None for "llama"), `vocab_size`, `bos_id`, `eos_id`,
    `pad_id`, `unk_id` (None where the metadata names none), `add_bos`, `add_eos`,
    `chat_template` (`tokenizer.chat_template` or None).
    """

    model: str
    pre: str | None
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def __init__(self) -> None:  # use from_gguf_metadata
        self.source: str | None = None  # the model file, named in chat-template errors
        self._specials: list[tuple[str, int]] = []
        self._piece_bytes: list[bytes] = []
        self._is_special: list[bool] = []
        self._strip_first_space = False
        self._clean_spaces = False
        self._bpe: Any = None  # tokenizers.Tokenizer for "gpt2"
        self._sp: Any = None  # sentencepiece.SentencePieceProcessor for "llama"
        self._sp_hidden_unk: int | None = None  # id of an <unk> piece added past the vocabulary
        self._hf: Any = None  # tokenizers.Tokenizer of a whole HF tokenizer.json

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Builds the tokenizer from GGUF metadata (all keys, or just `tokenizer_metadata(...)`).

        Raises SharkportError for an unknown `tokenizer.ggml.model` or `tokenizer.ggml.pre`, or
        when a required key (tokens; merges for "gpt2") is missing or inconsistent.
        """
        if not isinstance(metadata, Mapping):
            raise SharkportError(f"the tokenizer metadata is a JSON {json_type(metadata)}, not an object of "
                                 "GGUF keys; re-import the model")
        model = metadata.get(_KEY_MODEL)
        if model is None and metadata.get(_KEY_HF_JSON):
            return cls._from_hf_json(metadata)
        if model is None:
            raise SharkportError(
                f"GGUF metadata has no {_KEY_MODEL}: the file has no tokenizer; "
                "use a GGUF converted with its vocabulary"
            )
        model = str(model)
        tokens = _get_list(metadata, _KEY_TOKENS, str) or []
        if not tokens:
            raise SharkportError(f"GGUF key {_KEY_TOKENS} is empty: the file has no vocabulary")
        n = len(tokens)
        types = _get_list(metadata, _KEY_TYPES, int, required=False)
        types = [TOKEN_NORMAL] * n if types is None else types
        if len(types) != n:
            raise SharkportError(
                f"GGUF key {_KEY_TYPES} has {len(types)} entries but {_KEY_TOKENS} has {n}; "
                "the file is inconsistent, re-convert it"
            )

        self = cls()
        self.model = model
        self.vocab_size = n
        self.chat_template = metadata.get("tokenizer.chat_template")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise _bad_value("tokenizer.chat_template", self.chat_template, str)
        if model == "gpt2":
            self._init_bpe(metadata, tokens, types)
        elif model == "llama":
            self._init_spm(metadata, tokens, types)
        else:
            raise SharkportError(
                f"unsupported {_KEY_MODEL} {model!r} in GGUF metadata: sharkport's tokenizer "
                "supports 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
            )
        self.pad_id = _get_id(metadata, "tokenizer.ggml.padding_token_id", n, None)
        if self.add_bos and self.bos_id is None:
            raise SharkportError(
                "GGUF metadata asks for a BOS token (tokenizer.ggml.add_bos_token) but has no "
                "valid tokenizer.ggml.bos_token_id; set one or set add_bos_token to false"
            )
        if self.add_eos and self.eos_id is None:
            raise SharkportError(
                "GGUF metadata asks for an EOS token (tokenizer.ggml.add_eos_token) but has no "
                "valid tokenizer.ggml.eos_token_id; set one or set add_eos_token to false"
            )

        # Tokens recognised literally in text, longest first (llama.cpp's special-token cache).
        # SentencePiece matches user-defined pieces itself, exactly as the original model does
        # (llama.cpp would also put a dummy-prefix space after them); control and unknown
        # tokens it never produces, so those are split off here for both kinds.
        self._is_special = [t in (TOKEN_CONTROL, TOKEN_UNKNOWN) for t in types]
        literal = (TOKEN_CONTROL, TOKEN_UNKNOWN) + ((TOKEN_USER_DEFINED,) if model == "gpt2" else ())
        specials = [
            (text, i) for i, (text, t) in enumerate(zip(tokens, types)) if t in literal and text
        ]
        specials.sort(key=lambda s: -len(s[0]))
        self._specials = specials
        return self

    @classmethod
    def _from_hf_json(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """A whole HF tokenizer.json, run by `tokenizers` as transformers runs it: its own
        normalizer, pre-tokenizer, added tokens and post-processor (which adds BOS/EOS)."""
        tk = _load_hf_json(str(metadata[_KEY_HF_JSON]), _KEY_HF_JSON)
        self = cls()
        self._hf = tk
        self.model, self.pre = "huggingface", None
        n = self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = (
            _get_id(metadata, _ID_KEYS[role], n, None) for role in _SPECIAL_ROLES)
        with_specials, bare = tk.encode("a").ids, tk.encode("a", add_special_tokens=False).ids
        self.add_bos = self.bos_id is not None and with_specials[:1] == [self.bos_id] != bare[:1]
        self.add_eos = self.eos_id is not None and with_specials[-1:] == [self.eos_id] != bare[-1:]
        self.chat_template = metadata.get(_KEY_CHAT_TEMPLATE)
        self._is_special = [False] * n
        for i, added in tk.get_added_tokens_decoder().items():
            if added.special and i < n:
                self._is_special[i] = True
        return self

    def _init_bpe(self, metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> None:
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        n = len(tokens)
        pre = metadata.get(_KEY_PRE)
        pre = "default" if pre is None or str(pre) == "" else str(pre)
        spec = _PRE_TOKENIZERS.get(pre)
        if spec is None:
            raise SharkportError(
                f"unknown {_KEY_PRE} {pre!r} in GGUF metadata: sharkport knows "
                f"{', '.join(KNOWN_PRE_TOKENIZERS)}; add its regexes to sharkport/tokenizer.py"
            )
        self.pre = pre
        merges_raw = _get_list(metadata, _KEY_MERGES, str)
        merges: list[tuple[str, str]] = []
        for m in merges_raw or []:
            cut = m.find(" ", 1)
            if cut < 0:
                raise SharkportError(
                    f"GGUF key {_KEY_MERGES} has an entry {m!r} without a space; "
                    "the file is damaged, re-convert it"
                )
            merges.append((m[:cut], m[cut + 1 :]))
        vocab = {t: i for i, t in enumerate(tokens)}
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges)
        except Exception as e:  # tokenizers raises for merges naming tokens not in the vocab
            raise SharkportError(
                f"GGUF keys {_KEY_TOKENS}/{_KEY_MERGES} do not form a BPE vocabulary "
                f"({' '.join(str(e).split())}); re-convert the model"
            ) from None
        tk = HFTokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)]
        )
        self._bpe = tk
        self._clean_spaces = spec.clean_spaces
        self._strip_first_space = False
        self.add_bos = _get_bool(metadata, "tokenizer.ggml.add_bos_token", spec.add_bos)
        self.add_eos = _get_bool(metadata, "tokenizer.ggml.add_eos_token", False)
        self.bos_id = _get_id(metadata, "tokenizer.ggml.bos_token_id", n, None)
        self.eos_id = _get_id(metadata, "tokenizer.ggml.eos_token_id", n, None)
        self.unk_id = _get_id(metadata, "tokenizer.ggml.unknown_token_id", n, None)

        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        pieces = []
        for text, t in zip(tokens, types):
            if t == TOKEN_NORMAL and all(c in byte_of for c in text):
                pieces.append(bytes(byte_of[c] for c in text))
            elif t == TOKEN_UNUSED:
                pieces.append(b"")
            elif t == TOKEN_BYTE and _BYTE_PIECE.fullmatch(text):
                pieces.append(bytes([int(text[3:5], 16)]))
            else:  # control, user-defined and unknown tokens are stored as their raw text
                pieces.append(text.encode("utf-8"))
        self._piece_bytes = pieces

    def _init_spm(self, metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> None:
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        n = len(tokens)
        scores = _get_list(metadata, _KEY_SCORES, float, required=False)
        scores = [0.0] * n if scores is None else scores
        if len(scores) != n:
            raise SharkportError(
                f"GGUF key {_KEY_SCORES} has {len(scores)} entries but {_KEY_TOKENS} has {n}; "
                "the file is inconsistent, re-convert it"
            )
        self.pre = None
        add_space_prefix = _get_bool(metadata, "tokenizer.ggml.add_space_prefix", True)
        self.add_bos = _get_bool(metadata, "tokenizer.ggml.add_bos_token", True)
        self.add_eos = _get_bool(metadata, "tokenizer.ggml.add_eos_token", False)
        # llama.cpp's defaults for SentencePiece vocabularies: <unk>=0, <s>=1, </s>=2
        self.bos_id = _get_id(metadata, "tokenizer.ggml.bos_token_id", n, 1)
        self.eos_id = _get_id(metadata, "tokenizer.ggml.eos_token_id", n, 2)
        unk_id = _get_id(metadata, "tokenizer.ggml.unknown_token_id", n, None)
        if unk_id is None:
            unk_id = next((i for i, t in enumerate(types) if t == TOKEN_UNKNOWN), None)
        self.unk_id = unk_id

        proto = pb.ModelProto()
        proto.trainer_spec.model_type = pb.TrainerSpec.BPE
        byte_ids = {
            int(text[3:5], 16)
            for text, t in zip(tokens, types)
            if t == TOKEN_BYTE and _BYTE_PIECE.fullmatch(text)
        }
        proto.trainer_spec.byte_fallback = len(byte_ids) == 256
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = add_space_prefix
        proto.normalizer_spec.remove_extra_whitespaces = _get_bool(
            metadata, "tokenizer.ggml.remove_extra_whitespaces", False
        )
        proto.normalizer_spec.escape_whitespaces = True
        seen: set[str] = set()
        for i, (text, score, t) in enumerate(zip(tokens, scores, types)):
            piece = proto.pieces.add()
            if t == TOKEN_USER_DEFINED:
                # llama.cpp's converters write the spaces of user-defined pieces (Gemma's runs of
                # spaces) as spaces; SentencePiece matches them in escaped text, as "▁"
                text = text.replace(" ", "\u2581")
            if not text or text in seen:
                # SentencePiece needs unique non-empty pieces; keep the id, make it unreachable.
                piece.piece = f"<sharkport-duplicate-{i}>"
                piece.type = pb.ModelProto.SentencePiece.UNUSED
            else:
                piece.piece = text
                if t == TOKEN_UNKNOWN and i != unk_id:
                    t = TOKEN_CONTROL  # SentencePiece allows one unknown piece
                elif i == unk_id:
                    t = TOKEN_UNKNOWN
                elif t not in (TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE):
                    t = TOKEN_NORMAL
                elif t == TOKEN_BYTE and not proto.trainer_spec.byte_fallback:
                    t = TOKEN_CONTROL  # incomplete byte set: never produced by encode
                piece.type = t
            piece.score = score
            seen.add(text)
        if unk_id is None:  # SentencePiece cannot load without one; add it past the vocabulary
            piece = proto.pieces.add()
            piece.piece = "<sharkport-unk>"
            piece.type = pb.ModelProto.SentencePiece.UNKNOWN
            self._sp_hidden_unk = n
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        except Exception as e:
            raise SharkportError(
                f"GGUF SentencePiece vocabulary ({_KEY_TOKENS}/{_KEY_SCORES}/{_KEY_TYPES}) "
                f"cannot be loaded: {' '.join(str(e).split())}"
            ) from None
        self._clean_spaces = False
        self._strip_first_space = add_space_prefix
        self._spm_vocab = dict(tokens=tokens, scores=scores, types=types, unk_id=unk_id,
                               add_space_prefix=add_space_prefix,
                               remove_extra_whitespaces=proto.normalizer_spec.remove_extra_whitespaces,
                               byte_fallback=proto.trainer_spec.byte_fallback)

        pieces = []
        for text, t in zip(tokens, types):
            if t == TOKEN_BYTE and _BYTE_PIECE.fullmatch(text):
                pieces.append(bytes([int(text[3:5], 16)]))
            elif t in (TOKEN_CONTROL, TOKEN_UNKNOWN):
                pieces.append(text.encode("utf-8"))
            elif t == TOKEN_UNUSED:
                pieces.append(b"")
            else:
                pieces.append(text.replace("\u2581", " ").encode("utf-8"))
        self._piece_bytes = pieces

    # -- encoding -----------------------------------------------------------------------------

    def _partition(self, text: str) -> list[str | int]:
        """Splits `text` at literal special tokens, longest token first (llama.cpp's order)."""
        fragments: list[str | int] = [text]
        for special, tid in self._specials:
            if special not in text:
                continue
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or special not in frag:
                    out.append(frag)
                    continue
                for k, part in enumerate(frag.split(special)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            fragments = out
        return [f for f in fragments if f != ""]

    def _encode_text(self, fragments: list[str]) -> list[list[int]]:
        if self._bpe is not None:
            return [e.ids for e in self._bpe.encode_batch(fragments, add_special_tokens=False)]
        out = self._sp.encode(fragments)
        if self._sp_hidden_unk is not None:
            out = [[0 if i == self._sp_hidden_unk else i for i in ids] for ids in out]
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text become their single id.

        With `add_special_tokens`, BOS is prepended if `add_bos` (tokenizer.ggml.add_bos_token,
        default True for "llama", False for "gpt2" except pre-tokenizers like llama3) and EOS
        appended if `add_eos`.
        """
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        fragments = self._partition(text)
        raw = [f for f in fragments if isinstance(f, str)]
        encoded = iter(self._encode_text(raw)) if raw else iter(())
        ids: list[int] = []
        if add_special_tokens and self.add_bos:
            ids.append(self.bos_id)  # type: ignore[arg-type]
        for frag in fragments:
            if isinstance(frag, int):
                ids.append(frag)
            else:
                ids.extend(next(encoded))
        if add_special_tokens and self.add_eos:
            ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    # -- decoding -----------------------------------------------------------------------------

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """The bytes token `token_id` stands for (a piece of a UTF-8 character for byte tokens).

        Control and unknown tokens give their text, or b"" with `skip_special_tokens`.
        """
        if not 0 <= token_id < self.vocab_size:
            raise SharkportError(
                f"token id {token_id} is outside the vocabulary of {self.vocab_size} tokens; "
                "the ids come from a different model than this tokenizer"
            )
        if skip_special_tokens and self._is_special[token_id]:
            return b""
        if self._hf is not None:  # the token's text alone (a byte-fallback piece gives U+FFFD)
            return self._hf.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return self._piece_bytes[token_id]

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        """A decoder fed one token id at a time that returns only finished text, never half of
        a multi-byte character; its outputs joined (plus `flush()`) equal `decode(ids)`."""
        if self._hf is not None:
            return _HfStreamDecoder(self, skip_special_tokens)
        return StreamDecoder(self, skip_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. With `skip_special_tokens`, control/unknown tokens (BOS, EOS, ...) are
        left out; otherwise they appear as their text. Invalid UTF-8 becomes U+FFFD."""
        if self._hf is not None:
            return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        dec = self.stream_decoder(skip_special_tokens)
        parts = [dec.add(int(i)) for i in ids]
        parts.append(dec.flush())
        return "".join(parts)

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}, ...]) with the GGUF's
        tokenizer.chat_template (Jinja2, sandboxed, as Hugging Face renders it), passing
        `bos_token`, `eos_token` and `add_generation_prompt`; extra keyword arguments are
        passed to the template too. The result is text: encode it to get ids."""
        if not self.chat_template:
            raise SharkportError(
                "GGUF metadata has no tokenizer.chat_template: format the prompt yourself "
                "or use a GGUF converted with its chat template"
            )
        from .chat_template import compile_template, render

        values = {
            "bos_token": self._token_text(self.bos_id),
            "eos_token": self._token_text(self.eos_id),
            "pad_token": self._token_text(self.pad_id),
            "unk_token": self._token_text(self.unk_id),
        }
        values.update(kwargs)
        try:
            return render(compile_template(self.chat_template), messages=messages,
                          add_generation_prompt=add_generation_prompt, **values)
        except SharkportError as e:
            raise SharkportError(f"{self.source}: {e}" if self.source else str(e)) from None

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        if self._hf is not None:
            return self._hf.decode([token_id], skip_special_tokens=False)
        return self._piece_bytes[token_id].decode("utf-8", errors="replace")

    # -- Hugging Face tokenizer files -----------------------------------------------------------

    def to_hf_files(self) -> dict[str, Any]:
        """This tokenizer as Hugging Face files: {"tokenizer.json": text, "tokenizer_config.json":
        object}, which `tokenizers.Tokenizer.from_file`, transformers' AutoTokenizer and
        shortfin's LLM server load, and which encode (special tokens in the text too, BOS/EOS by
        the post-processor) and decode (`skip_special_tokens` drops control tokens) as this
        tokenizer does. A "huggingface" vocabulary gives its stored tokenizer.json back.

        Raises SharkportError for a "gpt2" vocabulary whose tokens the byte-level decoder cannot
        reproduce (byte `<0xNN>` or unused tokens), and for the SentencePiece settings
        `sharkport.spm_json` cannot express."""
        if self._hf is not None:
            tk = self._hf
        elif self._bpe is not None:
            tk = self._bpe_hf_tokenizer()
        else:
            from .spm_json import spm_tokenizer

            tk = spm_tokenizer(**self._spm_vocab, bos_id=self.bos_id, eos_id=self.eos_id,
                               add_bos=self.add_bos, add_eos=self.add_eos)

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tk.id_to_token(token_id)

        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": text(self.bos_id), "eos_token": text(self.eos_id),
            "unk_token": text(self.unk_id), "pad_token": text(self.pad_id),
            "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
            # llama.cpp's space clean-up, where the vocabulary has it, is in the decoder already
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        return {"tokenizer.json": tk.to_str(), "tokenizer_config.json": config}

    def _bpe_hf_tokenizer(self):
        """The byte-level BPE as one `tokenizers.Tokenizer`: sharkport's BPE model and
        pre-tokenizer, the literal tokens as added tokens (control/unknown ones special), a
        ByteLevel decoder (+ llama.cpp's space clean-up) and BOS/EOS in a post-processor."""
        from tokenizers import AddedToken, decoders, processors
        from tokenizers import Tokenizer as HFTokenizer

        tk = HFTokenizer.from_str(self._bpe.to_str())  # a copy: sharkport's own stays as it is
        mismatched = [i for i in range(self.vocab_size) if _byte_level_bytes(tk.id_to_token(i)) != self._piece_bytes[i]]
        if mismatched:
            i = mismatched[0]
            raise SharkportError(
                f"{len(mismatched)} tokens of this byte-level vocabulary (e.g. id {i}, "
                f"{tk.id_to_token(i)!r}) are byte or unused tokens that tokenizer.json's ByteLevel "
                "decoder would decode differently; writing tokenizer.json is not supported for it"
            )
        for content, token_id in sorted(self._specials, key=lambda s: s[1]):
            added = AddedToken(content, special=self._is_special[token_id], normalized=False)
            (tk.add_special_tokens if self._is_special[token_id] else tk.add_tokens)([added])
        steps = [decoders.ByteLevel()]
        if self._clean_spaces:  # _clean_spaces's rules as plain replacements, in its order
            steps += [decoders.Replace(a, b) for a, b in _CLEAN_REPLACEMENTS]
        tk.decoder = decoders.Sequence(steps) if len(steps) > 1 else steps[0]
        if self.add_bos or self.add_eos:
            ends = [(self.bos_id, self.add_bos), (self.eos_id, self.add_eos)]
            bos, eos = (tk.id_to_token(i) for i, _ in ends)

            def template(seq: str, type_id: int) -> str:
                return " ".join(([f"{bos}:{type_id}"] if self.add_bos else []) + [f"${seq}:{type_id}"]
                                + ([f"{eos}:{type_id}"] if self.add_eos else []))

            tk.post_processor = processors.TemplateProcessing(
                single=template("A", 0), pair=f"{template('A', 0)} {template('B', 1)}",
                special_tokens=list(dict.fromkeys((tk.id_to_token(i), i) for i, on in ends if on)))
        return tk


def _byte_level_bytes(token: str | None) -> bytes:
    """What `tokenizers`' ByteLevel decoder makes of one token: its characters mapped back to
    bytes, or its raw UTF-8 when a character is outside the byte alphabet."""
    if token is None:
        return b""
    if all(c in _BYTE_OF for c in token):
        return bytes(_BYTE_OF[c] for c in token)
    return token.encode("utf-8")


def write_hf_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike) -> list[Path]:
    """Writes `tokenizer.json` and `tokenizer_config.json` (see `Tokenizer.to_hf_files`) into
    `directory` (created if needed), each atomically; returns their paths."""
    import json

    from .fileio import atomic_output

    files = tokenizer.to_hf_files()
    paths = []
    for name, content in files.items():
        path = Path(directory) / name
        text = content if isinstance(content, str) else json.dumps(content, indent=2, ensure_ascii=False) + "\n"
        with atomic_output(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


class StreamDecoder:
    """Incremental detokenizer: `add(id)` returns the text completed by that token (possibly
    ""), holding back an unfinished UTF-8 sequence and, for vocabularies whose detokenizer
    tidies spaces before punctuation, a trailing space until it is decided. `flush()` returns
    what is left. Get one from `Tokenizer.stream_decoder`."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = tokenizer._strip_first_space
        self._pending = ""

    def add(self, token_id: int) -> str:
        """Feeds one token id; returns the newly finished text."""
        piece = self._tok.token_bytes(token_id, self._skip)
        if self._first and piece:
            self._first = False
            if piece.startswith(b" ") and not self._tok._is_special[token_id]:
                piece = piece[1:]
        return self._emit(self._utf8.decode(piece), final=False)

    def flush(self) -> str:
        """Returns the text still held back (an unfinished character becomes U+FFFD)."""
        return self._emit(self._utf8.decode(b"", final=True), final=True)

    def _emit(self, text: str, final: bool) -> str:
        if not self._tok._clean_spaces:
            return text
        self._pending += text
        cut = len(self._pending) if final else _clean_cut(self._pending)
        done, self._pending = self._pending[:cut], self._pending[cut:]
        return _clean_spaces(done)


class _HfStreamDecoder(StreamDecoder):
    """StreamDecoder over `tokenizers`' own DecodeStream, for tokenizer.json vocabularies."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        self._tok.token_bytes(token_id)  # range check with sharkport's error
        return self._stream.step(self._tok._hf, int(token_id)) or ""

    def flush(self) -> str:
        return ""  # DecodeStream holds back only an unfinished character, which decode drops too


# llama.cpp's detokenizer clean-up for BPE vocabularies with clean_spaces: drop the space in
# " ?", " !", " .", " ,"; turn " ' " into "'"; drop the space in " 's", " 'm", " 're", " 've".
_CLEAN_PUNCT = re.compile(r" (?=[?!.,])")
_CLEAN_QUOTE = re.compile(r" ' ")
_CLEAN_CONTRACTION = re.compile(r" (?='(?:s|m|re|ve))")


def _clean_spaces(text: str) -> str:
    text = _CLEAN_PUNCT.sub("", text)
    text = _CLEAN_QUOTE.sub("'", text)
    return _CLEAN_CONTRACTION.sub("", text)


# The same clean-up as plain replacements (a tokenizer.json decoder has no look-ahead): each rule
# removes the space in front of the text it matched, so sequential replacing gives the same text.
_CLEAN_REPLACEMENTS = tuple((f" {p}", p) for p in ("?", "!", ".", ",")) + ((" ' ", "'"),) + tuple(
    (f" '{c}", f"'{c}") for c in ("s", "m", "re", "ve"))


def _clean_cut(text: str) -> int:
    """Length of the prefix of `text` whose clean-up cannot change with more text: every rule
    starts at a space and looks at most 3 characters on, so stop before a space that is too
    close to the end or whose rule would reach past the cut."""
    cut = len(text)
    while True:
        start = max(0, cut - 3)
        p = text.find(" ", start, cut)
        if p < 0:
            return cut
        cut = p


