"""Import a Hugging Face checkpoint folder into a parameter archive.

    python -m sharkport.tools.import_hf --model-dir DIR --output-irpa x.irpa [--dtype float16|bfloat16|float32]
    python -m sharkport.tools.import_hf --hf-dataset NAME --output-irpa x.irpa
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import cli_main, prog
from ._cli import add_hf_dataset, add_verbose, hf_dataset_path, parse_args

DTYPES = ("float32", "float16", "bfloat16")


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.tools.import_hf"),
        description="Import a Hugging Face checkpoint folder (config.json, model.safetensors or shards "
                    "listed in model.safetensors.index.json, tokenizer files) into an IREE parameter "
                    "archive, one tensor in memory at a time. Tensors are renamed to GGUF names; Q/K "
                    "keep the HF rotary layout, recorded as rope_layout 'half'.")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", type=Path, metavar="DIR", help="the checkpoint folder")
    add_hf_dataset(src)
    parser.add_argument("--output-irpa", type=Path, required=True, metavar="X.irpa",
                        help="write the parameter archive here (atomically)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="store matrices in this dtype (default: as in the checkpoint); norms and "
                             "biases are always float32")
    add_verbose(parser)
    args = parse_args(parser, argv, {"--save": "--output-irpa"})

    import torch

    from ..archive import import_hf

    model_dir = args.model_dir or hf_dataset_path(args.hf_dataset, "hf")
    t0 = time.perf_counter()
    metadata = import_hf(model_dir, args.output_irpa, getattr(torch, args.dtype) if args.dtype else None,
                         progress=sys.stderr.isatty())
    types = sorted({t["type"] for t in metadata["tensors"].values()})
    tokenizer = "with tokenizer" if metadata["tokenizer"] else "no tokenizer found"
    print(f"wrote {args.output_irpa}: {len(metadata['tensors'])} tensors ({', '.join(types)}), {tokenizer}, "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
