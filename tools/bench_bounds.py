#!/usr/bin/env python
"""What bounds decode bs1 on this machine: a step split into reading the weights and
the rest, measured side by side in one run.

    python tools/bench_bounds.py [--types q4_1,q8_0,f16] [--rounds 6] [--loads 2] [--steps 8] [--reuse]
                                 [--work-dir artifacts/bounds] [--bench-dir artifacts/bench] [--markdown out.md]

Each type's module (tools/bench.py's archive and export of SmolLM2, decode bs1 only, the export's
default float16 cache; any type the bench takes, llama.cpp's mixtures too) is built three times,
with the kernels' products computing ("full"), only reading their weights ("loads": a byte of
each line of every plane, with the kernels' prefetch), and reading nothing ("none"):
$SHARKPORT_KERNEL_PRODUCTS, matvec.c's SHARKPORT_PRODUCTS. A type's three modules decode in
interleaved rounds (--loads sessions of each, their steps pooled, each batch of steps after
tools/bench.py's warm-up) at the bench's positions, and every round also runs the bench's probe
(tools/read_bandwidth.c: a thread per CPU summing 512 MiB, the median of 10 reads) and the same
probe over the weights' bytes alone; then the next type (the sessions of all three at once would not fit in
24 GB). Then, per type:
- loads / full: what the products' arithmetic adds to reading the weights;
- none: what a step costs besides reading the weights (attention over the cache, norms, x's
  quantizing, the phases' waits, IREE's runtime, the host side);
- full - none: the time a step spends reading the weights, and the rate it reads them at;
- the step at 85% of the limit (decode bs1's target; the limit: the stored weights at the probe's
  rate), and what the rest of a step may take there when the weights are read at the plain
  read's rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench import EXPORT, MODEL, BandwidthProbe, Subject, emit, make_archive, warm_up, weight_bytes

from sharkport import kernels
from sharkport.archive import Dataset

MODES = ("full", "loads", "none")  # kernels.PRODUCTS
TARGET = 0.85  # decode bs1 at 85% of the limit


def build(irpa: Path, mode: str, stem: Path) -> None:
    """The bench's export (tools/bench.py's EXPORT and MODEL) at batch size 1 with `mode`'s kernels,
    compiled: stem.{mlir,json,vmfb} (`python -m sharkport.export` with $SHARKPORT_KERNEL_PRODUCTS set
    for it alone)."""
    assert EXPORT.matvec_kernels and MODEL.prefill_final_logits
    env = dict(os.environ, **{kernels.PRODUCTS_ENV: mode})
    subprocess.run([sys.executable, "-m", "sharkport.export", "--irpa-file", str(irpa),
                    "--output-mlir", f"{stem}.mlir", "--output-config", f"{stem}.json",
                    "--output-vmfb", f"{stem}.vmfb", "--bs-prefill", "1", "--bs-decode", "1",
                    "--block-seq-stride", str(EXPORT.block_seq_stride),
                    "--device-block-count", str(EXPORT.device_block_count), "--max-seq-len", str(EXPORT.max_seq_len),
                    "--prefill-final-logits", "--matvec-kernels"], check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="q4_1,q8_0,f16",
                        help="comma-separated, any of tools/bench.py's for SmolLM2 (default q4_1,q8_0,f16)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved measuring rounds (default 6)")
    parser.add_argument("--loads", type=int, default=2, help="sessions of each module, their steps pooled (default 2)")
    parser.add_argument("--steps", type=int, default=8, help="measured decode steps a module and round (default 8)")
    parser.add_argument("--work-dir", type=Path, default=Path("artifacts/bounds"),
                        help="where the modules are built (default artifacts/bounds)")
    parser.add_argument("--bench-dir", type=Path, default=Path("artifacts/bench"),
                        help="tools/bench.py's work dir, whose archives are used where present")
    parser.add_argument("--reuse", action="store_true", help="reuse the modules already in --work-dir")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    if not types:
        parser.error("--types: give one or more types")
    if min(args.rounds, args.loads, args.steps) < 1:
        parser.error("--rounds, --loads and --steps take a whole number of at least 1")
    if not kernels.available():
        raise SystemExit("bench_bounds: the kernels need an x86-64 machine with a C compiler ($CC or cc)")
    w = args.work_dir
    w.mkdir(parents=True, exist_ok=True)

    probe = BandwidthProbe()
    rows: dict[str, dict[str, str]] = {}

    def row(name: str, t: str, value: str) -> None:
        rows.setdefault(name, {})[t] = value

    for t in types:  # a type at a time: three modes' sessions of every type would not fit in memory
        irpa = args.bench_dir / f"smollm2-{t}.irpa"
        if not irpa.exists():
            irpa = w / f"smollm2-{t}.irpa"
            if not irpa.exists():
                make_archive("smollm2", t, irpa, args.bench_dir / "llamacpp")
        stored = weight_bytes(Dataset.load(irpa))[0]
        subjects: dict[str, list[Subject]] = {}
        for mode in MODES:
            stem = w / f"smollm2-{t}-{mode}"
            if not (args.reuse and Path(f"{stem}.vmfb").exists()):
                print(f"building {stem}.vmfb ...", file=sys.stderr, flush=True)
                build(irpa, mode, stem)
            subjects[mode] = [Subject(Path(f"{stem}.vmfb"), irpa, Path(f"{stem}.json")) for _ in range(args.loads)]
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        probes, reads = [], []
        for r in range(args.rounds):
            print(f"{t}: round {r + 1} of {args.rounds} ...", file=sys.stderr, flush=True)
            probes.append(probe())
            reads.append(probe(stored))
            for mode in MODES if r % 2 == 0 else reversed(MODES):  # the order alternating
                for s in subjects[mode]:
                    warm_up(s.decode, 1)
                    times[mode] += [s.decode(1) for _ in range(args.steps)]
        del subjects

        ms = {mode: statistics.median(times[mode]) * 1e3 for mode in MODES}
        bandwidth, plain = statistics.median(probes), statistics.median(reads)
        read_ms = ms["full"] - ms["none"]
        budget = stored / (TARGET * bandwidth) * 1e3
        row("probe (512 MiB), GB/s (median; range)", t,
            f"{bandwidth / 1e9:.1f} ({min(probes) / 1e9:.1f} to {max(probes) / 1e9:.1f})")
        row("a thread per CPU reading the weights' bytes alone, GB/s (median; range)", t,
            f"{plain / 1e9:.1f} ({min(reads) / 1e9:.1f} to {max(reads) / 1e9:.1f})")
        row("weights per token as stored, MB", t, f"{stored / 1e6:.1f}")
        row("decode bs1, products computed, ms", t, f"{ms['full']:.3f}")
        row("decode bs1, products only reading their weights, ms (/ computed)", t,
            f"{ms['loads']:.3f} ({ms['loads'] / ms['full']:.3f})")
        row("decode bs1, products reading nothing (the rest of a step), ms", t, f"{ms['none']:.3f}")
        row("reading the weights in a step (computed - nothing), ms; GB/s", t,
            f"{read_ms:.3f}; {stored / read_ms / 1e6:.1f}")
        row("decode bs1 / limit (stored weights at the probe's rate)", t, f"{100 * budget * TARGET / ms['full']:.0f}%")
        row(f"step at {TARGET:.0%} of the limit, ms", t, f"{budget:.3f}")
        row(f"the rest a step may take at {TARGET:.0%}, the weights read at the plain read's rate, ms", t,
            f"{budget - stored / plain * 1e3:.3f}")

    header = (f"SmolLM2-135M-Instruct, {os.cpu_count()} CPUs, kernels {kernels.isa()}; probe: {probe.how}, "
              f"one a round; {args.rounds} rounds of {args.steps} decode bs1 steps a module, "
              f"{args.loads} load{'s' if args.loads > 1 else ''} of each; medians")
    lines = [header, "", "| measure | " + " | ".join(t.upper() for t in types) + " |", "|---|" + "---|" * len(types)]
    lines += [f"| {name} | " + " | ".join(values.get(t, "–") for t in types) + " |" for name, values in rows.items()]
    emit(lines, args.markdown)


if __name__ == "__main__":
    main()
