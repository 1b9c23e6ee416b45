"""The quantize tool as users run it: bytes equal gguf.quants.quantize from f16, the written GGUF
loads in transformers and gives the logits of our recipe over the written archive, and bad
flags are one-line errors."""

from __future__ import annotations


import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from sharkport.archive import Dataset, QuantizedTensor, import_gguf
from sharkport.quant import BLOCK_TYPES

from gguf_fixtures import write_gguf
from run_cli import run

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def quantize(*args: str, rc: int = 0):
    return run("sharkport.tools.quantize", *args, check_rc=rc)


@pytest.fixture(scope="module")
def f16_model(tmp_path_factory):
    """An f16 GGUF (two matrices, one with rows that are not a multiple of 32, and a norm) and
    its archive."""
    root = tmp_path_factory.mktemp("f16")
    rng = np.random.default_rng(4)
    tensors = {
        "blk.0.attn_q.weight": ("F16", (64, 128), (rng.standard_normal((64, 128)) * 0.1).astype(np.float16)),
        "blk.0.ffn_down.weight": ("F16", (32, 96), (rng.standard_normal((32, 96)) * 0.1).astype(np.float16)),
        "blk.0.odd.weight": ("F16", (8, 40), rng.standard_normal((8, 40)).astype(np.float16)),
        "blk.0.attn_norm.weight": ("F32", (128,), rng.uniform(0.5, 1.5, 128).astype(np.float32)),
    }
    meta = {"llama.block_count": 1, "llama.embedding_length": 128, "llama.feed_forward_length": 96,
            "llama.attention.head_count": 2, "llama.context_length": 64, "llama.vocab_size": 64}
    path = write_gguf(root / "f16.gguf", tensors, meta)
    irpa = root / "f16.irpa"
    import_gguf(path, irpa, progress=False)
    return path, irpa, {k: v[2] for k, v in tensors.items()}


def _gguf_tensors(path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _archive_bytes(w: QuantizedTensor) -> bytes:
    bt, planes = BLOCK_TYPES[w.type_name], w.row_order().planes
    blocks = np.empty(planes["d"].shape, bt.struct)
    for field, _, _ in bt.fields:
        blocks[field] = planes[field].numpy()
    return blocks.tobytes()


@pytest.mark.parametrize("type_name", TYPES)
def test_bytes_equal_gguf_quants_from_f16(f16_model, tmp_path, type_name):
    _, irpa, source = f16_model
    out_irpa, out_gguf = tmp_path / "q.irpa", tmp_path / "q.gguf"
    proc = quantize("--irpa-file", str(irpa), "--type", type_name.lower(), "--output-irpa", str(out_irpa),
                    "--output-gguf", str(out_gguf))
    assert f"2 {type_name.lower()}" in proc.stderr

    written = _gguf_tensors(out_gguf)
    archive = Dataset.load(out_irpa)
    qtype = gguf.GGMLQuantizationType[type_name]
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        expected = quants.quantize(source[name].astype(np.float32), qtype).tobytes()
        assert written[name].tensor_type == qtype
        assert written[name].data.tobytes() == expected, name
        assert _archive_bytes(archive.theta[name]) == expected, name
    # A row of 40 values fills no whole block, and norms are never quantized.
    for name, kept in (("blk.0.odd.weight", "F16"), ("blk.0.attn_norm.weight", "F32")):
        assert written[name].tensor_type.name == kept and archive.metadata["tensors"][name]["type"] == kept
        np.testing.assert_array_equal(np.asarray(written[name].data).reshape(source[name].shape), source[name])


def test_type_map_first_match_wins(f16_model, tmp_path):
    _, irpa, _ = f16_model
    out = tmp_path / "q.irpa"
    quantize("--irpa-file", str(irpa), "--type", "q4_0", "--type-map", r"ffn_down=q8_0",
             "--type-map", r"blk\.0\.=bf16", "--output-irpa", str(out))
    types = {n: layout["type"] for n, layout in Dataset.load(out).metadata["tensors"].items()}
    assert types == {"blk.0.attn_q.weight": "BF16", "blk.0.ffn_down.weight": "Q8_0",
                     "blk.0.odd.weight": "BF16", "blk.0.attn_norm.weight": "BF16"}
    # a block type is a matrix's: a rule matching a norm (or a bias) leaves it as it is
    quantize("--irpa-file", str(irpa), "--type-map", r"blk\.0\.(attn_q|attn_norm)=q8_0", "--output-irpa", str(out))
    types = {n: layout["type"] for n, layout in Dataset.load(out).metadata["tensors"].items()}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"


@pytest.mark.parametrize("args, needle", [
    (["--type", "q3_k"], "cannot quantize to that type (K-quants and IQ4 types can be read and run, not yet written)"),
    (["--type", "q9"], "--type 'q9': cannot quantize to that type; choose one of q8_0"),
    (["--type-map", "(=q8_0"], "is not a valid regular expression"),
    (["--type-map", "q8_0"], "expected 'REGEX=TYPE'"),
    (["--type-map", "odd=q8_0"], "blk.0.odd.weight [8, 40] to q8_0"),
])
def test_bad_flags(f16_model, tmp_path, args, needle):
    _, irpa, _ = f16_model
    proc = quantize("--irpa-file", str(irpa), *args, "--output-irpa", str(tmp_path / "q.irpa"), rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert not (tmp_path / "q.irpa").exists()


def test_nothing_to_write(f16_model):
    proc = quantize("--irpa-file", str(f16_model[1]), "--type", "q8_0", rc=2)
    assert "--output-irpa" in proc.stderr and "--output-gguf" in proc.stderr


@pytest.mark.parametrize("type_name", ["q8_0", "q5_1"])
@pytest.mark.usefixtures("one_torch_thread")
def test_quantized_tiny_llama_in_transformers(tiny, type_name, tmp_path):
    """A tiny llama quantized by the tool: transformers reading the written GGUF gives the logits
    of our recipe over the written archive (the same quantized weights, two readers)."""
    from transformers import AutoModelForCausalLM

    from sharkport.export import ExportConfig, service_config
    from sharkport.models import ModelConfig, build_model
    from sharkport.runtime.eager import EagerSession

    m = tiny["gqa-tied"]
    (tmp_path / "gguf").mkdir()
    out_irpa, out_gguf = tmp_path / "q.irpa", tmp_path / "gguf" / "q.gguf"
    quantize("--gguf-file", str(m.gguf_path), "--type", type_name, "--output-irpa", str(out_irpa),
             "--output-gguf", str(out_gguf))
    ds = Dataset.load(out_irpa)
    assert ds.metadata["tensors"]["blk.0.attn_q.weight"]["type"] == type_name.upper()

    model = build_model(ds, ModelConfig(block_seq_stride=16))
    config = ExportConfig(bs_prefill=(1,), bs_decode=(1,), block_seq_stride=16, device_block_count=4, max_seq_len=64)
    session = EagerSession(model, service_config(model, config), pages=4)
    ids = [3, 99, 14, 200, 7, 7, 51, 128, 60, 2, 31]
    tokens = np.zeros((1, 16), np.int64)
    tokens[0, :len(ids)] = ids
    ours = session.prefill(tokens, np.array([len(ids)]), np.array([[1]]))[0, :len(ids)]

    hf = AutoModelForCausalLM.from_pretrained(out_gguf.parent, gguf_file=out_gguf.name, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    # Quantization really happened: the original float weights give different logits.
    with torch.no_grad():
        original = m.hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(original - ref).max() > 1e-3
