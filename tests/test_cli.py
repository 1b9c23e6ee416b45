"""The command lines as users run them: real subprocesses, exit codes, one-line errors."""

import json

import numpy as np
import pytest

from gguf_fixtures import random_blocks, write_gguf
from run_cli import run



@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": ("Q8_0", (8, 64), random_blocks("Q8_0", (8, 64), rng)),
        "output_norm.weight": ("F32", (64,), rng.standard_normal(64).astype(np.float32)),
    }
    meta = {"llama.block_count": 0, "tokenizer.ggml.model": "gpt2", "general.name": "x" * 500}
    return write_gguf(tmp_path_factory.mktemp("cli") / "small.gguf", tensors, meta)


def test_dump_gguf_prints_metadata_and_tensor_table(small_gguf):
    out = run("sharkport.tools.dump_gguf", "--gguf-file", str(small_gguf)).stdout
    assert "llama.block_count" in out and "(500 chars)" in out
    assert "token_embd.weight" in out and "Q8_0" in out and "8x64" in out


def test_dump_gguf_json_and_save(small_gguf, tmp_path):
    out = tmp_path / "small.irpa"
    proc = run("sharkport.tools.dump_gguf", "--gguf-file", str(small_gguf), "--json", "--save", str(out))
    report = json.loads(proc.stdout)
    assert report["metadata"]["general.name"] == {"text_length": 500, "head": "x" * 60}
    assert {t["name"]: (t["type"], t["shape"]) for t in report["tensors"]} == {
        "token_embd.weight": ("Q8_0", [8, 64]), "output_norm.weight": ("F32", [64])}
    assert out.is_file()


def _assert_one_line_error(proc, *needles):
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0]


def test_missing_file(tmp_path):
    proc = run("sharkport.tools.dump_gguf", "--gguf-file", str(tmp_path / "nope.gguf"),
               "--save", str(tmp_path / "x.irpa"), check_rc=2)
    _assert_one_line_error(proc, "nope.gguf")
    assert not list(tmp_path.iterdir())


def test_truncated_gguf(small_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(small_gguf.read_bytes()[:-100])
    proc = run("sharkport.tools.dump_gguf", "--gguf-file", str(bad), "--save", str(tmp_path / "x.irpa"), check_rc=2)
    _assert_one_line_error(proc, "cut.gguf", "truncated")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


def test_unsupported_tensor_type(tmp_path):
    shape = (2, 256)
    path = write_gguf(tmp_path / "iq.gguf", {"blk.0.ffn_up.weight": ("IQ2_XXS", shape, random_blocks(
        "IQ2_XXS", shape, np.random.default_rng(0)))})
    proc = run("sharkport.tools.dump_gguf", "--gguf-file", str(path), "--save", str(tmp_path / "x.irpa"), check_rc=2)
    _assert_one_line_error(proc, "blk.0.ffn_up.weight", "IQ2_XXS")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iq.gguf"]


def test_verbose_keeps_the_traceback(tmp_path):
    proc = run("sharkport.tools.dump_gguf", "--gguf-file", str(tmp_path / "nope.gguf"), "--verbose", check_rc=1)
    assert "Traceback" in proc.stderr


def test_export_flag_errors(small_gguf, tmp_path):
    base = ["sharkport.export", "--gguf-file", str(small_gguf), "--output-mlir", str(tmp_path / "x.mlir"),
            "--output-config", str(tmp_path / "x.json")]
    proc = run(*base, "--bs-prefill", "one", check_rc=2)
    assert "--bs-prefill" in proc.stderr
    proc = run(*base, "--iree-hal-target-device=cuda", check_rc=2)
    _assert_one_line_error(proc, "--output-vmfb")
    proc = run(*base, "--no-such-flag", check_rc=2)
    assert "--no-such-flag" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_run_missing_artifacts(tmp_path):
    proc = run("sharkport.run", "--vmfb", str(tmp_path / "x.vmfb"), "--irpa-file", str(tmp_path / "x.irpa"),
               "--config", str(tmp_path / "x.json"), "--prompt", "hi", check_rc=2)
    _assert_one_line_error(proc, "x.irpa")


@pytest.mark.parametrize("module", ["sharkport.tools.dump_gguf", "sharkport.export", "sharkport.run",
                                    "sharkport.tools.generate"],
                         ids=["dump_gguf", "export", "run", "generate"])
def test_help(module):
    assert "usage:" in run(module, "--help").stdout
