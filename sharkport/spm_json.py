"""A SentencePiece BPE vocabulary (GGUF `tokenizer.ggml.model` "llama": tokens, scores, types)
as a Hugging Face `tokenizers.Tokenizer`, for the `tokenizer.json` that shortfin's server and
transformers read.

SentencePiece's BPE merges, at each step, the adjacent pair whose concatenation is the
vocabulary piece of highest score. A `tokenizers` BPE model does the same when its merges are
every split of every normal piece into two pieces, ranked by the joined piece's score. The rest
is SentencePiece's pipeline in `tokenizers` terms: spaces become "▁" (after a "▁" prefix where
`add_space_prefix`), characters outside the vocabulary fall back to `<0xNN>` byte pieces,
control and unknown tokens are special added tokens, user-defined ones plain added tokens, and
the decoder undoes it all.
"""

from __future__ import annotations

from typing import Any

from .errors import SharkportError

SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space inside pieces
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types


def spm_tokenizer(tokens: list[str], scores: list[float], types: list[int], *, unk_id: int | None,
                  add_space_prefix: bool, remove_extra_whitespaces: bool, byte_fallback: bool,
                  bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool) -> Any:
    """The `tokenizers.Tokenizer` that encodes and decodes as SentencePiece does with this
    vocabulary. Raises SharkportError for the settings it cannot express."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    if remove_extra_whitespaces:
        raise SharkportError("writing tokenizer.json for a SentencePiece vocabulary with "
                             "tokenizer.ggml.remove_extra_whitespaces is not supported")
    if add_space_prefix and USER_DEFINED in types:
        # tokenizers prefixes every piece of text between added tokens; SentencePiece only its input
        raise SharkportError("writing tokenizer.json for a SentencePiece vocabulary with both a space "
                             "prefix and user-defined tokens is not supported")
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if not text or text in vocab:  # ids must keep their places: an unreachable stand-in
            text = f"<sharkport-duplicate-{i}>"
        vocab[text] = i
    normal = {text: i for text, i in vocab.items() if types[i] == NORMAL}
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
                           for i, t in enumerate(types) if t in (CONTROL, UNKNOWN) and tokens[i]])
    tk.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                   for i, t in enumerate(types) if t == USER_DEFINED and tokens[i]])
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
