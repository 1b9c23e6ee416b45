#!/usr/bin/env python
"""Decode step times of two or more compiled modules side by side: all are loaded in one process
and measured in interleaved rounds (the order alternating), so that a busy host slows them alike.
Prints each module's median ms a step at each batch size (default 1 and 4), and its ratio to the
first module's:

    python tools/ab_decode.py A.vmfb B.vmfb [...] [--irpa x.irpa] [--rounds 10] [--steps 15]

Each module's service config is the .json beside it (as tools/bench.py writes them); its archive
is --irpa, else the .irpa beside it of its stem, or of the stem cut at its last dashes until one
exists (artifacts/bench/smollm2-q4_1-kv-f16.vmfb reads smollm2-q4_1.irpa). Decode is
tools/bench.py's (its Subject over 64 pages, with its warm-up steps before each batch's measured
ones): one position a step from 128, back to 128 past 512, so that the default 10 rounds of 15
steps reach about position 300, further than the bench's 6 rounds of 4 (attention grows with it).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench import Subject, warm_up


def archive_for(vmfb: Path) -> Path:
    """The .irpa beside vmfb: the same stem, or the stem cut at its last dash until one exists."""
    stem = vmfb.stem
    while True:
        candidate = vmfb.with_name(stem + ".irpa")
        if candidate.exists() or "-" not in stem:
            return candidate
        stem = stem.rsplit("-", 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vmfb", type=Path, nargs="+", help="the modules (the first is the baseline)")
    parser.add_argument("--irpa", type=Path, help="the archive of every module (default: beside each)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("--steps", type=int, default=15, help="measured decode steps a batch and round (default 15)")
    parser.add_argument("--batches", default="1,4", help="batch sizes (default 1,4)")
    args = parser.parse_args()
    if len(args.vmfb) < 2:
        parser.error("give two or more modules")
    parts = args.batches.split(",")
    if not all(p.isdigit() and 1 <= int(p) <= 4 for p in parts):
        parser.error(f"--batches {args.batches!r}: give batch sizes from 1 to 4, comma-separated (the bench's "
                     "decode positions hold four sequences)")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps take a whole number of at least 1")
    batches = [int(p) for p in parts]
    subjects = []
    for vmfb in args.vmfb:
        irpa = args.irpa or archive_for(vmfb)
        cfg = vmfb.with_suffix(".json")
        for f in (vmfb, irpa, cfg):
            if not f.exists():
                parser.error(f"{f} does not exist (each module needs its .json beside it and an archive)")
        subjects.append(Subject(vmfb, irpa, cfg))
    times = {(i, b): [] for i in range(len(subjects)) for b in batches}
    for r in range(args.rounds):
        order = list(range(len(subjects)))
        if r % 2:
            order.reverse()
        for i in order:
            for b in batches:
                warm_up(subjects[i].decode, b)
                # the median of the round's steps: one value a round, so that a round the host
                # was busy in counts once
                times[i, b].append(statistics.median(subjects[i].decode(b) for _ in range(args.steps)))
    print(f"{args.rounds} rounds of {args.steps} steps, order alternating; medians of the rounds' medians, ms a step")
    print("| module | " + " | ".join(f"bs{b}" for b in batches) + " | " +
          " | ".join(f"bs{b} / first" for b in batches) + " |")
    print("|---|" + "---|" * 2 * len(batches))
    base = {b: statistics.median(times[0, b]) for b in batches}
    for i, vmfb in enumerate(args.vmfb):
        med = {b: statistics.median(times[i, b]) for b in batches}
        print(f"| {vmfb} | " + " | ".join(f"{1e3 * med[b]:.3f}" for b in batches) + " | " +
              " | ".join(f"{med[b] / base[b]:.3f}" for b in batches) + " |")


if __name__ == "__main__":
    main()
