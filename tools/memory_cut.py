#!/usr/bin/env python
"""What a model too large to build here needs in memory to serve, from cuts of it: the model's
shapes with a few layers (tools/shaped_gguf.py, random weights), made into a llama.cpp mixture by
its quantizer, imported, exported as tools/bench.py exports, compiled, and served by
tools/peak_rss.py in a fresh process. Each layer adds the same bytes, so two cuts give what a
layer adds to the archive, the KV cache and the peak resident set (and to llama.cpp's, serving the
same GGUF), and the whole model's are the larger cut's plus that for each layer left out; printed beside the memory target (the archive's bytes x 1.1 + the
KV cache + 300 MB) and what this machine has free.

    python tools/memory_cut.py [--shape llama3-8b] [--type q4_k_m] [--layers 2,4]
                               [--work-dir artifacts/memory] [--markdown out.md]

Llama-3-8B's shapes at Q4_K_M with cuts of 2 and 4 layers write about 11 GB of files (GGUFs and
archives) and take a few minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import bench
import llamacpp_reference as llamacpp
import shaped_gguf

from sharkport.archive import Dataset, import_gguf
from sharkport.compile import compile_mlir
from sharkport.export import export_model, save_export


def measure(shape: str, type_name: str, layers: int, work: Path) -> dict[str, int]:
    """Bytes of the archive, of the KV cache bench.PAGES pages take, and the peak resident set
    serving (sharkport's and llama.cpp's), of `shape` cut to `layers` layers at `type_name`."""
    source = work / f"{shape}-{layers}l.gguf"
    if not source.is_file():
        shaped_gguf.write(shape, source, layers)
    gguf = llamacpp.quantized_gguf(source, type_name, work)
    irpa, mlir, cfg, vmfb = (work / f"{shape}-{layers}l-{type_name}.{ext}" for ext in ("irpa", "mlir", "json", "vmfb"))
    if not irpa.is_file():
        import_gguf(gguf, irpa, progress=False)
    if not vmfb.is_file():
        output, service = export_model(Dataset.load(irpa), bench.EXPORT, bench.MODEL)
        save_export(output, service, mlir, cfg)
        compile_mlir(mlir, vmfb)
    return {"archive": irpa.stat().st_size, "kv": bench.kv_cache_bytes(cfg, bench.PAGES),
            "rss": bench.peak_rss("sharkport", vmfb, irpa, cfg, "--pages", bench.PAGES),
            "llama.cpp": bench.peak_rss("llama.cpp", gguf)}


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(shaped_gguf.SHAPES), default="llama3-8b")
    parser.add_argument("--type", default="q4_k_m", help="a llama.cpp mixture or type (default q4_k_m)")
    parser.add_argument("--layers", default="2,4", help="the two cuts' layer counts (default 2,4)")
    parser.add_argument("--work-dir", type=Path, default=Path("artifacts/memory"))
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    try:
        cuts = sorted({int(n) for n in args.layers.split(",")})
    except ValueError:
        cuts = []
    full = shaped_gguf.SHAPES[args.shape][2]
    if len(cuts) != 2 or cuts[0] < 1 or cuts[1] >= full:
        parser.error(f"--layers {args.layers}: give two layer counts from 1 to {full - 1}")
    if importlib.util.find_spec("llama_cpp") is None:
        print(f"memory_cut: llama.cpp's quantizer makes the cuts' {args.type}; install it: {llamacpp.INSTALL}",
              file=sys.stderr)
        return 2
    args.work_dir.mkdir(parents=True, exist_ok=True)
    measured = {n: measure(args.shape, args.type, n, args.work_dir) for n in cuts}
    (a, small), (b, large) = measured.items()
    per_layer = {k: (large[k] - small[k]) / (b - a) for k in large}
    whole = {k: large[k] + (full - b) * per_layer[k] for k in large}
    columns = {**{f"{n} layers": m for n, m in measured.items()}, "per layer": per_layer, f"{full} layers": whole}
    target = {name: 1.1 * m["archive"] + m["kv"] + 300e6 for name, m in columns.items() if name != "per layer"}
    lines = [f"| {args.shape}, {args.type} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for key, label in (("archive", "archive, MB"), ("kv", f"KV cache ({bench.PAGES} pages), MB"),
                       ("rss", "peak RSS serving, MB"), ("llama.cpp", "llama.cpp peak RSS serving, MB")):
        lines.append(f"| {label} | " + " | ".join(f"{m[key] / 1e6:.0f}" for m in columns.values()) + " |")
    lines.append("| memory target (archive x 1.1 + KV cache + 300 MB), MB | "
                 + " | ".join(f"{target[n] / 1e6:.0f}" if n in target else "" for n in columns) + " |")
    free = available_bytes()
    lines += ["", f"{args.shape} whole ({full} layers, projected from the cuts): peak RSS "
              f"{whole['rss'] / 1e9:.2f} GB against a target of {target[f'{full} layers'] / 1e9:.2f} GB; "
              f"this machine has {free / 1e9:.1f} GB available, so it "
              f"{'fits' if whole['rss'] < free else 'would be refused before loading'}."]
    bench.emit(lines, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
