"""The command lines as users run them: real subprocesses, exit codes, one-line errors."""

import argparse
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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
    proc = run("sharkport.tools.dump_gguf", "--gguf-file", str(small_gguf), "--json", "--output-irpa", str(out))
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
               "--output-irpa", str(tmp_path / "x.irpa"), check_rc=2)
    _assert_one_line_error(proc, "nope.gguf")
    assert not list(tmp_path.iterdir())


def test_truncated_gguf(small_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(small_gguf.read_bytes()[:-100])
    proc = run("sharkport.tools.dump_gguf", "--gguf-file", str(bad), "--output-irpa", str(tmp_path / "x.irpa"), check_rc=2)
    _assert_one_line_error(proc, "cut.gguf", "truncated")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


def test_unsupported_tensor_type(tmp_path):
    shape = (2, 256)
    path = write_gguf(tmp_path / "iq.gguf", {"blk.0.ffn_up.weight": ("IQ2_XXS", shape, random_blocks(
        "IQ2_XXS", shape, np.random.default_rng(0)))})
    proc = run("sharkport.tools.dump_gguf", "--gguf-file", str(path), "--output-irpa", str(tmp_path / "x.irpa"), check_rc=2)
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


# ---------------------------------------------------------------------------------------------
# The `sharkport` command, flag names, help
# ---------------------------------------------------------------------------------------------

def test_sharkport_command_lists_every_tool():
    from sharkport.cli import COMMANDS

    exe = shutil.which("sharkport")
    assert exe, "the console script is not installed: pip install -e ."
    for argv in ([exe, "--help"], [sys.executable, "-m", "sharkport", "--help"]):
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        assert all(f"  {name} " in out for name in COMMANDS), out
    usage = subprocess.run([exe, "export", "--help"], capture_output=True, text=True, check=True).stdout
    assert usage.startswith("usage: sharkport export ")
    proc = subprocess.run([exe, "bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "bogus" in proc.stderr


def test_sharkport_import_is_dump_gguf_output_irpa(small_gguf, tmp_path):
    """`sharkport import` writes the same archive as the GGUF importer, and prints no report."""
    proc = subprocess.run([shutil.which("sharkport"), "import", "--gguf-file", str(small_gguf),
                           "--output-irpa", str(tmp_path / "a.irpa")], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    run("sharkport.tools.dump_gguf", "--gguf-file", str(small_gguf), "--output-irpa", str(tmp_path / "b.irpa"))
    assert (tmp_path / "a.irpa").read_bytes() == (tmp_path / "b.irpa").read_bytes()
    proc = run("sharkport", "import", "--output-irpa", str(tmp_path / "c.irpa"), check_rc=2)
    _assert_one_line_error(proc, "--gguf-file", "--model-dir", "--hf-dataset")
    proc = run("sharkport", "import", "--gguf-file", str(small_gguf), check_rc=2)  # nowhere to write it
    _assert_one_line_error(proc, "--output-irpa")


def test_old_flag_names_still_work_but_are_not_offered(small_gguf, tmp_path):
    proc = run("sharkport.tools.dump_gguf", "--gguf-file", str(small_gguf), "--save", str(tmp_path / "x.irpa"),
               "--dump-tensor-dir", str(tmp_path / "d"), "--quiet")
    assert (tmp_path / "x.irpa").is_file() and (tmp_path / "d" / "index.json").is_file(), proc.stderr
    helps = run("sharkport.tools.dump_gguf", "--help").stdout
    assert "--output-irpa" in helps and "--save" not in helps and "--dump-tensor-dir" not in helps


def _tool_parsers():
    """Every tool's argparse parser, captured as its main() parses `--help`."""
    import argparse
    import importlib

    from sharkport.cli import COMMANDS

    class Captured(Exception):
        pass

    parsers = {}
    real = argparse.ArgumentParser.parse_known_args  # parse_args calls it too

    def capture(self, args=None, namespace=None):
        raise Captured(self)

    argparse.ArgumentParser.parse_known_args = capture
    try:
        for name, (module, _) in COMMANDS.items():
            if module:
                with pytest.raises(Captured) as caught:
                    importlib.import_module(module).main(["--help"])
                parsers[name] = caught.value.args[0]
    finally:
        argparse.ArgumentParser.parse_known_args = real
    return parsers


def test_every_flag_has_help_and_follows_the_naming_scheme():
    """Inputs are --gguf-file / --irpa-file / --model-dir / --hf-dataset, outputs --output-<kind>."""
    parsers = _tool_parsers()
    assert len(parsers) >= 10
    for name, parser in parsers.items():
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for p in [parser, *(sp for a in subparsers for sp in a.choices.values())]:
            for action in p._actions:
                if isinstance(action, argparse._SubParsersAction):
                    continue
                assert action.help, f"sharkport {name}: {action.option_strings or action.dest} has no help"
                for flag in action.option_strings:
                    assert flag not in ("--save", "--output", "--output-dir", "--hf-model"), (name, flag)


def test_wheel_ships_the_registry_kernels_and_console_script(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(repo)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("sharkport-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "sharkport/datasets/datasets.yaml" in names and "sharkport/kernels/matvec.c" in names
    assert "sharkport = sharkport.cli:main" in entry_points
