"""Show what a GGUF file holds, dump its tensors as .npy, and import it into a parameter archive.

    python -m sharkport.tools.dump_gguf --gguf-file x.gguf [--json] [--output-irpa x.irpa]
        [--tensor-regex RE] [--num-blocks N] [--output-npy-dir DIR]

The library is sharkport/dump_gguf.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from ..dump_gguf import dump_tensors, print_report, report, select
from ..errors import cli_main, prog
from ..formats.gguf import read_gguf
from ..quant import check_supported
from ._cli import add_hf_dataset, hf_dataset_path, parse_args


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.tools.dump_gguf"),
        description="Print a GGUF file's metadata (vocabularies summarized) and tensor table; "
                    "with --output-irpa, import it into an IREE parameter archive (.irpa).")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf-file", type=Path, help="the GGUF file to read")
    add_hf_dataset(src)
    parser.add_argument("--output-irpa", type=Path, metavar="X.irpa",
                        help="write the parameter archive here (atomically; quantized tensors stay packed)")
    parser.add_argument("--tensor-regex", metavar="RE",
                        help="only tensors whose name matches RE (Python re.search) in the report and "
                             "in --output-npy-dir; --output-irpa still writes every tensor")
    parser.add_argument("--num-blocks", type=int, metavar="N",
                        help="keep only the first N transformer blocks (tensors blk.0..blk.N-1 and the "
                             "rest) and rewrite {arch}.block_count, in the report, the dump and --output-irpa: "
                             "a small model for tests")
    parser.add_argument("--output-npy-dir", type=Path, metavar="DIR",
                        help="write each selected tensor as DIR/<name>.npy (float32, dequantized) and, "
                             "when quantized, DIR/<name>.<plane>.npy (the packed planes), with DIR/index.json")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="print no report (with --output-irpa)")
    parser.add_argument("--check", action="store_true",
                        help="check the metadata against the tensors (as sharkport.tools.check does) and "
                             "scan values and quantization scales for NaN/inf; exit 1 on any problem, "
                             "and then write nothing with --output-irpa")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    args = parse_args(parser, argv, {"--save": "--output-irpa", "--dump-tensor-dir": "--output-npy-dir"})
    args.gguf_file = args.gguf_file or hf_dataset_path(args.hf_dataset, "gguf")

    gg = read_gguf(args.gguf_file)
    for t in gg.tensors:  # before anything is written
        check_supported(t.type_name, f"{gg.path}: tensor {t.name}")
    gg, chosen = select(gg, args.tensor_regex, args.num_blocks)
    if args.check:
        from ..check import check_gguf, print_findings

        if print_findings(gg.path, *check_gguf(gg, values=True)):
            return 1
    progress = sys.stderr.isatty()
    if args.output_irpa:
        from ..formats.gguf_import import import_gguf  # no torch or IREE: starts in a fraction of a second

        t0 = time.perf_counter()
        import_gguf(gg, args.output_irpa, progress=progress)
        print(f"wrote {args.output_irpa} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.output_npy_dir:
        t0 = time.perf_counter()
        dump_tensors(chosen, args.output_npy_dir, progress=progress)
        print(f"dumped {len(chosen)} tensors to {args.output_npy_dir} in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    if not args.quiet:
        rep = report(dataclasses.replace(gg, tensors=chosen))
        print(json.dumps(rep, indent=2)) if args.json else print_report(rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
