"""Safe writes under SIGKILL: a process killed while writing the .mlir, service config, .vmfb or
.gguf leaves each output as it was before (or absent), never partial. (The .irpa case is
tests/test_archive.py::test_sigkill_mid_write_leaves_the_old_archive.)

Two ways to kill: at the worst moment, deterministically (the child kills itself just before
the rename that would publish an output, after cutting its finished temporary file in half),
and at a random moment, from outside (the parent kills the child as soon as the temporary
.vmfb appears, while iree-compile is still running)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Each case exports (and some compile) a tiny model; the default suite keeps the .irpa kill test
# (test_archive.py), these cover the other outputs.
pytestmark = [pytest.mark.slow, pytest.mark.extended]

# Runs `python -m <module> <args...>` in-process, with os.replace trapped: the rename onto the
# file named KILL_AT is never done; instead the temporary file is cut in half (a write in
# progress) and the process SIGKILLs itself.
_CHILD = """
import os, runpy, signal, sys
kill_at, module, *args = sys.argv[1:]
real_replace = os.replace
def replace(src, dst):
    if os.path.basename(dst) == kill_at:
        with open(src, "r+b") as f:
            f.truncate(os.path.getsize(src) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
os.replace = replace
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__")
"""

OLD = {"mlir": b"old mlir\n", "json": b'{"old": true}\n', "vmfb": b"old vmfb"}


def _run_killed_at(kill_at: str, module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", _CHILD, kill_at, module, *args],
                          capture_output=True, text=True, timeout=900, env=env)


def _export_args(gguf_path, out) -> list[str]:
    return ["--gguf-file", str(gguf_path), "--output-mlir", str(out / "model.mlir"),
            "--output-config", str(out / "model.json"), "--output-vmfb", str(out / "model.vmfb"),
            "--bs-prefill", "1", "--bs-decode", "1", "--block-seq-stride", "16",
            "--max-seq-len", "64", "--device-block-count", "4"]


def _previous_outputs(out):
    for ext, data in OLD.items():
        (out / f"model.{ext}").write_bytes(data)


@pytest.mark.parametrize("kill_at, previous, published", [
    pytest.param("model.mlir", False, [], id="mlir-first-export"),
    pytest.param("model.json", True, ["mlir"], id="config-over-old"),
    pytest.param("model.vmfb", True, ["mlir", "json"], id="vmfb-over-old"),
])
def test_export_killed_before_publishing_an_output(tiny, tmp_path, kill_at, previous, published):
    """Outputs are published together, once all are made, in order mlir, config, vmfb; killed
    between two renames, the earlier ones are new and whole, that one and the later ones are
    the old files (or absent)."""
    if previous:
        _previous_outputs(tmp_path)
    proc = _run_killed_at(kill_at, "sharkport.export", *_export_args(tiny["gqa-untied"].gguf_path, tmp_path))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    for ext, old in OLD.items():
        path = tmp_path / f"model.{ext}"
        if ext not in published:
            assert (path.read_bytes() if path.exists() else None) == (old if previous else None), path
        elif ext == "mlir":
            text = path.read_text()
            assert "func.func @prefill_bs1" in text and "func.func @decode_bs1" in text
            assert text.rstrip().endswith("}")
        elif ext == "json":
            assert json.loads(path.read_text())["prefill_batch_sizes"] == [1]


def _compilers_writing_in(folder) -> list[int]:
    """Pids of iree-compile processes whose command line names a file in `folder`."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"iree-compile") and any(str(folder).encode() in a for a in args):
            pids.append(int(cmdline.parent.name))
    return pids


def test_vmfb_killed_while_compiling(tiny, tmp_path):
    """SIGKILL to the exporter alone while iree-compile makes the .vmfb: the compiler dies with it,
    and every output is the old file (the set appears whole or not at all)."""
    _previous_outputs(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "sharkport.export",
                             *_export_args(tiny["gqa-untied"].gguf_path, tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if _compilers_writing_in(tmp_path):
            os.kill(proc.pid, signal.SIGKILL)  # the exporter only, not its process group
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the export finished before it could be killed"
    for _ in range(100):
        if not _compilers_writing_in(tmp_path):
            break
        time.sleep(0.05)
    assert not _compilers_writing_in(tmp_path), "iree-compile outlived the export"
    for ext, old in OLD.items():
        assert (tmp_path / f"model.{ext}").read_bytes() == old, ext


@pytest.mark.parametrize("previous", [b"old gguf", None], ids=["replaces-old", "first-write"])
def test_to_gguf_killed_before_publishing(irpa_of, tmp_path, previous):
    out = tmp_path / "model.gguf"
    if previous is not None:
        out.write_bytes(previous)
    proc = _run_killed_at("model.gguf", "sharkport.tools.to_gguf",
                          "--irpa-file", str(irpa_of("gqa-untied")), "--output-gguf", str(out))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (out.read_bytes() if out.exists() else None) == previous
    assert [p for p in tmp_path.glob(".model.gguf.*")], "the child was killed with its temporary file"
