"""python -m sharkport.run: generate text with a compiled module and its parameter archive.

    python -m sharkport.run --vmfb x.vmfb --irpa-file x.irpa --config x.json --prompt "..." [--prompt ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import cli_main
from .tools._cli import add_verbose, encode_prompts, print_generations


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt; repeat for a batch (prompts may differ in length)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sharkport.run",
        description="Greedy text generation with a compiled module (.vmfb), its parameters (.irpa) "
                    "and the service config JSON written by `python -m sharkport.export`.")
    parser.add_argument("--vmfb", type=Path, required=True)
    parser.add_argument("--irpa-file", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True, help="the JSON written by --output-config")
    parser.add_argument("--device", default="local-task", help="IREE device (default local-task)")
    parser.add_argument("--pages", type=int, help="KV cache pages to allocate (default: the config's device_block_count)")
    add_generation_args(parser)
    add_verbose(parser)
    args = parser.parse_args(argv)

    from .archive import Dataset
    from .runtime.generate import GenerateStats, generate
    from .runtime.session import IreeSession

    tokenizer = Dataset.load(args.irpa_file).tokenizer()
    session = IreeSession(args.vmfb, args.irpa_file, args.config, pages=args.pages, device=args.device)
    prompts = encode_prompts(tokenizer, args.prompt)
    stats = GenerateStats()
    eos = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    outputs = generate(session, prompts, args.max_new_tokens, eos, stats=stats)
    print_generations(tokenizer, args.prompt, outputs, args.show_ids)
    print(stats.summary(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
