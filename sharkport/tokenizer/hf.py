"""Hugging Face tokenizer files: a checkpoint's files as GGUF tokenizer keys, and a whole
tokenizer.json (GGUF key `tokenizer.huggingface.json`) run by `tokenizers`, so it encodes exactly
as `transformers` does with the same file.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..errors import SharkportError
from .metadata import ID_KEYS, KEY_CHAT_TEMPLATE, KEY_HF_JSON, KEY_TOKENS, SPECIAL_ROLES, get_id
from .spm import spm_metadata


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
        tk = load_hf_json(files["tokenizer.json"], f"{where or 'the checkpoint'}: its tokenizer.json")
        meta: dict[str, Any] = {KEY_HF_JSON: files["tokenizer.json"]}
        lookup = tk.token_to_id
    elif "tokenizer.model" in files:
        meta = spm_metadata(files["tokenizer.model"], config, where)
        index = {t: i for i, t in enumerate(meta[KEY_TOKENS])}
        lookup = index.get
    else:
        return {}
    for role in SPECIAL_ROLES:
        token = config.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None and lookup(str(token)) is not None:
            meta[ID_KEYS[role]] = lookup(str(token))
    if template:
        meta[KEY_CHAT_TEMPLATE] = template
    return meta


def load_hf_json(text: str, what: str) -> Any:
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


class HfVocabulary:
    """A whole HF tokenizer.json, run by `tokenizers` as transformers runs it: its own
    normalizer, pre-tokenizer, added tokens and post-processor (which adds BOS/EOS).

    `tokenizer` is the `tokenizers.Tokenizer`; `vocab_size`, `bos_id`, `eos_id`, `unk_id`,
    `pad_id` come from the metadata, `add_bos` / `add_eos` from what the post-processor does.
    """

    def __init__(self, metadata: Mapping[str, Any]) -> None:
        tk = load_hf_json(str(metadata[KEY_HF_JSON]), KEY_HF_JSON)
        self.tokenizer = tk
        n = self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = (
            get_id(metadata, ID_KEYS[role], n, None) for role in SPECIAL_ROLES)
        with_specials, bare = tk.encode("a").ids, tk.encode("a", add_special_tokens=False).ids
        self.add_bos = self.bos_id is not None and with_specials[:1] == [self.bos_id] != bare[:1]
        self.add_eos = self.eos_id is not None and with_specials[-1:] == [self.eos_id] != bare[-1:]
        self.is_special = [False] * n
        for i, added in tk.get_added_tokens_decoder().items():
            if added.special and i < n:
                self.is_special[i] = True

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The token's text alone (a byte-fallback piece gives U+FFFD)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
