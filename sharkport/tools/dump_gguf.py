"""Show what a GGUF file holds, dump its tensors as .npy, and import it into a parameter archive.

    python -m sharkport.tools.dump_gguf --gguf-file x.gguf [--json] [--output-irpa x.irpa]
        [--tensor-regex RE] [--num-blocks N] [--output-npy-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import SharkportError, cli_main, prog
from ..fileio import atomic_output
from ..formats.gguf import GgufFile, GgufTensor, read_gguf
from ..quant import BLOCK_TYPES, check_supported
from ._cli import add_hf_dataset, hf_dataset_path, parse_args

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


_DUMP_CHUNK_BYTES = 64 << 20  # float32 output written per step, so memory stays flat


def dump_tensors(tensors: list[GgufTensor], out_dir: Path, progress: bool = False) -> dict[str, Any]:
    """Writes, per tensor, `<name>.npy` (float32 values as sharkport dequantizes them) and for a
    quantized tensor `<name>.<plane>.npy` (its packed planes, as the archive stores them), plus
    `index.json` naming each tensor's type, shape and files. Each file is written atomically,
    large tensors a chunk of rows at a time."""
    import numpy as np
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {}
    for t in tqdm(tensors, desc=f"dump to {out_dir}", unit="tensor", disable=not progress):
        files = {"values": f"{t.name}.npy"}
        rows = t.data.reshape(-1).view(np.uint8).reshape(int(np.prod(t.shape[:-1], dtype=np.int64)), -1)
        step = max(1, _DUMP_CHUNK_BYTES // (4 * t.shape[-1]))
        with atomic_output(out_dir / files["values"]) as tmp:
            values = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=t.shape)
            flat = values.reshape(rows.shape[0], t.shape[-1])
            for start in range(0, rows.shape[0], step):
                chunk = rows[start:start + step]
                flat[start:start + len(chunk)] = _float_rows(t.type_name, chunk, t.shape[-1])
            values.flush()
            del values, flat
        if t.type_name in BLOCK_TYPES:
            for plane, data in BLOCK_TYPES[t.type_name].unpack(rows, t.shape).items():
                files[plane] = f"{t.name}.{plane}.npy"
                with atomic_output(out_dir / files[plane]) as tmp:
                    with open(tmp, "wb") as f:
                        np.save(f, data)
        index[t.name] = {"type": t.type_name, "shape": list(t.shape), "files": files}
    with atomic_output(out_dir / "index.json") as tmp:
        tmp.write_text(json.dumps(index, indent=1) + "\n")
    return index


def _float_rows(type_name: str, raw_rows, n: int):
    """Raw bytes [rows, bytes per row] of one tensor → float32 [rows, n], with the same code
    the archive and the exported program use."""
    import torch

    from ..archive.tensors import QuantizedTensor, weight_from_raw

    w = weight_from_raw(type_name, (raw_rows.shape[0], n), raw_rows)
    return (w.dequant() if isinstance(w, QuantizedTensor) else w.to(torch.float32)).numpy()


def select(gg: GgufFile, tensor_regex: str | None, num_blocks: int | None) -> tuple[GgufFile, list[GgufTensor]]:
    """The file cut to --num-blocks, and its tensors matching --tensor-regex (re.search)."""
    if num_blocks is not None:
        gg = gg.first_blocks(num_blocks)
    if tensor_regex is None:
        return gg, gg.tensors
    try:
        pattern = re.compile(tensor_regex)
    except re.error as e:
        raise SharkportError(f"--tensor-regex {tensor_regex!r} is not a valid regular expression ({e})") from None
    chosen = [t for t in gg.tensors if pattern.search(t.name)]
    if not chosen:
        raise SharkportError(f"--tensor-regex {tensor_regex!r} matches no tensor of {gg.path}")
    return gg, chosen


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
        from .check import check_gguf, print_findings

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
