"""Pieces shared by the command-line tools: model-source flags and result printing."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import SharkportError


def add_model_source(parser: argparse.ArgumentParser, required: bool = True) -> None:
    src = parser.add_mutually_exclusive_group(required=required)
    src.add_argument("--gguf-file", type=Path, help="a GGUF model file (converted in memory)")
    src.add_argument("--irpa-file", type=Path, help="a parameter archive made by dump_gguf --save")


def add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")


def load_dataset(args: argparse.Namespace):
    from ..archive import Dataset  # torch loads only once the arguments are known to be good

    return Dataset.load(args.gguf_file or args.irpa_file)


def batch_sizes(text: str) -> tuple[int, ...]:
    """argparse type for '1,4' → (1, 4); '' → ()."""
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4, got {text!r}")
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    ids = [tokenizer.encode(p) for p in prompts]
    for p, i in zip(prompts, ids):
        if not i:
            raise SharkportError(f"prompt {p!r} encodes to no tokens; give a non-empty prompt")
    return ids


def print_generations(tokenizer, prompts: list[str], outputs: list[list[int]], show_ids: bool) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        print(f"--- prompt {i}: {prompt!r}")
        if show_ids:
            print(f"tokens: {out}")
        print(prompt + tokenizer.decode(out))
