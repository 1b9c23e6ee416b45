"""tokenizer.json / tokenizer_config.json written by sharkport (`write_hf_tokenizer`,
`python -m sharkport.export --output-tokenizer-dir`), read back by code we did not write:
HF `tokenizers`, transformers' AutoTokenizer and shortfin's own Tokenizer class, against
sharkport's Tokenizer and transformers' reading of the same GGUF (SmolLM2)."""

from __future__ import annotations

import json

import pytest

from run_cli import run
from sharkport.errors import SharkportError
from sharkport.tokenizer import KNOWN_PRE_TOKENIZERS, Tokenizer, write_hf_tokenizer
from test_tokenizer import TEXTS, _byte_level_metadata, read_gguf_metadata, sp_model  # noqa: F401 (fixture)

# Special tokens written in the text, multi-byte characters (split over byte-level tokens),
# whitespace runs and plain text.
SAMPLES = [TEXTS[k] for k in ("hello_world", "special_chat", "special_adjacent", "special_in_text",
                              "special_partial", "accents", "cjk_chinese", "emoji_zwj", "math",
                              "space_run", "newlines", "code_python", "contractions", "empty")]


def _load(directory):
    from tokenizers import Tokenizer as HFTokenizer

    config = json.loads((directory / "tokenizer_config.json").read_text())
    return HFTokenizer.from_file(str(directory / "tokenizer.json")), config


@pytest.fixture(scope="module")
def smollm(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(str(smollm2_gguf)))


@pytest.fixture(scope="module")
def smollm_files(smollm, tmp_path_factory):
    directory = tmp_path_factory.mktemp("smollm-tokenizer")
    paths = write_hf_tokenizer(smollm, directory)
    assert sorted(p.name for p in paths) == ["tokenizer.json", "tokenizer_config.json"]
    return directory


@pytest.mark.parametrize("text", SAMPLES)
def test_smollm_files_encode_and_decode_like_sharkport(smollm, smollm_files, text):
    hf, _ = _load(smollm_files)
    for specials in (True, False):
        ids = smollm.encode(text, add_special_tokens=specials)
        assert hf.encode(text, add_special_tokens=specials).ids == ids
    for skip in (True, False):
        assert hf.decode(ids, skip_special_tokens=skip) == smollm.decode(ids, skip_special_tokens=skip)


def test_smollm_files_in_transformers_match_its_gguf_reading(smollm_files, smollm2_hf):
    """AutoTokenizer over the written folder against transformers' own GGUF conversion."""
    from transformers import AutoTokenizer

    ours, reference = AutoTokenizer.from_pretrained(str(smollm_files)), smollm2_hf[1]
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    for text in SAMPLES:
        ids = reference.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "user", "content": "Hi 🦙"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_smollm_files_in_shortfin(smollm, smollm_files):
    """shortfin's LLM server builds its tokenizer (and its EOS id) exactly like this."""
    pytest.importorskip("shortfin_apps.llm.components.tokenizer",
                        reason="shortfin is in the test extra: pip install -e '.[test]'")
    from shortfin_apps.llm.components.lifecycle import get_eos_from_tokenizer_config
    from shortfin_apps.llm.components.tokenizer import Tokenizer as ShortfinTokenizer

    eos = get_eos_from_tokenizer_config(smollm_files / "tokenizer_config.json")
    sf = ShortfinTokenizer.from_tokenizer_json_file(smollm_files / "tokenizer.json", eos_token=eos)
    assert sf.eos_token_id == smollm.eos_id
    encodings = sf.encode(SAMPLES)
    assert [e.ids for e in encodings] == [smollm.encode(t) for t in SAMPLES]
    assert sf.decode([e.ids for e in encodings]) == [smollm.decode(smollm.encode(t)) for t in SAMPLES]


@pytest.mark.parametrize("pre", KNOWN_PRE_TOKENIZERS)
def test_every_pre_tokenizer_and_llama_cpp_space_clean_up(pre, tmp_path):
    """Each pre-tokenizer's regexes survive tokenizer.json; vocabularies with llama.cpp's
    detokenizer clean-up (" ." -> ".", " 's" -> "'s" ...) decode with it."""
    tok = Tokenizer.from_gguf_metadata(_byte_level_metadata(pre))
    write_hf_tokenizer(tok, tmp_path)
    hf, config = _load(tmp_path)
    texts = ["the  cat's 12345 naïve 日本語\n\tin a 🦙<|end|>",
             "Hello , world ! Is it ? Yes . I 'm sure ' quoted ' we 've done"]
    for text in texts:
        ids = tok.encode(text)
        assert hf.encode(text).ids == ids
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    assert config["add_bos_token"] is tok.add_bos and config["eos_token"] == "<|end|>"


def test_bos_and_eos_from_the_post_processor(tmp_path):
    meta = dict(_byte_level_metadata("llama-bpe"), **{"tokenizer.ggml.add_eos_token": True})
    tok = Tokenizer.from_gguf_metadata(meta)
    write_hf_tokenizer(tok, tmp_path)
    hf, _ = _load(tmp_path)
    ids = tok.encode("the in a")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert hf.encode("the in a").ids == ids
    assert hf.encode("the in a", add_special_tokens=False).ids == tok.encode("the in a", add_special_tokens=False)


def test_huggingface_json_vocabulary_is_written_back(smollm_files, tmp_path):
    """A tokenizer.huggingface.json vocabulary (an imported HF checkpoint) is its own file."""
    text = (smollm_files / "tokenizer.json").read_text()
    tok = Tokenizer.from_gguf_metadata({"tokenizer.huggingface.json": text, "tokenizer.ggml.eos_token_id": 2})
    write_hf_tokenizer(tok, tmp_path)
    hf, config = _load(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads(text)
    assert config["eos_token"] == hf.id_to_token(2)
    assert [hf.encode(t).ids for t in SAMPLES] == [tok.encode(t) for t in SAMPLES]


# A SentencePiece vocabulary with the space prefix and a user-defined token: tokenizer.json
# cannot express it (tokenizers would prefix the text after the user-defined token too).
SPM_METADATA = {
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "\u2581a", "a", "<tool>"],
    "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, 0.0],
    "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 4],
}
# Runs of spaces and newlines (Gemma's user-defined pieces), special tokens, bytes, code.
SPM_SAMPLES = [TEXTS[k] for k in ("hello_world", "leading_spaces", "trailing_spaces", "space_run", "newlines",
                                  "crlf", "tabs", "mixed_ws", "numbers", "code_python", "accents", "cjk_japanese",
                                  "emoji_zwj", "math", "zero_width", "empty", "space")] + [
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", "<bos>a<pad>b<unk>c<mask>",
    "double  space and   triple", "    indented\n        deeper\n\n\n\nfar", "[multimodal] tag \x00\x01"]


def test_sentencepiece_space_prefix_with_user_defined_tokens_is_a_clear_error(tmp_path):
    with pytest.raises(SharkportError, match="SentencePiece") as e:
        write_hf_tokenizer(Tokenizer.from_gguf_metadata(SPM_METADATA), tmp_path)
    assert "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())


def test_sentencepiece_files_encode_like_sentencepiece(sp_model, tmp_path):
    """A SentencePiece BPE trained here (space prefix, byte fallback, a control token; its one
    user-defined token made normal): tokenizer.json encodes as sentencepiece and decodes as
    sharkport does."""
    sp, metadata = sp_model
    types = [1 if t == 4 else t for t in metadata["tokenizer.ggml.token_type"]]
    tok = Tokenizer.from_gguf_metadata(dict(metadata, **{"tokenizer.ggml.token_type": types}))
    write_hf_tokenizer(tok, tmp_path)
    hf, config = _load(tmp_path)
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>"
    for text in SAMPLES + SPM_SAMPLES + ["hi<|eot|> there", "The family of the student had a house."]:
        ids = tok.encode(text)
        assert hf.encode(text).ids == ids, text
        if not any(special in text for special in ("<unk>", "<s>", "</s>", "<|eot|>")):  # sharkport's own
            assert ids == [sp.bos_id()] + sp.encode(text), text
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), text


@pytest.mark.slow
def test_gemma3_files_encode_like_sharkport_transformers_and_shortfin(gemma3_gguf, tmp_path):
    """Gemma-3's 262,144-token SentencePiece vocabulary as tokenizer.json: the ids of sharkport's
    tokenizer (sentencepiece), of transformers' own reading of the GGUF and of shortfin's
    tokenizer over the written files are the same, and so are the decoded texts."""
    from shortfin_apps.llm.components.lifecycle import get_eos_from_tokenizer_config
    from shortfin_apps.llm.components.tokenizer import Tokenizer as ShortfinTokenizer
    from transformers import AutoTokenizer

    tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(str(gemma3_gguf)))
    write_hf_tokenizer(tok, tmp_path)
    hf, config = _load(tmp_path)
    reference = AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)
    texts = SAMPLES + SPM_SAMPLES
    for text in texts:
        ids = reference(text).input_ids
        assert tok.encode(text) == ids, text
        assert hf.encode(text).ids == ids, text
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), text
    eos = get_eos_from_tokenizer_config(tmp_path / "tokenizer_config.json")
    sf = ShortfinTokenizer.from_tokenizer_json_file(tmp_path / "tokenizer.json", eos_token=eos)
    assert sf.eos_token_id == tok.eos_id == 1
    assert [e.ids for e in sf.encode(texts)] == [tok.encode(t) for t in texts]


def _spm_gguf(path):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPM_METADATA["tokenizer.ggml.tokens"])
    writer.add_token_scores(SPM_METADATA["tokenizer.ggml.scores"])
    writer.add_token_types(SPM_METADATA["tokenizer.ggml.token_type"])
    writer.add_tensor("token_embd.weight", np.zeros((len(SPM_METADATA["tokenizer.ggml.tokens"]), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kernels", [[], ["--matvec-kernels"]], ids=["default", "kernels"])
def test_export_cli_refuses_first(tmp_path, kernels):
    """--output-tokenizer-dir is handled before the slow work: a vocabulary tokenizer.json cannot
    express fails at once with one line and leaves nothing behind, before the kernels' object is
    built (an empty cache, as on a new machine) or the export starts."""
    gguf = _spm_gguf(tmp_path / "spm.gguf")
    out = tmp_path / "out"
    proc = run("sharkport.export", "--gguf-file", str(gguf), "--output-mlir", str(out / "x.mlir"),
               "--output-config", str(out / "x.json"), "--output-tokenizer-dir", str(out / "tok"), *kernels,
               check_rc=2, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "SentencePiece" in lines[0], proc.stderr
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_export_cli_writes_tokenizer_beside_the_module(tmp_path):
    """The exporter's outputs for a tiny llama imported from an HF folder with a trained
    tokenizer.json: a service config shortfin's ModelParams accepts, and tokenizer files that
    encode like the folder's tokenizer in transformers."""
    from transformers import AutoTokenizer

    from sharkport.archive import import_hf
    from tiny_models import TinySpec, make_tiny_llama_with_bpe

    m = make_tiny_llama_with_bpe(TinySpec("tok", kv_heads=2, tied=True, vocab_size=320, seed=3), tmp_path / "hf")
    irpa = tmp_path / "tok.irpa"
    import_hf(m.hf_dir, irpa, progress=False)

    out = tmp_path / "out"
    run("sharkport.export", "--irpa-file", str(irpa), "--bs-prefill", "1", "--bs-decode", "1",
        "--output-mlir", str(out / "m.mlir"), "--output-config", str(out / "m.json"),
        "--output-tokenizer-dir", str(out))
    ours, reference = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(m.hf_dir))
    assert ours.eos_token == "<|endoftext|>" == reference.eos_token
    for text in SAMPLES:
        ids = reference.encode(text)
        assert ours.encode(text) == ids and ours.decode(ids) == reference.decode(ids)
    shortfin = pytest.importorskip("shortfin_apps.llm.components.config_struct")
    params = shortfin.ModelParams.load_json(out / "m.json")  # rejects fields it does not know
    config = json.loads((out / "m.json").read_text())
    assert params.paged_kv_cache.paged_kv_block_size_elements_per_device == \
        config["paged_kv_cache"]["paged_kv_block_size_elements_per_device"]
    assert params.prefill_batch_sizes == [1] and params.transformer_block_count == m.spec.layers
