"""Hugging Face checkpoint import (sharkport.formats.hf, archive.import_hf, tools.import_hf) and
tokenizers from HF tokenizer files, against references we did not write:

* tiny random-weight llamas saved by transformers' `save_pretrained` (one file, and sharded
  with a small `max_shard_size`), whose logits come from transformers' own forward pass;
* the llama.cpp-style GGUF of the same weights (tiny_models.py), imported by import_gguf;
* a byte-level BPE trained here with `tokenizers` and a SentencePiece BPE trained with
  `sentencepiece`, against `transformers.AutoTokenizer` loading the same files.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sharkport.archive import Dataset, import_hf
from sharkport.errors import SharkportError
from sharkport.formats.hf import hf_tokenizer_files, read_hf
from sharkport.formats.keys import LlamaHParams
from sharkport.tokenizer import Tokenizer, tokenizer_metadata_from_hf
from sharkport.tools import import_hf as import_hf_cli
from tiny_models import assert_same_hparams
from test_llama_tiny import BATCHES, check_prefill_decode, eager_session, hf_logits, prompts_for
from test_tokenizer import TEXTS, _corpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-4


def params(names):
    return [pytest.param(n, id=n) for n in names]


@pytest.fixture(scope="session")
def sharded_dir(tiny, tmp_path_factory) -> Path:
    """gqa-untied saved by transformers in several shards with model.safetensors.index.json."""
    path = tmp_path_factory.mktemp("sharded") / "hf"
    tiny["gqa-untied"].hf.save_pretrained(path, max_shard_size="40KB")
    return path


@pytest.fixture(scope="session")
def hf_irpa(tiny, sharded_dir, tmp_path_factory):
    """(variant, "single" | "sharded") → .irpa made by import_hf, once per session."""
    made: dict[tuple[str, str], Path] = {}

    def get(variant: str, layout: str = "single") -> Path:
        if (variant, layout) not in made:
            src = sharded_dir if layout == "sharded" else tiny[variant].hf_dir
            path = tmp_path_factory.mktemp(f"hf-{variant}-{layout}") / "model.irpa"
            import_hf(src, path, progress=False)
            made[variant, layout] = path
        return made[variant, layout]

    return get


def test_sharded_fixture_is_sharded(sharded_dir):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert not (sharded_dir / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# Metadata: the same hparams as a GGUF import, HF rotary layout, same tensors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", params(["mha-tied", "gqa-untied", "mha-bias"]))
def test_metadata_matches_gguf_import(tiny, irpa_of, hf_irpa, variant):
    hf_ds, gguf_ds = Dataset.load(hf_irpa(variant)), Dataset.load(irpa_of(variant))
    assert_same_hparams(*(LlamaHParams.from_metadata(d.hparams) for d in (hf_ds, gguf_ds)))
    # every llama.* key of the GGUF import is there too (general.file_type/name describe the file)
    gguf_keys = {k for k in gguf_ds.hparams if k.startswith("llama.")}
    assert gguf_keys <= set(hf_ds.hparams)
    assert hf_ds.rope_layout == "half" and gguf_ds.rope_layout == "interleaved"
    assert hf_ds.metadata["tensors"].keys() == gguf_ds.metadata["tensors"].keys()
    for name, layout in hf_ds.metadata["tensors"].items():
        assert layout == gguf_ds.metadata["tensors"][name], name


@pytest.mark.parametrize("layout", params(["single", "sharded"]))
def test_tensors_are_the_hf_weights_renamed(tiny, hf_irpa, layout):
    m = tiny["gqa-untied"]
    theta = Dataset.load(hf_irpa("gqa-untied", layout)).theta
    from sharkport.formats.names import hf_to_gguf_name

    for hf_name, t in m.hf.state_dict().items():
        np.testing.assert_array_equal(theta[hf_to_gguf_name(hf_name)].numpy(), t.numpy(), err_msg=hf_name)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="f16"), pytest.param(torch.bfloat16, id="bf16")])
def test_dtype_converts_matrices_keeps_vectors_f32(tiny, tmp_path, dtype):
    m = tiny["mha-bias"]
    import_hf_cli.main(["--model-dir", str(m.hf_dir), "--output-irpa", str(tmp_path / "x.irpa"),
                        "--dtype", str(dtype).removeprefix("torch.")])
    ds = Dataset.load(tmp_path / "x.irpa")
    from sharkport.formats.names import hf_to_gguf_name

    for hf_name, t in m.hf.state_dict().items():
        got = ds.theta[hf_to_gguf_name(hf_name)]
        want = t.to(torch.float32 if t.dim() == 1 else dtype)
        assert got.dtype == want.dtype, hf_name
        assert torch.equal(got, want), hf_name
    assert ds.metadata["tensors"]["blk.0.attn_q.weight"]["type"] == {torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]
    assert ds.metadata["tensors"]["blk.0.attn_q.bias"]["type"] == "F32"


# ---------------------------------------------------------------------------------------------
# Logits: eager recipe over the imported archive against transformers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", params(BATCHES))
@pytest.mark.parametrize("variant,layout", [
    pytest.param("mha-tied", "single", id="mha-tied"),
    pytest.param("mha-bias", "single", id="mha-bias"),
    pytest.param("gqa-untied", "sharded", id="gqa-untied-sharded"),
])
def test_eager_matches_transformers(tiny, hf_irpa, variant, layout, batch):
    check_prefill_decode(eager_session(hf_irpa(variant, layout)), tiny[variant].hf, BATCHES[batch])


def test_folder_loads_directly(tiny):
    """Dataset.load on the checkpoint folder itself (what export/generate --hf-dataset use)."""
    m = tiny["gqa-tied"]
    check_prefill_decode(eager_session(m.hf_dir), m.hf, BATCHES["bs1"])


# ---------------------------------------------------------------------------------------------
# Compiled: an HF import and a GGUF import of the same weights give the same logits
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def compiled_hf(hf_irpa):
    """gqa-untied imported from the sharded checkpoint, exported with TINY_EXPORT, compiled."""
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export
    from tiny_models import TINY_EXPORT, exact_cache

    irpa = hf_irpa("gqa-untied", "sharded")
    out = irpa.parent / "compiled"
    output, service = export_model(Dataset.load(irpa), TINY_EXPORT, exact_cache())
    save_export(output, service, out / "model.mlir", out / "model.json")
    compile_mlir(out / "model.mlir", out / "model.vmfb")
    return out / "model.vmfb", irpa, out / "model.json"


@pytest.mark.slow
def test_compiled_hf_import_matches_transformers_and_gguf_import(tiny, compiled_hf, compiled_of):
    from sharkport.runtime.session import IreeSession
    from tiny_models import TINY_EXPORT

    m = tiny["gqa-untied"]
    pages = TINY_EXPORT.device_block_count
    hf_session = IreeSession(*compiled_hf, pages=pages)
    for batch in BATCHES.values():
        check_prefill_decode(hf_session, m.hf, batch)

    gguf_session = IreeSession(*compiled_of("gqa-untied"), pages=pages)
    batch = BATCHES["bs4"]
    prompts = prompts_for(batch.lengths, m.spec.vocab_size, seed=7)
    stride = TINY_EXPORT.block_seq_stride
    blocks = -(-max(batch.lengths) // stride)
    tokens = np.zeros((len(prompts), blocks * stride), np.int64)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    args = (tokens, np.array(batch.lengths, np.int64), np.array(batch.pages, np.int64)[:, :blocks])
    from_hf, from_gguf = hf_session.prefill(*args), gguf_session.prefill(*args)
    for r, p in enumerate(prompts):
        np.testing.assert_allclose(from_hf[r, :len(p)], from_gguf[r, :len(p)], rtol=0, atol=ATOL)
        np.testing.assert_allclose(from_hf[r, :len(p)], hf_logits(m.hf, p), rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# Bad checkpoints: one line naming the key, nothing written
# ---------------------------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _break_unknown_arch(d: Path) -> None:
    _edit_config(d, architectures=["BertForMaskedLM"])


def _break_shape(d: Path) -> None:
    _edit_config(d, intermediate_size=96)


def _break_missing_shard(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    (d / sorted(set(index["weight_map"].values()))[-1]).unlink()


def _break_missing_tensor(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _break_extra_tensor(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.bias"] = torch.zeros(128)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _break_no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _break_shard_outside(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "/etc/passwd"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


BROKEN = {
    "unknown-arch": ("single", _break_unknown_arch, r"BertForMaskedLM.*not supported"),
    "shape-mismatch": ("single", _break_shape, r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight has shape"),
    "missing-shard": ("sharded", _break_missing_shard, r"model-\d+-of-\d+\.safetensors: shard listed"),
    "missing-tensor": ("sharded", _break_missing_tensor, r"missing tensors blk\.1\.ffn_up\.weight"),
    "unknown-tensor": ("single", _break_extra_tensor, r"model\.layers\.0\.mlp\.up_proj\.bias"),
    "no-config": ("single", _break_no_config, r"config\.json: missing"),
    "shard-outside": ("sharded", _break_shard_outside, r"weight_map names '/etc/passwd', not a file in the checkpoint"),
}


@pytest.mark.parametrize("key, value, message", [
    ("rms_norm_eps", -1e-5, r"layer_norm_rms_epsilon is -1e-05; it must be a finite number above 0"),
    ("rope_theta", -10000.0, r"rope.freq_base is -10000.0; it must be a finite number above 0"),
    ("max_position_embeddings", -1, r"context_length is -1; it must be a whole number above 0"),
    ("partial_rotary_factor", 0.0, r"partial_rotary_factor is 0.0; it must be a number in \(0, 1\]"),
    ("num_hidden_layers", 0, r"block_count is 0; it must be a whole number above 0"),
])
def test_out_of_range_config_is_one_line_error(tiny, tmp_path, capsys, key, value, message):
    """config.json values that would size nothing or give NaN logits are refused at import."""
    d = _copy(tiny["gqa-untied"].hf_dir, tmp_path / "ckpt")
    config = json.loads((d / "config.json").read_text())
    nested = config.get("rope_parameters") or {}
    (nested if key in nested else config)[key] = value  # transformers 5 keeps rope_theta in rope_parameters
    (d / "config.json").write_text(json.dumps(config))
    check_import_refused(d, tmp_path, capsys, message)


@pytest.mark.parametrize("case", params(BROKEN))
def test_bad_checkpoint_is_one_line_error(tiny, sharded_dir, tmp_path, capsys, case):
    layout, breaker, message = BROKEN[case]
    d = _copy(sharded_dir if layout == "sharded" else tiny["gqa-untied"].hf_dir, tmp_path / "ckpt")
    breaker(d)
    check_import_refused(d, tmp_path, capsys, message)


def check_import_refused(model_dir, tmp_path, capsys, message: str) -> None:
    """`tools.import_hf` on `model_dir` exits 2 with one line matching `message` and writes nothing."""
    capsys.readouterr()
    out = tmp_path / "x.irpa"
    assert import_hf_cli.main(["--model-dir", str(model_dir), "--output-irpa", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert re.search(message, err), err
    assert not out.exists() and not list(tmp_path.glob(".x.irpa*"))


def test_import_hf_help_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        import_hf_cli.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--model-dir", "--hf-dataset", "--output-irpa", "--dtype"):
        assert flag in out


# ---------------------------------------------------------------------------------------------
# Tokenizers from tokenizer.json and tokenizer.model against transformers
# ---------------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A byte-level BPE trained with `tokenizers`, saved as tokenizer.json with a post-processor
    that adds BOS, plus tokenizer_config.json (special tokens and chat template)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_corpus(), trainer)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", 0)])
    d = tmp_path_factory.mktemp("bpe")
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> Path:
    """A SentencePiece BPE (Llama's settings) saved as tokenizer.model, with one special token
    added on top by tokenizer_config.json, as Llama fine-tunes do."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=model, model_type="bpe", vocab_size=400,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        user_defined_symbols=["<tool>"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    d = tmp_path_factory.mktemp("spm")
    (d / "tokenizer.model").write_bytes(model.getvalue())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "added_tokens_decoder": {"400": {"content": "<|eot|>", "special": True}},
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                         "{{ eos_token }}{% endfor %}"}))
    return d


def _ours(d: Path) -> Tokenizer:
    # through JSON, as the archive stores it
    return Tokenizer.from_gguf_metadata(json.loads(json.dumps(tokenizer_metadata_from_hf(hf_tokenizer_files(d)))))


def _transformers(d: Path):
    import transformers

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return transformers.AutoTokenizer.from_pretrained(str(d))


BPE_TEXTS = TEXTS | {"chat_markers": "<|im_start|>user\nhi<|im_end|>", "bos_in_text": "a<s>b</s>"}


def test_tokenizer_json_matches_transformers(bpe_dir):
    ours, ref = _ours(bpe_dir), _transformers(bpe_dir)
    assert ours.vocab_size == len(ref) and ours.add_bos
    assert (ours.bos_id, ours.eos_id) == (ref.bos_token_id, ref.eos_token_id)
    for name, text in BPE_TEXTS.items():
        ids = ref.encode(text)
        assert ours.encode(text) == ids, name
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), name
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), name
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), name
        dec = ours.stream_decoder()
        assert "".join(dec.add(i) for i in ids) + dec.flush() == ours.decode(ids), name
    assert len(BPE_TEXTS) >= 30
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_tokenizer_model_matches_transformers_and_sentencepiece(spm_dir):
    """tokenizer.model through the GGUF "llama" vocabulary path. sentencepiece itself agrees on
    every text; transformers' conversion of tokenizer.model (Metaspace, prepend "first") drops
    one space of a leading space run and the dummy prefix after a special token, so texts with
    those are compared with sentencepiece only."""
    import sentencepiece as spm

    ours, ref = _ours(spm_dir), _transformers(spm_dir)
    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    assert ours.vocab_size == len(ref) == sp.get_piece_size() + 1
    assert (ours.bos_id, ours.eos_id, ours.unk_id) == (ref.bos_token_id, ref.eos_token_id, ref.unk_token_id)
    texts = TEXTS | {"user_defined": "call <tool> now", "added_special": "hi<|eot|>", "unseen": "Zyxwvut quokka"}
    compared = 0
    for name, text in texts.items():
        if "<|" not in text:
            assert ours.encode(text) == [1] + sp.encode(text), name
        if text[:1].isspace() or "<|eot|> " in text:
            continue
        ids = ref.encode(text)
        assert ours.encode(text) == ids, name
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), name
        compared += 1
    assert compared >= 30
    assert ours.encode("hi<|eot|>")[-1] == 400
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("tokenizer", params(["bpe", "spm"]))
def test_archive_carries_the_tokenizer(tiny, tmp_path, bpe_dir, spm_dir, tokenizer):
    """import_hf embeds the tokenizer files; Dataset.tokenizer() of the archive encodes as
    transformers does with the folder."""
    src = bpe_dir if tokenizer == "bpe" else spm_dir
    d = _copy(tiny["mha-tied"].hf_dir, tmp_path / "ckpt")
    for f in src.iterdir():
        shutil.copy(f, d / f.name)
    import_hf(d, tmp_path / "x.irpa", progress=False)
    ours, ref = Dataset.load(tmp_path / "x.irpa").tokenizer(), _transformers(d)
    for name, text in TEXTS.items():
        if not text[:1].isspace():
            assert ours.encode(text) == ref.encode(text), name


def test_folder_without_tokenizer_has_none(tiny, hf_irpa):
    with pytest.raises(SharkportError, match="carries no tokenizer"):
        Dataset.load(hf_irpa("mha-tied")).tokenizer()


def test_read_hf_reads_headers_only(tiny):
    """read_hf lists names, dtypes and shapes from the safetensors headers."""
    m = tiny["mha-untied"]
    ckpt = read_hf(m.hf_dir)
    state = m.hf.state_dict()
    assert set(ckpt.headers) == set(state)
    for name, (dtype, shape) in ckpt.headers.items():
        assert dtype == "F32" and shape == tuple(state[name].shape)
