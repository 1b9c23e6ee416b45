"""SentencePiece BPE, the "llama" vocabularies (GGUF tokens, scores and token types).

A SentencePiece `ModelProto` is assembled from the metadata and loaded into a
`sentencepiece.SentencePieceProcessor`, which encodes runs of text. `spm_metadata` goes the
other way, from a Hugging Face checkpoint's tokenizer.model to the GGUF keys, as llama.cpp's
converter does.

For tokenizer.json, `tokenizer_json` rebuilds the vocabulary in `tokenizers` terms.
SentencePiece's BPE merges, at each step, the adjacent pair whose concatenation is the
vocabulary piece of highest score. A `tokenizers` BPE model does the same when its merges are
every split of every normal piece into two pieces, ranked by the joined piece's score. The rest
is SentencePiece's pipeline: spaces become "▁" (after a "▁" prefix where `add_space_prefix`),
characters outside the vocabulary fall back to `<0xNN>` byte pieces, control and unknown tokens
are special added tokens, user-defined ones plain added tokens, and the decoder undoes it all.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import SharkportError
from .metadata import (BYTE_PIECE, ID_KEYS, KEY_MODEL, KEY_SCORES, KEY_TOKENS, KEY_TYPES, SPECIAL_TYPES,
                       TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_UNUSED, TOKEN_USER_DEFINED,
                       get_bool, get_id, get_list, literal_tokens)

SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space inside pieces


def spm_metadata(model_b64: str, config: Mapping[str, Any], where: Any) -> dict[str, Any]:
    """A SentencePiece tokenizer.model (base64) and tokenizer_config.json (`config`) as "llama"
    GGUF vocabulary keys; `where` names the checkpoint in errors."""
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
        KEY_MODEL: "llama",
        KEY_TOKENS: tokens,
        KEY_SCORES: scores,
        KEY_TYPES: types,
        ID_KEYS["bos"]: spec.bos_id, ID_KEYS["eos"]: spec.eos_id, ID_KEYS["unk"]: spec.unk_id,
        ID_KEYS["pad"]: spec.pad_id,
        "tokenizer.ggml.add_bos_token": bool(config.get("add_bos_token", True)),
        "tokenizer.ggml.add_eos_token": bool(config.get("add_eos_token", False)),
        "tokenizer.ggml.add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
        "tokenizer.ggml.remove_extra_whitespaces": proto.normalizer_spec.remove_extra_whitespaces,
    }


class SpmVocabulary:
    """A "llama" vocabulary read from GGUF metadata: the SentencePiece processor that encodes
    runs of text, the bytes of each token, and the settings the metadata gives (`pre` is None;
    `bos_id`, `eos_id`, `unk_id`, `add_bos`, `add_eos`).

    Raises SharkportError when the scores do not match the tokens or SentencePiece cannot load
    the vocabulary.
    """

    def __init__(self, metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> None:
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        n = len(tokens)
        scores = get_list(metadata, KEY_SCORES, float, required=False)
        scores = [0.0] * n if scores is None else scores
        if len(scores) != n:
            raise SharkportError(
                f"GGUF key {KEY_SCORES} has {len(scores)} entries but {KEY_TOKENS} has {n}; "
                "the file is inconsistent, re-convert it"
            )
        self.pre = None
        add_space_prefix = get_bool(metadata, "tokenizer.ggml.add_space_prefix", True)
        self.add_bos = get_bool(metadata, "tokenizer.ggml.add_bos_token", True)
        self.add_eos = get_bool(metadata, "tokenizer.ggml.add_eos_token", False)
        # llama.cpp's defaults for SentencePiece vocabularies: <unk>=0, <s>=1, </s>=2
        self.bos_id = get_id(metadata, "tokenizer.ggml.bos_token_id", n, 1)
        self.eos_id = get_id(metadata, "tokenizer.ggml.eos_token_id", n, 2)
        unk_id = get_id(metadata, "tokenizer.ggml.unknown_token_id", n, None)
        if unk_id is None:
            unk_id = next((i for i, t in enumerate(types) if t == TOKEN_UNKNOWN), None)
        self.unk_id = unk_id

        proto = pb.ModelProto()
        proto.trainer_spec.model_type = pb.TrainerSpec.BPE
        byte_ids = {
            int(text[3:5], 16)
            for text, t in zip(tokens, types)
            if t == TOKEN_BYTE and BYTE_PIECE.fullmatch(text)
        }
        proto.trainer_spec.byte_fallback = len(byte_ids) == 256
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = add_space_prefix
        proto.normalizer_spec.remove_extra_whitespaces = get_bool(
            metadata, "tokenizer.ggml.remove_extra_whitespaces", False
        )
        proto.normalizer_spec.escape_whitespaces = True
        seen: set[str] = set()
        for i, (text, score, t) in enumerate(zip(tokens, scores, types)):
            piece = proto.pieces.add()
            if t == TOKEN_USER_DEFINED:
                # llama.cpp's converters write the spaces of user-defined pieces (Gemma's runs of
                # spaces) as spaces; SentencePiece matches them in escaped text, as "▁"
                text = text.replace(" ", SPACE)
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
        self._hidden_unk: int | None = None  # id of an <unk> piece added past the vocabulary
        if unk_id is None:  # SentencePiece cannot load without one; add it past the vocabulary
            piece = proto.pieces.add()
            piece.piece = "<sharkport-unk>"
            piece.type = pb.ModelProto.SentencePiece.UNKNOWN
            self._hidden_unk = n
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        except Exception as e:
            raise SharkportError(
                f"GGUF SentencePiece vocabulary ({KEY_TOKENS}/{KEY_SCORES}/{KEY_TYPES}) "
                f"cannot be loaded: {' '.join(str(e).split())}"
            ) from None
        self.clean_spaces = False
        self.strip_first_space = add_space_prefix
        # tokenizer_json's arguments but BOS/EOS, which hf_tokenizer is given
        self._json_vocab = dict(tokens=tokens, scores=scores, types=types, unk_id=unk_id,
                                add_space_prefix=add_space_prefix,
                                remove_extra_whitespaces=proto.normalizer_spec.remove_extra_whitespaces,
                                byte_fallback=proto.trainer_spec.byte_fallback)

        pieces = []
        for text, t in zip(tokens, types):
            if t == TOKEN_BYTE and BYTE_PIECE.fullmatch(text):
                pieces.append(bytes([int(text[3:5], 16)]))
            elif t in (TOKEN_CONTROL, TOKEN_UNKNOWN):
                pieces.append(text.encode("utf-8"))
            elif t == TOKEN_UNUSED:
                pieces.append(b"")
            else:
                pieces.append(text.replace(SPACE, " ").encode("utf-8"))
        self.piece_bytes = pieces
        self.is_special = [t in SPECIAL_TYPES for t in types]
        # SentencePiece matches user-defined pieces itself, exactly as the original model does
        # (llama.cpp would also put a dummy-prefix space after them); control and unknown tokens
        # it never produces, so only those are split off before it sees the text.
        self.specials = literal_tokens(tokens, types, SPECIAL_TYPES)

    def encode(self, fragments: list[str]) -> list[list[int]]:
        """The token ids of each of `fragments` (text free of literal special tokens)."""
        out = self._sp.encode(fragments)
        if self._hidden_unk is not None:
            out = [[0 if i == self._hidden_unk else i for i in ids] for ids in out]
        return out

    def hf_tokenizer(self, bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool) -> Any:
        """The vocabulary as one `tokenizers.Tokenizer` (see `tokenizer_json`)."""
        return tokenizer_json(**self._json_vocab, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, add_eos=add_eos)


def tokenizer_json(tokens: list[str], scores: list[float], types: list[int], *, unk_id: int | None,
                   add_space_prefix: bool, remove_extra_whitespaces: bool, byte_fallback: bool,
                   bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool) -> Any:
    """The `tokenizers.Tokenizer` that encodes and decodes as SentencePiece does with this
    vocabulary. Raises SharkportError for the settings it cannot express."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    if remove_extra_whitespaces:
        raise SharkportError("writing tokenizer.json for a SentencePiece vocabulary with "
                             "tokenizer.ggml.remove_extra_whitespaces is not supported")
    if add_space_prefix and TOKEN_USER_DEFINED in types:
        # tokenizers prefixes every piece of text between added tokens; SentencePiece only its input
        raise SharkportError("writing tokenizer.json for a SentencePiece vocabulary with both a space "
                             "prefix and user-defined tokens is not supported")
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if not text or text in vocab:  # ids must keep their places: an unreachable stand-in
            text = f"<sharkport-duplicate-{i}>"
        vocab[text] = i
    normal = {text: i for text, i in vocab.items() if types[i] == TOKEN_NORMAL}
    merges = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], i, left, right))
    merges.sort()
    unk = tokens[unk_id] if unk_id is not None else None
    tk = Tokenizer(BPE(vocab=vocab, merges=[(left, right) for *_, left, right in merges], unk_token=unk,
                       fuse_unk=True, byte_fallback=byte_fallback))
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tk.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN) and tokens[i]])
    tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                   for i, t in enumerate(types) if t == TOKEN_USER_DEFINED and tokens[i]])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(steps)
    bos = [tokens[bos_id]] if add_bos and bos_id is not None else []
    eos = [tokens[eos_id]] if add_eos and eos_id is not None else []
    if bos or eos:
        tk.post_processor = processors.TemplateProcessing(
            single=[*bos, "$A", *eos], pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
            special_tokens=[(tokens[i], i) for i, add in ((bos_id, bos), (eos_id, eos)) if add])
    return tk
