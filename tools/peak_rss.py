#!/usr/bin/env python
"""Peak memory of a model as it serves: this process (which imports no torch, as sharkport's
runner does not) loads it, prefills a 128-token prompt and decodes 8 steps at batch 1 and 8 at
batch 4, then prints its peak resident set (VmHWM) in bytes.

    python tools/peak_rss.py sharkport MODULE.vmfb MODEL.irpa CONFIG.json [--pages 64]
    python tools/peak_rss.py llama.cpp MODEL.gguf

tools/bench.py runs it once for each module and GGUF it measures, each in a fresh process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

PROMPT_LEN, STEPS = 128, 8


def peak_rss() -> int:
    """This process's peak resident set, bytes (Linux's VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def run_sharkport(vmfb: Path, irpa: Path, config: Path, pages: int) -> None:
    from sharkport.runtime.session import IreeSession

    s = IreeSession(vmfb, irpa, config, pages=pages)
    stride = s.config.block_seq_stride
    prompt_blocks, blocks = -(-PROMPT_LEN // stride), -(-(PROMPT_LEN + STEPS) // stride)
    if 4 * blocks > pages:
        raise SystemExit(f"--pages {pages}: four sequences of {PROMPT_LEN + STEPS} positions need {4 * blocks}")
    ids = np.arange(4 * blocks, dtype=np.int64).reshape(4, blocks)
    tokens = np.random.default_rng(0).integers(0, s.config.vocab_size, (4, prompt_blocks * stride), dtype=np.int64)
    for b in range(4):
        s.prefill(tokens[b:b + 1], np.array([PROMPT_LEN]), ids[b:b + 1, :prompt_blocks].copy())
    for batch in (1, 4):
        for pos in range(PROMPT_LEN, PROMPT_LEN + STEPS):
            p = np.full(batch, pos, np.int64)
            s.decode(tokens[:batch, :1].copy(), p + 1, p, ids[:batch].copy())


def run_llamacpp(gguf: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import llamacpp_reference

    s = llamacpp_reference.Subject(gguf)
    s.prefill()
    for batch in (1, 4):
        for _ in range(STEPS):
            s.decode(batch)
    s.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="engine", required=True)
    one = sub.add_parser("sharkport", help="a compiled module with its archive and service config")
    one.add_argument("vmfb", type=Path)
    one.add_argument("irpa", type=Path)
    one.add_argument("config", type=Path)
    one.add_argument("--pages", type=int, default=64, help="KV cache pages to allocate (default 64)")
    other = sub.add_parser("llama.cpp", help="a GGUF loaded by llama-cpp-python")
    other.add_argument("gguf", type=Path)
    args = parser.parse_args()
    if args.engine == "sharkport":
        run_sharkport(args.vmfb, args.irpa, args.config, args.pages)
    else:
        run_llamacpp(args.gguf)
    print(peak_rss())


if __name__ == "__main__":
    main()
