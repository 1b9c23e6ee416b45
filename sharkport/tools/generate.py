"""python -m sharkport.tools.generate: the reference runner, the PyTorch recipe run eagerly.

    python -m sharkport.tools.generate --irpa-file x.irpa --prompt "..." [--max-new-tokens N]

Takes the same generation flags as `python -m sharkport.run`.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import cli_main, prog
from ..run import run_generation
from ._cli import add_generation_args, add_model_source, add_verbose, model_path


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.tools.generate"),
        description="Text generation with the eager PyTorch recipe (the reference for compiled "
                    "modules). Greedy unless --do-sample.")
    add_model_source(parser)
    parser.add_argument("--block-seq-stride", type=int, default=32,
                        help="tokens per KV cache page, as the export's flag (default 32)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences run together (default 4)")
    add_generation_args(parser)
    add_verbose(parser)
    args = parser.parse_args(argv)

    from ..api import TextGenerator

    longest = args.max_new_tokens + 1024  # room for prompts up to 1024 tokens
    stride = args.block_seq_stride
    generator = TextGenerator.eager(model_path(args), block_seq_stride=stride,
                                    batch_size=args.batch_size, max_seq_len=-(-longest // stride) * stride)
    return run_generation(generator, args)


if __name__ == "__main__":
    sys.exit(main())
