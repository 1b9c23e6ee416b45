"""A tokenizer built from the tokenizer metadata a GGUF file carries (llama.cpp's `tokenizer.*` keys),
or from a Hugging Face checkpoint's tokenizer files (see `tokenizer_metadata_from_hf`).

Three vocabulary kinds are supported, each by its own module:

* `bpe`, `tokenizer.ggml.model` ``"gpt2"``: byte-level BPE (tokens, merges). Text is split by
  the pre-tokenizer regexes that llama.cpp uses for the model's `tokenizer.ggml.pre`, then
  encoded with a `tokenizers` BPE model.
* `spm`, `tokenizer.ggml.model` ``"llama"``: SentencePiece BPE (tokens, scores, token types). A
  `ModelProto` is assembled from the metadata and loaded into a
  `sentencepiece.SentencePieceProcessor`.
* `hf`, no `tokenizer.ggml.model` but the GGUF key `tokenizer.huggingface.json` (a whole HF
  `tokenizer.json`): it is loaded as it is into `tokenizers`, so it encodes exactly as
  `transformers` does with the same file.

`Tokenizer` picks the back-end. For the two GGUF kinds it does what llama.cpp does around the
vocabulary: control, user-defined and unknown tokens written literally in the text (e.g.
``"<|im_start|>"``) are recognised as single tokens before the rest is encoded, and decoding
works on bytes so a multi-byte character split over tokens comes out whole; see
`Tokenizer.stream_decoder` for decoding one token at a time while generating. A tokenizer.json
does all of that itself.

The input everywhere is `metadata`: a dict from GGUF key to plain Python value (see
`sharkport.tokenizer.metadata`).
"""

from __future__ import annotations

import codecs
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import SharkportError, json_type
from .bpe import KNOWN_PRE_TOKENIZERS, BpeVocabulary, clean_up, clean_up_cut
from .bpe import bytes_to_unicode as _bytes_to_unicode  # noqa: F401 - tests build byte-level vocabularies with it
from .hf import HfVocabulary, tokenizer_metadata_from_hf
from .metadata import (KEY_CHAT_TEMPLATE, KEY_HF_JSON, KEY_MODEL, KEY_TOKENS, KEY_TYPES, TOKEN_NORMAL, bad_value,
                       get_id, get_list, tokenizer_metadata)
from .spm import SpmVocabulary

__all__ = ["Tokenizer", "StreamDecoder", "tokenizer_metadata", "tokenizer_metadata_from_hf",
           "write_hf_tokenizer", "KNOWN_PRE_TOKENIZERS"]


class Tokenizer:
    """Encodes text to token ids and back, as llama.cpp does for the GGUF's vocabulary.

    Build one with `Tokenizer.from_gguf_metadata`. Attributes: `model` ("gpt2", "llama" or
    "huggingface"), `pre` (the pre-tokenizer name, None but for "gpt2"), `vocab_size`, `bos_id`,
    `eos_id`, `pad_id`, `unk_id` (None where the metadata names none), `add_bos`, `add_eos`,
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
        self._vocab: BpeVocabulary | SpmVocabulary | None = None  # a GGUF vocabulary ("gpt2", "llama")
        self._hf: HfVocabulary | None = None  # or a whole tokenizer.json
        self._is_special: list[bool] = []  # left out by skip_special_tokens

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
        model = metadata.get(KEY_MODEL)
        if model is None and metadata.get(KEY_HF_JSON):
            return cls._from_hf_json(metadata)
        if model is None:
            raise SharkportError(
                f"GGUF metadata has no {KEY_MODEL}: the file has no tokenizer; "
                "use a GGUF converted with its vocabulary"
            )
        model = str(model)
        tokens = get_list(metadata, KEY_TOKENS, str) or []
        if not tokens:
            raise SharkportError(f"GGUF key {KEY_TOKENS} is empty: the file has no vocabulary")
        n = len(tokens)
        types = get_list(metadata, KEY_TYPES, int, required=False)
        types = [TOKEN_NORMAL] * n if types is None else types
        if len(types) != n:
            raise SharkportError(
                f"GGUF key {KEY_TYPES} has {len(types)} entries but {KEY_TOKENS} has {n}; "
                "the file is inconsistent, re-convert it"
            )

        self = cls()
        self.model = model
        self.vocab_size = n
        self.chat_template = metadata.get(KEY_CHAT_TEMPLATE)
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise bad_value(KEY_CHAT_TEMPLATE, self.chat_template, str)
        if model == "gpt2":
            vocab: BpeVocabulary | SpmVocabulary = BpeVocabulary(metadata, tokens, types)
        elif model == "llama":
            vocab = SpmVocabulary(metadata, tokens, types)
        else:
            raise SharkportError(
                f"unsupported {KEY_MODEL} {model!r} in GGUF metadata: sharkport's tokenizer "
                "supports 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
            )
        self._vocab, self._is_special = vocab, vocab.is_special
        self.pre, self.add_bos, self.add_eos = vocab.pre, vocab.add_bos, vocab.add_eos
        self.bos_id, self.eos_id, self.unk_id = vocab.bos_id, vocab.eos_id, vocab.unk_id
        self.pad_id = get_id(metadata, "tokenizer.ggml.padding_token_id", n, None)
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
        return self

    @classmethod
    def _from_hf_json(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """The tokenizer of a whole HF tokenizer.json (`tokenizer.huggingface.json`)."""
        hf = HfVocabulary(metadata)
        self = cls()
        self._hf, self._is_special = hf, hf.is_special
        self.model, self.pre, self.vocab_size = "huggingface", None, hf.vocab_size
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = hf.bos_id, hf.eos_id, hf.unk_id, hf.pad_id
        self.add_bos, self.add_eos = hf.add_bos, hf.add_eos
        self.chat_template = metadata.get(KEY_CHAT_TEMPLATE)
        return self

    # -- encoding -----------------------------------------------------------------------------

    def _partition(self, text: str) -> list[str | int]:
        """Splits `text` at literal special tokens, longest token first (llama.cpp's order)."""
        fragments: list[str | int] = [text]
        for special, tid in self._vocab.specials:
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text become their single id.

        With `add_special_tokens`, BOS is prepended if `add_bos` (tokenizer.ggml.add_bos_token,
        default True for "llama", False for "gpt2" except pre-tokenizers like llama3) and EOS
        appended if `add_eos`.
        """
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens)
        fragments = self._partition(text)
        raw = [f for f in fragments if isinstance(f, str)]
        encoded = iter(self._vocab.encode(raw)) if raw else iter(())
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
        if self._hf is not None:
            return self._hf.token_text(token_id).encode("utf-8")
        return self._vocab.piece_bytes[token_id]

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
            return self._hf.decode(ids, skip_special_tokens)
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
        from ..chat_template import compile_template, render

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
            return self._hf.token_text(token_id)
        return self._vocab.piece_bytes[token_id].decode("utf-8", errors="replace")

    # -- Hugging Face tokenizer files -----------------------------------------------------------

    def to_hf_files(self) -> dict[str, Any]:
        """This tokenizer as Hugging Face files: {"tokenizer.json": text, "tokenizer_config.json":
        object}, which `tokenizers.Tokenizer.from_file`, transformers' AutoTokenizer and
        shortfin's LLM server load, and which encode (special tokens in the text too, BOS/EOS by
        the post-processor) and decode (`skip_special_tokens` drops control tokens) as this
        tokenizer does. A "huggingface" vocabulary gives its stored tokenizer.json back.

        Raises SharkportError for a "gpt2" vocabulary whose tokens the byte-level decoder cannot
        reproduce (byte `<0xNN>` or unused tokens), and for the SentencePiece settings
        `sharkport.tokenizer.spm.tokenizer_json` cannot express."""
        if self._hf is not None:
            tk = self._hf.tokenizer
        else:
            tk = self._vocab.hf_tokenizer(bos_id=self.bos_id, eos_id=self.eos_id, add_bos=self.add_bos,
                                          add_eos=self.add_eos)

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


def write_hf_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike) -> list[Path]:
    """Writes `tokenizer.json` and `tokenizer_config.json` (see `Tokenizer.to_hf_files`) into
    `directory` (created if needed), each atomically; returns their paths."""
    import json

    from ..fileio import atomic_output

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
        self._first = tokenizer._vocab.strip_first_space
        self._clean_spaces = tokenizer._vocab.clean_spaces
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
        if not self._clean_spaces:
            return text
        self._pending += text
        cut = len(self._pending) if final else clean_up_cut(self._pending)
        done, self._pending = self._pending[:cut], self._pending[cut:]
        return clean_up(done)


class _HfStreamDecoder(StreamDecoder):
    """StreamDecoder over `tokenizers`' own DecodeStream, for tokenizer.json vocabularies."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        self._tok.token_bytes(token_id)  # range check with sharkport's error
        return self._stream.step(self._tok._hf.tokenizer, int(token_id)) or ""

    def flush(self) -> str:
        return ""  # DecodeStream holds back only an unfinished character, which decode drops too
