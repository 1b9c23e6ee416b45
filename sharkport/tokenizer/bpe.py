"""Byte-level BPE, the "gpt2" vocabularies (GGUF tokens and merges), encoded as llama.cpp does.

Text is split by the pre-tokenizer regexes that llama.cpp uses for the vocabulary's
`tokenizer.ggml.pre`, each piece's UTF-8 bytes are spelled in GPT-2's byte alphabet, and a
`tokenizers` BPE model merges them. Decoding maps the alphabet back to bytes and, for the
pre-tokenizers that have it, applies llama.cpp's detokenizer space clean-up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import SharkportError
from .metadata import (BYTE_PIECE, KEY_MERGES, KEY_PRE, KEY_TOKENS, SPECIAL_TYPES, TOKEN_BYTE, TOKEN_NORMAL,
                       TOKEN_UNUSED, TOKEN_USER_DEFINED, get_bool, get_id, get_list, literal_tokens)


# ---------------------------------------------------------------------------------------------
# Pre-tokenizers
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
# The byte alphabet and llama.cpp's space clean-up
# ---------------------------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
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


_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}  # byte-level character -> byte


def _byte_level_bytes(token: str | None) -> bytes:
    """What `tokenizers`' ByteLevel decoder makes of one token: its characters mapped back to
    bytes, or its raw UTF-8 when a character is outside the byte alphabet."""
    if token is None:
        return b""
    if all(c in _BYTE_OF for c in token):
        return bytes(_BYTE_OF[c] for c in token)
    return token.encode("utf-8")


# llama.cpp's detokenizer clean-up for BPE vocabularies with clean_spaces: drop the space in
# " ?", " !", " .", " ,"; turn " ' " into "'"; drop the space in " 's", " 'm", " 're", " 've".
_CLEAN_PUNCT = re.compile(r" (?=[?!.,])")
_CLEAN_QUOTE = re.compile(r" ' ")
_CLEAN_CONTRACTION = re.compile(r" (?='(?:s|m|re|ve))")


def clean_up(text: str) -> str:
    """`text` after llama.cpp's space clean-up."""
    text = _CLEAN_PUNCT.sub("", text)
    text = _CLEAN_QUOTE.sub("'", text)
    return _CLEAN_CONTRACTION.sub("", text)


# The same clean-up as plain replacements (a tokenizer.json decoder has no look-ahead): each rule
# removes the space in front of the text it matched, so sequential replacing gives the same text.
_CLEAN_REPLACEMENTS = tuple((f" {p}", p) for p in ("?", "!", ".", ",")) + ((" ' ", "'"),) + tuple(
    (f" '{c}", f"'{c}") for c in ("s", "m", "re", "ve"))


def clean_up_cut(text: str) -> int:
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


# ---------------------------------------------------------------------------------------------
# The vocabulary
# ---------------------------------------------------------------------------------------------


class BpeVocabulary:
    """A "gpt2" vocabulary read from GGUF metadata: the `tokenizers` BPE that encodes runs of
    text, the bytes of each token, and the settings the metadata gives (`pre`, `bos_id`,
    `eos_id`, `unk_id`, `add_bos`, `add_eos`).

    Raises SharkportError for an unknown `tokenizer.ggml.pre` and for missing or broken merges.
    """

    def __init__(self, metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> None:
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        n = len(tokens)
        pre = metadata.get(KEY_PRE)
        pre = "default" if pre is None or str(pre) == "" else str(pre)
        spec = _PRE_TOKENIZERS.get(pre)
        if spec is None:
            raise SharkportError(
                f"unknown {KEY_PRE} {pre!r} in GGUF metadata: sharkport knows "
                f"{', '.join(KNOWN_PRE_TOKENIZERS)}; add its regexes to sharkport/tokenizer/bpe.py"
            )
        self.pre = pre
        merges_raw = get_list(metadata, KEY_MERGES, str)
        merges: list[tuple[str, str]] = []
        for m in merges_raw or []:
            cut = m.find(" ", 1)
            if cut < 0:
                raise SharkportError(
                    f"GGUF key {KEY_MERGES} has an entry {m!r} without a space; "
                    "the file is damaged, re-convert it"
                )
            merges.append((m[:cut], m[cut + 1 :]))
        vocab = {t: i for i, t in enumerate(tokens)}
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges)
        except Exception as e:  # tokenizers raises for merges naming tokens not in the vocab
            raise SharkportError(
                f"GGUF keys {KEY_TOKENS}/{KEY_MERGES} do not form a BPE vocabulary "
                f"({' '.join(str(e).split())}); re-convert the model"
            ) from None
        tk = HFTokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)]
        )
        self._bpe = tk
        self.clean_spaces = spec.clean_spaces
        self.strip_first_space = False
        self.add_bos = get_bool(metadata, "tokenizer.ggml.add_bos_token", spec.add_bos)
        self.add_eos = get_bool(metadata, "tokenizer.ggml.add_eos_token", False)
        self.bos_id = get_id(metadata, "tokenizer.ggml.bos_token_id", n, None)
        self.eos_id = get_id(metadata, "tokenizer.ggml.eos_token_id", n, None)
        self.unk_id = get_id(metadata, "tokenizer.ggml.unknown_token_id", n, None)

        pieces = []
        for text, t in zip(tokens, types):
            if t == TOKEN_NORMAL and all(c in _BYTE_OF for c in text):
                pieces.append(bytes(_BYTE_OF[c] for c in text))
            elif t == TOKEN_UNUSED:
                pieces.append(b"")
            elif t == TOKEN_BYTE and BYTE_PIECE.fullmatch(text):
                pieces.append(bytes([int(text[3:5], 16)]))
            else:  # control, user-defined and unknown tokens are stored as their raw text
                pieces.append(text.encode("utf-8"))
        self.piece_bytes = pieces
        self.is_special = [t in SPECIAL_TYPES for t in types]
        # As llama.cpp does, every control, user-defined and unknown token written in the text
        # is split off before BPE sees the text.
        self.specials = literal_tokens(tokens, types, SPECIAL_TYPES + (TOKEN_USER_DEFINED,))

    def encode(self, fragments: list[str]) -> list[list[int]]:
        """The token ids of each of `fragments` (text free of literal special tokens)."""
        return [e.ids for e in self._bpe.encode_batch(fragments, add_special_tokens=False)]

    def hf_tokenizer(self, bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool) -> Any:
        """The vocabulary as one `tokenizers.Tokenizer`: this BPE model and pre-tokenizer, the
        literal tokens as added tokens (control/unknown ones special), a ByteLevel decoder (+
        llama.cpp's space clean-up) and BOS/EOS in a post-processor.

        Raises SharkportError when a token's bytes are not what the ByteLevel decoder makes of it
        (byte `<0xNN>` or unused tokens)."""
        from tokenizers import AddedToken, decoders, processors
        from tokenizers import Tokenizer as HFTokenizer

        tk = HFTokenizer.from_str(self._bpe.to_str())  # a copy: the encoder stays as it is
        mismatched = [i for i in range(len(self.piece_bytes))
                      if _byte_level_bytes(tk.id_to_token(i)) != self.piece_bytes[i]]
        if mismatched:
            i = mismatched[0]
            raise SharkportError(
                f"{len(mismatched)} tokens of this byte-level vocabulary (e.g. id {i}, "
                f"{tk.id_to_token(i)!r}) are byte or unused tokens that tokenizer.json's ByteLevel "
                "decoder would decode differently; writing tokenizer.json is not supported for it"
            )
        for content, token_id in sorted(self.specials, key=lambda s: s[1]):
            added = AddedToken(content, special=self.is_special[token_id], normalized=False)
            (tk.add_special_tokens if self.is_special[token_id] else tk.add_tokens)([added])
        steps = [decoders.ByteLevel()]
        if self.clean_spaces:  # clean_up's rules as plain replacements, in its order
            steps += [decoders.Replace(a, b) for a, b in _CLEAN_REPLACEMENTS]
        tk.decoder = decoders.Sequence(steps) if len(steps) > 1 else steps[0]
        if add_bos or add_eos:
            ends = [(bos_id, add_bos), (eos_id, add_eos)]
            bos, eos = (tk.id_to_token(i) for i, _ in ends)

            def template(seq: str, type_id: int) -> str:
                return " ".join(([f"{bos}:{type_id}"] if add_bos else []) + [f"${seq}:{type_id}"]
                                + ([f"{eos}:{type_id}"] if add_eos else []))

            tk.post_processor = processors.TemplateProcessing(
                single=template("A", 0), pair=f"{template('A', 0)} {template('B', 1)}",
                special_tokens=list(dict.fromkeys((tk.id_to_token(i), i) for i, on in ends if on)))
        return tk
