#!/usr/bin/env python
"""Throughput of the matvec kernels outside IREE, with the weights in the caches and read from
memory: what bounds decode's products on this machine.

    python tools/bench_kernels.py [--types q4_1,q8_0,f16] [--model smollm2|llama3-3b] [--markdown out.md]

Builds tools/matvec_harness.c with the kernels' object, the one exports link (kernels.object_path():
AVX-512 where this machine has it), and times a model's products (SmolLM2's feed-forward gate/up
1536x576 and down 576x1536 and its smallest, the attention output 576x576; or Llama-3.2-3B's
8192x3072 and 3072x8192, whose rows are whole 256-value super-blocks for the K-quants) at 1 and 4
rows of x, on 1 and 2 threads (each product's workgroups shared among the threads as IREE's workers
share them, with a barrier after each product): once with one copy of the weights (it stays in the
caches), once with enough copies to pass the L3 (read from memory). A product that runs as fast from
memory as from the caches is bound by its arithmetic; one much faster in the caches is bound by
memory. The machine's read bandwidth (tools/read_bandwidth.c) is printed alongside, and how many of
the kernels' vector operations a core completes per ns (tools/vector_ops.c: one thread, then one per
CPU at once), the arithmetic ceiling a product bound by its arithmetic is measured against.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parent))

from sharkport.kernels import object_path  # noqa: E402

SHAPES = {"smollm2": {"gate/up 1536x576": (1536, 576), "down 576x1536": (576, 1536), "o 576x576": (576, 576)},
          "llama3-3b": {"gate/up 8192x3072": (8192, 3072), "down 3072x8192": (3072, 8192)}}
# q4_1, q8_0, q5_0, q4_k, q6_k: rows interleaved as exported modules read them; -stored: as stored
# (see the harness)
BYTES_PER_WEIGHT = {"q4_1": 20 / 32, "q8_0": 34 / 32, "q5_0": 22 / 32, "q4_k": 144 / 256, "q6_k": 210 / 256,
                    "f16": 2.0, "q4_1-stored": 20 / 32, "q8_0-stored": 34 / 32}
K_QUANTS = {"q4_k", "q6_k"}  # rows of 256 values at least
MEMORY_BYTES = 128e6  # copies of the weights that far exceed the L3


def build(work: Path) -> tuple[Path, Path]:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise SystemExit("bench_kernels: no C compiler ($CC or cc) on PATH; install gcc or clang")
    exe, ops = work / "matvec_harness", work / "vector_ops"
    obj = object_path(log=lambda line: print(line, file=sys.stderr))  # the exporter's, built once
    subprocess.run([cc, "-O2", "-pthread", str(TOOLS / "matvec_harness.c"), str(obj), "-o", str(exe)], check=True)
    subprocess.run([cc, "-O2", "-mavx2", "-mfma", "-pthread", str(TOOLS / "vector_ops.c"), "-o", str(ops)], check=True)
    return exe, ops


def vector_ops(ops: Path, threads: int) -> dict[str, float]:
    """Operations per ns of each kind on one core, the slowest of `threads` running at once."""
    out = subprocess.run([str(ops), str(threads)], check=True, capture_output=True, text=True).stdout
    return {name: float(rate) for name, rate in (line.split() for line in out.splitlines())}


def run(exe: Path, type_name: str, rows: int, n: int, k: int, copies: int, threads: int, reps: int) -> float:
    """GB/s of weights read by the product (best of the harness's 5 trials)."""
    out = subprocess.run([str(exe), type_name, str(rows), str(n), str(k), str(copies), str(threads), str(reps)],
                         check=True, capture_output=True, text=True).stdout.split()
    return float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="q4_1,q8_0,f16",
                        help=f"comma-separated, of {', '.join(BYTES_PER_WEIGHT)} (default q4_1,q8_0,f16)")
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2",
                        help="whose feed-forward shapes (default smollm2; q4_k and q6_k need llama3-3b)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    bad = [t for t in types if t not in BYTES_PER_WEIGHT]
    if bad or not types:
        parser.error(f"--types: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(BYTES_PER_WEIGHT)}")
    short = [t for t in types if t in K_QUANTS and any(k % 256 for _, k in SHAPES[args.model].values())]
    if short:
        parser.error(f"--types {','.join(short)}: {args.model}'s rows are not whole 256-value super-blocks; "
                     "add --model llama3-3b")
    from bench import emit, read_bandwidth

    bandwidth, best, probe = read_bandwidth()
    lines = [f"{os.cpu_count()} CPUs; read bandwidth {bandwidth / 1e9:.1f} GB/s ({probe}; the fastest read "
             f"{best / 1e9:.1f}, to set beside the products' best of 5 trials); GB/s of weights as stored",
             "", "| type | product | rows of x | threads | in the caches | from memory | memory / caches |",
             "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        exe, ops = build(Path(tmp))
        one, every = vector_ops(ops, 1), vector_ops(ops, os.cpu_count() or 1)
        lines[0] += ("; vector operations a core completes per ns, alone (with every CPU busy): "
                     + ", ".join(f"{name} {rate:.1f} ({every[name]:.1f})" for name, rate in one.items()))
        for t in types:
            for name, (n, k) in SHAPES[args.model].items():
                size = n * k * BYTES_PER_WEIGHT[t]
                copies = int(MEMORY_BYTES / size) + 1
                for rows in (1, 4):
                    for threads in (1, 2):
                        cached = run(exe, t, rows, n, k, 1, threads, max(20, int(2e9 / size / rows)))
                        memory = run(exe, t, rows, n, k, copies, threads, 2)
                        lines.append(f"| {t.upper()} | {name} | {rows} | {threads} | {cached:.1f} | {memory:.1f} | "
                                     f"{memory / cached:.2f} |")
                        print(lines[-1], file=sys.stderr, flush=True)  # progress
    emit(lines, args.markdown)


if __name__ == "__main__":
    main()
