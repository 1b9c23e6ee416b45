#!/usr/bin/env python
"""Export time alone, with the configuration tools/bench.py times (prefill and decode at batch
sizes 1 and 4, stride 32, final-logits prefill, matvec kernels), optionally under cProfile:

    python tools/bench_export.py [--irpa model.irpa] [--repeat 3] [--profile out.prof]
        [--bs-prefill 1,4] [--bs-decode 1,4] [--mlir out.mlir] [--no-matvec-kernels]

Without --irpa it imports the packaged SmolLM2-135M Q4_1 GGUF into a temporary .irpa first
(not timed). Prints one line per run: seconds and torch ops in the module. A 4-layer cut for
fast iteration: `python -m sharkport.tools.dump_gguf --gguf-file <gguf> --num-blocks 4
--output-irpa cut4.irpa`.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch

from sharkport.archive import Dataset, import_gguf
from sharkport.export import ExportConfig, export_model
from sharkport.models import ModelConfig
from sharkport.packaged import packaged_gguf


def sizes(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s)


def export_once(irpa: Path, config: ExportConfig, mlir: Path | None) -> tuple[float, int]:
    """Seconds to load the archive and export it; and the count of torch ops in the module."""
    t0 = time.perf_counter()
    output, _ = export_model(Dataset.load(irpa), config,
                             ModelConfig(block_seq_stride=config.block_seq_stride, prefill_final_logits=True))
    text = str(output.mlir_module)
    seconds = time.perf_counter() - t0
    if mlir:
        mlir.write_text(text)
    return seconds, text.count("torch.aten.")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--irpa", type=Path, help="default: the packaged SmolLM2-135M Q4_1, imported")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--profile", type=Path, help="write a cProfile of the first run here")
    ap.add_argument("--bs-prefill", type=sizes, default=(1, 4))
    ap.add_argument("--bs-decode", type=sizes, default=(1, 4))
    ap.add_argument("--mlir", type=Path, help="save the last run's MLIR here")
    ap.add_argument("--no-matvec-kernels", action="store_true", help="export without --matvec-kernels")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    config = ExportConfig(bs_prefill=args.bs_prefill, bs_decode=args.bs_decode, block_seq_stride=32,
                          device_block_count=64, max_seq_len=2048,
                          matvec_kernels=not args.no_matvec_kernels)
    with tempfile.TemporaryDirectory() as tmp:
        irpa = args.irpa
        if irpa is None:
            irpa = Path(tmp) / "smollm2.irpa"
            import_gguf(packaged_gguf("smollm2"), irpa, progress=False)
        for i in range(args.repeat):
            profiler = cProfile.Profile() if args.profile and i == 0 else None
            if profiler:
                profiler.enable()
            seconds, ops = export_once(irpa, config, args.mlir)
            if profiler:
                profiler.disable()
                profiler.dump_stats(args.profile)
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
            print(f"export {irpa.name} prefill {list(config.bs_prefill)} decode {list(config.bs_decode)}: "
                  f"{seconds:.1f} s, {ops} torch ops", flush=True)


if __name__ == "__main__":
    main()
