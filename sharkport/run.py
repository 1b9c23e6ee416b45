"""python -m sharkport.run: generate text with a compiled module and its parameter archive.

    python -m sharkport.run --vmfb x.vmfb --irpa-file x.irpa --config x.json --prompt "..." [--prompt ...]
        [--do-sample --temperature 0.7 --top-k 50 --top-p 0.9 --seed 0] [--stream] [--chat]
"""

from __future__ import annotations

import argparse
import sys

from .errors import cli_main, prog
from .tools._cli import add_archive_source, add_module_files, add_verbose, archive_path


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    """The prompt and GenerationConfig flags shared by run and tools.generate."""
    parser.add_argument("--prompt", action="append", required=True,
                        help="a prompt; repeat for a batch (prompts may differ in length)")
    parser.add_argument("--chat", action="store_true",
                        help="format each prompt as a user message with the archive's chat template")
    g = parser.add_argument_group("generation (greedy unless --do-sample)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    g.add_argument("--do-sample", action="store_true", help="sample instead of taking the most likely token")
    g.add_argument("--temperature", type=float, default=1.0, help="with --do-sample: divide logits by this (0: greedy)")
    g.add_argument("--top-k", type=int, default=0, help="with --do-sample: keep the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="with --do-sample: keep the smallest set of likeliest tokens with probability >= p")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="with --do-sample: keep tokens at least this share as likely as the likeliest (0: off)")
    g.add_argument("--min-new-tokens", type=int, default=0,
                   help="hold off EOS and the other stop tokens until this many tokens are generated")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalize tokens already in the sequence (1.0: off; 1.1-1.3 typical)")
    g.add_argument("--seed", type=int, help="with --do-sample: make the draws repeat")
    g.add_argument("--num-return-sequences", type=int, default=1, help="samples per prompt (needs --do-sample)")
    g.add_argument("--stop", action="append", default=[], help="stop when the text contains this string (repeatable)")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument("--no-continuous-batching", action="store_true",
                   help="start new prompts only when the whole running batch has finished")
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")


def generation_options(args: argparse.Namespace) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, min_new_tokens=args.min_new_tokens,
                repetition_penalty=args.repetition_penalty,
                seed=args.seed, num_return_sequences=args.num_return_sequences, stop=tuple(args.stop))


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
    parser.add_argument("--device", help="IREE device: local-task (the default for a CPU module), local-sync, "
                                          "cuda://0, hip://0 or vulkan://0 (a GPU module's default is the first "
                                          "GPU of its kind: docs/devices.md); for a tensor-parallel module N "
                                          "local-sync devices, or give N comma-separated URIs: docs/parallel.md")
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
