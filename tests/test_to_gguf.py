"""sharkport.tools.to_gguf: archives written back as GGUF, checked by readers we did not write:
gguf.GGUFReader (tensor names, types, shapes and bytes against the original GGUF) and
transformers' GGUF loader (which undoes llama.cpp's Q/K permutation itself) against the
original transformers model's logits."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from sharkport.archive import import_hf
from sharkport.formats.names import hf_to_gguf_name, permute_qk
from sharkport.tools import to_gguf
from test_llama_tiny import hf_logits, prompts_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-4


def params(names):
    return [pytest.param(n, id=n) for n in names]


def tensors_of(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def convert(source: Path, out: Path) -> Path:
    assert to_gguf.main(["--irpa-file", str(source), "--output-gguf", str(out)]) == 0
    return out


def load_in_transformers(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", params(["mha-tied", "gqa-untied"]))
def test_gguf_archive_round_trips_byte_for_byte(tiny, irpa_of, tmp_path, variant):
    """GGUF → .irpa → GGUF gives back every tensor with its name, type, shape and bytes."""
    out = convert(irpa_of(variant), tmp_path / "out" / "model.gguf")
    want, got = tensors_of(tiny[variant].gguf_path), tensors_of(out)
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].tensor_type == t.tensor_type and list(got[name].shape) == list(t.shape), name
        np.testing.assert_array_equal(got[name].data, t.data, err_msg=name)


@pytest.mark.parametrize("variant", params(["mha-tied", "gqa-untied"]))
def test_hf_archive_to_gguf_loads_in_transformers(tiny, tmp_path, variant):
    """HF checkpoint → import_hf (rope 'half') → to_gguf: Q/K rows are permuted as llama.cpp's
    converter permutes them, and transformers' GGUF loader reproduces the original logits."""
    m = tiny[variant]
    import_hf(m.hf_dir, tmp_path / "x.irpa", progress=False)
    out = convert(tmp_path / "x.irpa", tmp_path / "out" / "model.gguf")
    got = tensors_of(out)
    state = m.hf.state_dict()
    q = state["model.layers.1.self_attn.q_proj.weight"].numpy()
    k = state["model.layers.1.self_attn.k_proj.weight"].numpy()
    np.testing.assert_array_equal(got["blk.1.attn_q.weight"].data, permute_qk(q, m.spec.heads))
    np.testing.assert_array_equal(got["blk.1.attn_k.weight"].data, permute_qk(k, m.spec.kv_heads))
    expected = {hf_to_gguf_name(n) for n in state} - ({"output.weight"} if m.spec.tied else set())
    assert set(got) == expected
    loaded = load_in_transformers(out)
    assert loaded.config.num_key_value_heads == m.spec.kv_heads
    for p in prompts_for((1, 9, 40), m.spec.vocab_size, seed=11):
        np.testing.assert_allclose(hf_logits(loaded, p), hf_logits(m.hf, p), rtol=0, atol=ATOL)


def test_model_dir_source_matches_archive_source(tiny, tmp_path):
    m = tiny["gqa-tied"]
    import_hf(m.hf_dir, tmp_path / "x.irpa", progress=False)
    a = convert(tmp_path / "x.irpa", tmp_path / "a.gguf")
    assert to_gguf.main(["--model-dir", str(m.hf_dir), "--output-gguf", str(tmp_path / "b.gguf")]) == 0
    ta, tb = tensors_of(a), tensors_of(tmp_path / "b.gguf")
    assert ta.keys() == tb.keys()
    for name in ta:
        np.testing.assert_array_equal(ta[name].data, tb[name].data, err_msg=name)


def test_quantized_archive_keeps_blocks_and_tokenizer(smollm2_gguf, smollm2_irpa, tmp_path):
    """SmolLM2 Q4_1: every block-quantized tensor comes back with the original bytes, and the
    tokenizer keys come back equal (so llama.cpp and transformers tokenize it as before)."""
    out = convert(smollm2_irpa, tmp_path / "smollm2.gguf")
    want, got = tensors_of(smollm2_gguf), tensors_of(out)
    assert got.keys() == want.keys()
    types = set()
    for name, t in want.items():
        types.add(t.tensor_type.name)
        assert got[name].tensor_type == t.tensor_type, name
        np.testing.assert_array_equal(got[name].data, t.data, err_msg=name)
    assert "Q4_1" in types
    want_fields, got_fields = gguf.GGUFReader(smollm2_gguf).fields, gguf.GGUFReader(out).fields
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.chat_template"):
        if key in want_fields:
            assert got_fields[key].contents() == want_fields[key].contents(), key
    for key in ("llama.block_count", "llama.attention.head_count_kv", "llama.rope.freq_base"):
        assert got_fields[key].contents() == pytest.approx(want_fields[key].contents()), key


def test_refuses_to_overwrite_input_and_reports_missing_file(irpa_of, tmp_path, capsys):
    irpa = irpa_of("mha-tied")
    assert to_gguf.main(["--irpa-file", str(tmp_path / "nope.irpa"), "--output-gguf", str(tmp_path / "x.gguf")]) == 2
    assert "nope.irpa" in capsys.readouterr().err
    assert to_gguf.main(["--irpa-file", str(irpa), "--output-gguf", str(irpa)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("kind", params(["mistral", "mixtral"]))
def test_every_hyperparameter_key_comes_back(kind, tmp_path):
    """A Mistral's sliding window and a Mixtral's expert counts (GGUFs written as llama.cpp's
    converter writes them, plus the window key) → archive → to_gguf: gguf.GGUFReader finds every
    `llama.*` key of the original with its value."""
    from sharkport.archive import import_gguf
    from tiny_models import TinyRecipes

    source = TinyRecipes(tmp_path / "recipes")[kind].gguf_path
    import_gguf(source, tmp_path / "x.irpa", progress=False)
    out = convert(tmp_path / "x.irpa", tmp_path / "out" / "model.gguf")

    def keys(path):
        fields = gguf.GGUFReader(path).fields
        return {k: f.contents() for k, f in fields.items() if k.startswith("llama.")}

    want, got = keys(source), keys(out)
    assert {"llama.attention.sliding_window", "llama.expert_count"} & want.keys()
    assert got == pytest.approx(want)
