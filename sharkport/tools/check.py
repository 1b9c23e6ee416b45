"""Check a model file's integrity: its metadata against its tensors, all problems at once.

    python -m sharkport.tools.check --irpa-file x.irpa [--values]
    python -m sharkport.tools.check --gguf-file x.gguf [--values]
    python -m sharkport.tools.check --vmfb x.vmfb [--config x.json] [--irpa-file x.irpa]

Checks that the hyperparameters are present and coherent (heads divide the embedding, kv heads
divide heads, rotary dims fit the head), that every tensor the llama recipe needs is present
with the shape the hyperparameters give (llama family: llama, mistral, qwen2; the hyperparameters
alone for other architectures), that quantized tensors have whole blocks and the planes
their block type has, and (for an .irpa) that every entry has the dtype, shape and byte size its
layout says. With --values it also scans for NaN/inf values and quantization scales. A compiled
module is checked by runtime/vmfb.py (CRCs, IREE's reading in a child process). Prints one
line per problem and exits 1 if there are any (2 if the file cannot be read at all).

The library is sharkport/check.py; `dump_gguf --check` uses it too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..check import check_archive, check_gguf, print_findings
from ..errors import cli_main, prog
from ..formats.gguf import read_gguf
from ._cli import add_model_source, add_verbose, hf_dataset_path


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.tools.check"),
        description="Check that a model's metadata and tensors agree (expected tensors present, "
                    "shapes, quantized planes, entry sizes, coherent hyperparameters, a tokenizer that "
                    "builds), and that a compiled module is whole and fits its config (--vmfb). Prints "
                    "every problem, one per line; exit 1 if any, 2 if the file cannot be read.")
    add_model_source(parser, required=False)
    parser.add_argument("--values", action="store_true",
                        help="also scan values and quantization scales for NaN/inf (reads every byte)")
    parser.add_argument("--vmfb", type=Path,
                        help="a compiled module: checks every embedded file against its CRC-32, then has "
                             "IREE read it in a child process; run modules from others only after this")
    parser.add_argument("--config", type=Path, help="with --vmfb: the service config, checked against the module")
    add_verbose(parser)
    args = parser.parse_args(argv)
    if not (args.gguf_file or args.irpa_file or args.hf_dataset or args.vmfb):
        parser.error("give a model (--gguf-file, --irpa-file or --hf-dataset), a module (--vmfb), or both")
    if args.config and not args.vmfb:
        parser.error("--config is checked against a module: give --vmfb too")
    status = 0
    if args.vmfb:
        from ..runtime.vmfb import check_module

        status = print_findings(args.vmfb, *check_module(args.vmfb, args.config))
        if not (args.gguf_file or args.irpa_file or args.hf_dataset):
            return status
    if args.hf_dataset:  # its GGUF file, or the archive imported from its checkpoint
        path = hf_dataset_path(args.hf_dataset)
        args.gguf_file, args.irpa_file = (path, None) if path.is_file() else (None, hf_dataset_path(args.hf_dataset, "irpa"))
    if args.irpa_file:
        problems, notes = check_archive(args.irpa_file, values=args.values)
    else:
        problems, notes = check_gguf(read_gguf(args.gguf_file), values=args.values)
    return max(status, print_findings(args.irpa_file or args.gguf_file, problems, notes))


if __name__ == "__main__":
    sys.exit(main())
