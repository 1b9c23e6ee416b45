#!/usr/bin/env python
"""Import throughput and peak memory of `dump_gguf --output-irpa` on big GGUF files:

    python tools/bench_import.py [--work-dir artifacts/bench_import] [--layers 22] [--types F16,Q8_0]
        [--repeat 5] [--baseline REV] [--overwrite]

Writes (once, then reuses) a random-weight llama of TinyLlama-1.1B's shape (hidden 2048, ffn 5632,
32 heads / 4 kv heads, vocab 32000, 22 layers: 1.1B parameters) as one GGUF per type, streamed
through gguf.GGUFWriter; then runs `python -m sharkport.tools.dump_gguf --gguf-file X --output-irpa Y
--quiet` in a fresh process per import and reports the issue's numbers: GB/s of GGUF imported
(the whole command's wall time, interpreter start-up included) and the process's peak RSS
(VmHWM) minus the largest tensor. With `--baseline REV` (a git revision), the sharkport of REV
runs too, interleaved with the working tree's (REV, now, REV, now, ...), for a side-by-side
before/after on the same machine state; a row "copy_file_range (ceiling)" times copying the
whole GGUF to a new file in-kernel, interleaved too. The page cache is not dropped (no root
here): the GGUF is read from memory once it has been read once; the archive is written to the
page cache and deleted after each run (the kernel writes it back to disk in the background
meanwhile), or with `--overwrite` left for the next run to replace.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 4, 32000
HEAD_DIM = HIDDEN // HEADS
REPO = Path(__file__).resolve().parents[1]


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    out = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        out |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    return out


def tensor_bytes(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """(data, raw ggml type or None) for GGUFWriter: random values, or random Q8_0 blocks with
    finite scales (written directly: quantizing 1B values in numpy would dominate the run)."""
    if len(shape) == 1 or type_name == "F32":
        return rng.uniform(0.5, 1.5, shape).astype(np.float32), None
    if type_name == "F16":
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16), None
    assert type_name == "Q8_0"
    rows, n = shape
    blocks = np.empty((rows, n // 32), dtype=[("d", "<f2"), ("qs", "i1", 32)])
    blocks["d"] = (rng.random((rows, n // 32), dtype=np.float32) * 1e-3).astype(np.float16)
    blocks["qs"] = rng.integers(-127, 128, (rows, n // 32, 32), dtype=np.int8)
    return blocks.view(np.uint8).reshape(rows, -1), gguf.GGMLQuantizationType.Q8_0


def write_model(path: Path, type_name: str, layers: int) -> None:
    rng = np.random.default_rng(0)
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(f"random-1b-{type_name.lower()}")
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    table = shapes(layers)
    for name, shape in table.items():  # tensor infos first, then the data, one tensor at a time
        t = "F32" if len(shape) == 1 else type_name
        if t == "Q8_0":
            byte_shape = (shape[0], shape[1] // 32 * 34)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                                   gguf.GGMLQuantizationType.Q8_0)
        else:
            dtype = np.dtype(np.float32 if t == "F32" else np.float16)
            writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape in table.items():
        data, _ = tensor_bytes("F32" if len(shape) == 1 else type_name, shape, rng)
        writer.write_tensor_data(data)
    writer.close()
    os.replace(tmp, path)


def measure(gguf_path: Path, irpa: Path, pythonpath: str = str(REPO), keep: bool = False) -> dict:
    """One import in a fresh process: the command's wall seconds and its peak RSS (MiB). The RSS
    is the child's VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child of this
    (big, after writing the GGUFs) process would report the parent's peak."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['dump_gguf', '--gguf-file', {str(gguf_path)!r}, '--output-irpa', {str(irpa)!r}, '--quiet']\n"
        "try:\n    runpy.run_module('sharkport.tools.dump_gguf', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))\n"
    )
    # Run in the work dir, not the checkout, so the sharkport on PYTHONPATH is the one imported.
    env = {**os.environ, "PYTHONPATH": pythonpath}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env,
                         cwd=irpa.parent).stdout
    seconds = time.perf_counter() - t0
    if not keep:
        irpa.unlink()
    return {"seconds": seconds, "peak_rss_mib": int(out.split()[-1]) / 1024}


def copy_whole(gguf_path: Path, out: Path) -> dict:
    """The ceiling: the whole GGUF copied to a new file by copy_file_range, in this process (no
    start-up, no layout), timed to the end of the copy; the copy is then deleted."""
    n = gguf_path.stat().st_size
    t0 = time.perf_counter()
    with open(gguf_path, "rb") as src, open(out, "wb") as dst:
        done = 0
        while done < n:
            done += os.copy_file_range(src.fileno(), dst.fileno(), n - done)
    seconds = time.perf_counter() - t0
    out.unlink()
    return {"seconds": seconds, "peak_rss_mib": float("nan")}


def export_revision(rev: str, into: Path) -> str:
    """The `sharkport` package of git revision `rev`, extracted under `into` (for PYTHONPATH)."""
    archive = subprocess.run(["git", "archive", rev, "sharkport"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return str(into)



def summarize(label: str, type_name: str, size: int, largest_mib: float, runs: list[dict]) -> dict:
    seconds = sorted(r["seconds"] for r in runs)[len(runs) // 2]
    peak = max(r["peak_rss_mib"] for r in runs)
    return {"code": label, "type": type_name, "gguf_gb": size / 1e9, "seconds": seconds, "gb_s": size / 1e9 / seconds,
            "all_seconds": [round(r["seconds"], 2) for r in runs], "peak_rss_mib": peak,
            "largest_tensor_mib": largest_mib, "peak_minus_largest_mib": peak - largest_mib}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("artifacts/bench_import"))
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--types", default="F16,Q8_0")
    parser.add_argument("--repeat", type=int, default=5, help="imports per file (and code); the median is reported")
    parser.add_argument("--baseline", metavar="REV", help="also time the sharkport of this git revision, interleaved")
    parser.add_argument("--overwrite", action="store_true",
                        help="keep the archive between runs, so each import replaces an existing one (on ext4 "
                             "a rename over an existing file starts the new one's writeback, and the old one is freed)")
    args = parser.parse_args()
    args.work_dir = args.work_dir.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)

    types = [t.strip().upper() for t in args.types.split(",")]
    if not set(types) <= {"F16", "Q8_0"}:
        parser.error(f"--types {args.types}: this benchmark writes F16 and Q8_0 files only")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        codes = {"now": str(REPO)}
        if args.baseline:
            codes = {args.baseline: export_revision(args.baseline, Path(tmp) / "baseline"), "now": str(REPO)}
        for type_name in types:
            path = args.work_dir / f"random-1b-{args.layers}l-{type_name.lower()}.gguf"
            if not path.exists():
                t0 = time.perf_counter()
                write_model(path, type_name, args.layers)
                print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)
            size = path.stat().st_size
            largest = max(int(np.prod(s)) for s in shapes(args.layers).values())
            largest_mib = largest * (2 if type_name == "F16" else 34 / 32) / 2**20
            out = args.work_dir / "out.irpa"
            measure(path, out, keep=args.overwrite)  # warm-up: the GGUF into the page cache
            runs: dict[str, list[dict]] = {label: [] for label in [*codes, "copy_file_range (ceiling)"]}
            for _ in range(args.repeat):
                for label, pythonpath in codes.items():
                    runs[label].append(measure(path, out, pythonpath, keep=args.overwrite))
                runs["copy_file_range (ceiling)"].append(copy_whole(path, args.work_dir / "copy.tmp"))
            out.unlink(missing_ok=True)
            for label in runs:
                rows.append(summarize(label, type_name, size, largest_mib, runs[label]))
                print(json.dumps(rows[-1]), flush=True)

    what = "over an existing archive" if args.overwrite else "to a new path"
    print(f"\nimport {what}:\n| file | code | import (median of {args.repeat}) | throughput | peak RSS | minus largest tensor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| random 1.1B llama, {r['type']} ({r['gguf_gb']:.2f} GB) | {r['code']} | {r['seconds']:.2f} s "
              f"({', '.join(map(str, r['all_seconds']))}) | {r['gb_s']:.2f} GB/s | {r['peak_rss_mib']:.0f} MiB | "
              f"{r['peak_minus_largest_mib']:.0f} MiB (largest {r['largest_tensor_mib']:.0f} MiB) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
