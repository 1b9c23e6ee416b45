"""Show what a GGUF file holds, and optionally import it into a parameter archive.

    python -m sharkport.tools.dump_gguf --gguf-file x.gguf [--json] [--save x.irpa]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import cli_main
from ..formats.gguf import GgufFile, read_gguf
from ..quant import check_supported
from ._cli import add_hf_dataset, hf_dataset_path

_ARRAY_HEAD = 3
_TEXT_HEAD = 60


def summarize(value: Any) -> Any:
    """Long arrays and texts (tokenizer vocabularies, chat templates) cut to a readable head."""
    if isinstance(value, list) and len(value) > 8:
        kind = type(value[0]).__name__ if value else "?"
        return {"array_of": kind, "length": len(value), "head": value[:_ARRAY_HEAD]}
    if isinstance(value, str) and len(value) > 2 * _TEXT_HEAD:
        return {"text_length": len(value), "head": value[:_TEXT_HEAD]}
    return value


def report(gg: GgufFile) -> dict[str, Any]:
    return {
        "file": str(gg.path),
        "metadata": {k: summarize(v) for k, v in gg.metadata.items()},
        "tensors": [
            {"name": t.name, "type": t.type_name, "shape": list(t.shape), "bytes": t.n_bytes}
            for t in gg.tensors
        ],
    }


def _text(value: Any) -> str:
    if isinstance(value, dict) and "array_of" in value:
        return f"[{value['length']} x {value['array_of']}] {value['head']} ..."
    if isinstance(value, dict) and "text_length" in value:
        return f"{value['head']!r} ... ({value['text_length']} chars)"
    return repr(value) if isinstance(value, str) else str(value)


def print_report(rep: dict[str, Any]) -> None:
    print(f"file: {rep['file']}")
    print(f"metadata ({len(rep['metadata'])} keys):")
    width = max((len(k) for k in rep["metadata"]), default=0)
    for k, v in rep["metadata"].items():
        print(f"  {k:<{width}}  {_text(v)}")
    tensors = rep["tensors"]
    total = sum(t["bytes"] for t in tensors)
    print(f"tensors ({len(tensors)}, {total / 2**20:.1f} MiB):")
    name_w = max((len(t["name"]) for t in tensors), default=4)
    print(f"  {'name':<{name_w}}  {'type':<5}  {'shape':<16}  bytes")
    for t in tensors:
        shape = "x".join(map(str, t["shape"]))
        print(f"  {t['name']:<{name_w}}  {t['type']:<5}  {shape:<16}  {t['bytes']}")


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sharkport.tools.dump_gguf",
        description="Print a GGUF file's metadata (vocabularies summarized) and tensor table; "
                    "with --save, import it into an IREE parameter archive (.irpa).")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf-file", type=Path, help="the GGUF file to read")
    add_hf_dataset(src)
    parser.add_argument("--save", type=Path, metavar="X.irpa",
                        help="write the parameter archive here (atomically; quantized tensors stay packed)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="print no report (with --save)")
    parser.add_argument("--check", action="store_true",
                        help="check the metadata against the tensors (as sharkport.tools.check does) and "
                             "scan values and quantization scales for NaN/inf; exit 1 on any problem, "
                             "and then write nothing with --save")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    args = parser.parse_args(argv)
    args.gguf_file = args.gguf_file or hf_dataset_path(args.hf_dataset, "gguf")

    gg = read_gguf(args.gguf_file)
    for t in gg.tensors:  # before anything is written
        check_supported(t.type_name, f"{gg.path}: tensor {t.name}")
    if args.check:
        from .check import check_gguf, print_findings

        if print_findings(gg.path, *check_gguf(gg, values=True)):
            return 1
    if args.save:
        from ..archive import import_gguf  # torch and IREE load only when needed

        t0 = time.perf_counter()
        import_gguf(args.gguf_file, args.save, progress=sys.stderr.isatty())
        print(f"wrote {args.save} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if not args.quiet:
        rep = report(gg)
        print(json.dumps(rep, indent=2)) if args.json else print_report(rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
