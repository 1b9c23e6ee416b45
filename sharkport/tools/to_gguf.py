"""Write a model as a GGUF file, for llama.cpp and every other GGUF reader.

    python -m sharkport.tools.to_gguf --irpa-file x.irpa --output-gguf x.gguf
    python -m sharkport.tools.to_gguf --model-dir DIR --output-gguf x.gguf     (an HF checkpoint folder)

Tensors are written as they are stored (F32, F16, BF16 or packed ggml blocks), under their
GGUF names; Q/K rows of weights in the HF ("half") rotary layout are permuted into llama.cpp's
interleaved order, as its converter does. The hyperparameters go under the standard `llama.*`
keys, the tokenizer under its `tokenizer.*` keys. One tensor is in memory at a time. The library
is sharkport/formats/gguf_write.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import cli_main, prog
from ..formats.gguf_write import write_gguf
from ._cli import add_hf_dataset, add_verbose, hf_dataset_path, parse_args


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.tools.to_gguf"),
        description="Write a parameter archive or a Hugging Face checkpoint folder as a GGUF file "
                    "(llama family; quantized tensors stay packed, HF Q/K rows are permuted to "
                    "llama.cpp's order).")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--irpa-file", type=Path, help="a parameter archive (from `sharkport import`)")
    src.add_argument("--model-dir", type=Path, metavar="DIR", help="a Hugging Face checkpoint folder")
    add_hf_dataset(src)
    parser.add_argument("--output-gguf", type=Path, required=True, metavar="X.gguf",
                        help="the GGUF file to write (atomically)")
    add_verbose(parser)
    args = parse_args(parser, argv, {"--output": "--output-gguf"})

    from ..archive import Dataset

    source = args.irpa_file or args.model_dir or hf_dataset_path(args.hf_dataset, "hf")
    t0 = time.perf_counter()
    write_gguf(Dataset.load(source), args.output_gguf, progress=sys.stderr.isatty())
    print(f"wrote {args.output_gguf} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
