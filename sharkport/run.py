"""python -m sharkport.run: generate text with a compiled module and its parameter archive.

    python -m sharkport.run --vmfb x.vmfb --irpa-file x.irpa --config x.json --prompt "..." [--prompt ...]
        [--do-sample --temperature 0.7 --top-k 50 --top-p 0.9 --seed 0] [--stream] [--chat]
"""

from __future__ import annotations

import argparse
import sys

from .errors import cli_main, prog
from .tools._cli import (add_archive_source, add_device, add_generation_args, add_module_files, add_verbose,
                         archive_path, generation_options)


def run_generation(generator, args: argparse.Namespace) -> int:
    """Generates for the parsed flags and prints the text (streamed or at the end), then the
    timing summary on stderr."""
    options = generation_options(args)
    continuous = not args.no_continuous_batching
    if args.stream:
        _print_stream(generator.generate(args.prompt, stream=True, chat=args.chat,
                                         continuous_batching=continuous, **options), args)
    else:
        outputs = generator.generate(args.prompt, chat=args.chat, continuous_batching=continuous, **options)
        for i, out in enumerate(outputs):
            for j, g in enumerate(out.generations):
                tag = f" sample {j}" if len(out.generations) > 1 else ""
                print(f"--- prompt {i}{tag}: {out.prompt!r} (finish: {g.finish_reason})")
                if args.show_ids:
                    print(f"tokens: {g.token_ids}")
                print(g.text if args.chat else out.prompt + g.text)
    print(generator.stats.summary(), file=sys.stderr)
    return 0


def _print_stream(events, args) -> None:
    single = len(args.prompt) == 1 and args.num_return_sequences == 1
    current = None
    for ev in events:
        key = (ev.prompt_index, ev.sequence_index)
        if not single and key != current:
            print(f"\n[{ev.prompt_index}.{ev.sequence_index}] ", end="")
        elif single and current is None and not args.chat:
            print(args.prompt[0], end="")
        current = key
        print(ev.text + (f" <{ev.token_id}>" if args.show_ids else ""), end="", flush=True)
        if single and ev.finish_reason:
            print(f"\n--- finish: {ev.finish_reason}")
    if not single:
        print()


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.run"),
        description="Text generation with a compiled module (.vmfb), its parameters (.irpa) and the "
                    "service config JSON written by `python -m sharkport.export`. Greedy unless "
                    "--do-sample; prompts of any length are batched over the exported batch sizes.")
    add_module_files(parser)
    add_archive_source(parser)
    add_device(parser)
    parser.add_argument("--pages", type=int, help="KV cache pages to allocate (default: the config's device_block_count)")
    add_generation_args(parser)
    add_verbose(parser)
    args = parser.parse_args(argv)
    args.irpa_file = archive_path(args)

    from .api import TextGenerator

    generator = TextGenerator.from_files(args.vmfb, args.irpa_file, args.config, pages=args.pages,
                                         device=args.device)
    return run_generation(generator, args)


if __name__ == "__main__":
    sys.exit(main())
