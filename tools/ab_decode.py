#!/usr/bin/env python
"""Decode step times of two or more compiled modules side by side: all are loaded in one process
and measured in interleaved rounds (the order alternating), so that a busy host slows them alike;
and that again in fresh processes (--loads, default 2), each loading the modules in the reverse
order of the one before. Prints each module's ratio to the first module's at each batch size
(default 1 and 4): the geometric mean over the loads, and their range:

    python tools/ab_decode.py A.vmfb B.vmfb [...] [--irpa x.irpa] [--rounds 10] [--steps 15] [--loads 2]
                              [--position 128]

Each module's service config is the .json beside it (as tools/bench.py writes them); its archive
is --irpa, else the .irpa beside it of its stem, or of the stem cut at its last dashes until one
exists (artifacts/bench/smollm2-q4_1-kv-f16.vmfb reads smollm2-q4_1.irpa). Decode is
tools/bench.py's (its Subject over 64 pages, with its warm-up steps before each batch's measured
ones): one position a step from 128, back to 128 past 512, so that the default 10 rounds of 15
steps reach about position 300, further than the bench's 6 rounds of 4 (attention grows with it).
--position starts there instead (a long context: up to the bench export's 2048 positions), the
cache holding 384 positions more (as from 128), back to the start past them.

Where a module's weights land as it loads moves its speed: copies of one module loaded in one
process decoded up to 11% apart, steadily over 12 rounds, which is more than many changes gain. So each load (a
process of its own) gives one ratio, and a change counts when its ratios over several loads
agree; raise --loads where they do not.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
from pathlib import Path

from bench import EXPORT, PAGES, PROMPT_LEN, STRIDE, Subject, warm_up

MAX_POSITION = EXPORT.max_seq_len
AHEAD = PAGES // 4 * STRIDE - PROMPT_LEN  # positions measured before going back to the start


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
    parser.add_argument("--loads", type=int, default=2,
                        help="fresh processes loading the modules, the order reversed each time (default 2)")
    parser.add_argument("--position", type=int, default=PROMPT_LEN,
                        help=f"the first decode position (default {PROMPT_LEN}); at most {MAX_POSITION - 1}")
    args = parser.parse_args()
    if len(args.vmfb) < 2:
        parser.error("give two or more modules")
    parts = args.batches.split(",")
    if not all(p.isdigit() and 1 <= int(p) <= 4 for p in parts):
        parser.error(f"--batches {args.batches!r}: give batch sizes from 1 to 4, comma-separated (the bench's "
                     "decode positions hold four sequences)")
    if args.rounds < 1 or args.steps < 1 or args.loads < 1:
        parser.error("--rounds, --steps and --loads take a whole number of at least 1")
    if not 1 <= args.position < MAX_POSITION:
        parser.error(f"--position {args.position}: give a position from 1 to {MAX_POSITION - 1} (the bench "
                     "export's max_seq_len)")
    batches = [int(p) for p in parts]
    modules = []
    for vmfb in args.vmfb:
        irpa = args.irpa or archive_for(vmfb)
        cfg = vmfb.with_suffix(".json")
        for f in (vmfb, irpa, cfg):
            if not f.exists():
                parser.error(f"{f} does not exist (each module needs its .json beside it and an archive)")
        modules.append((vmfb, irpa, cfg))
    n, spawn, runs = len(modules), multiprocessing.get_context("spawn"), []
    for load in range(args.loads):  # each in a process of its own: a fresh heap for its modules
        order = modules if load % 2 == 0 else modules[::-1]
        with spawn.Pool(1) as pool:
            run = pool.apply(measure, (order, batches, args.rounds, args.steps, args.position))
        runs.append(run if load % 2 == 0 else {(n - 1 - i, b): t for (i, b), t in run.items()})
    print(f"{args.loads} loads (processes), the load order reversed each time; each {args.rounds} rounds of "
          f"{args.steps} steps a module and batch, the order alternating; ms a step (the loads' medians of "
          "the rounds' medians) and the ratio to the first module (geometric mean over the loads, and range)")
    print("| module | " + " | ".join(f"bs{b}, ms" for b in batches) + " | " +
          " | ".join(f"bs{b} / first" for b in batches) + " |")
    print("|---|" + "---|" * 2 * len(batches))
    for i, (vmfb, _, _) in enumerate(modules):
        ms = [statistics.median(run[i, b] for run in runs) * 1e3 for b in batches]
        ratios = [[run[i, b] / run[0, b] for run in runs] for b in batches]
        shown = [f"{math.prod(r) ** (1 / len(r)):.3f} ({min(r):.3f} to {max(r):.3f})" if i else "1" for r in ratios]
        print(f"| {vmfb} | " + " | ".join(f"{m:.3f}" for m in ms) + " | " + " | ".join(shown) + " |")

def measure(modules, batches: list[int], rounds: int, steps: int,
            position: int = PROMPT_LEN) -> dict[tuple[int, int], float]:
    """{(module index, batch): median over the rounds of each round's median step, in seconds} of
    the modules (vmfb, irpa, json), loaded in their order in this process, measured in `rounds`
    interleaved rounds (the order alternating) of `steps` steps after the bench's warm-up, from
    decode `position` on."""
    rows = -(-min(MAX_POSITION, position + AHEAD) // STRIDE)  # pages a sequence: PAGES / 4 at PROMPT_LEN
    subjects = [Subject(*m, pages=4 * rows, start=position) for m in modules]
    times = {(i, b): [] for i in range(len(subjects)) for b in batches}
    for r in range(rounds):
        order = list(range(len(subjects)))
        if r % 2:
            order.reverse()
        for i in order:
            for b in batches:
                warm_up(subjects[i].decode, b)
                # the median of the round's steps: one value a round, so that a round the host
                # was busy in counts once
                times[i, b].append(statistics.median(subjects[i].decode(b) for _ in range(steps)))
    return {key: statistics.median(t) for key, t in times.items()}

if __name__ == "__main__":
    main()
