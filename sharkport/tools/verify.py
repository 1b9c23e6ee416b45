"""python -m sharkport.tools.verify: does the compiled module compute what the recipe computes
(and what transformers computes)?

    python -m sharkport.tools.verify --vmfb x.vmfb --irpa-file x.irpa --config x.json \\
        --prompt "The capital of France is" [--gguf-file x.gguf | --model-dir DIR]

Each prompt is continued greedily by the compiled module; then the whole sequence is run through
every backend with the same calls the runner makes (prefill over the prompt, one decode step per
generated token; transformers: one forward pass), and the logits that predict every position are
compared: max abs difference, top-1 agreement, and a verdict against --atol and --min-top1.
Exit status 0 when every comparison passes, 1 otherwise. The library is sharkport/verify.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import cli_main, prog
from ..verify import ATOL, verify_files
from ._cli import add_archive_source, add_module_files, add_verbose, archive_path, parse_args


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.tools.verify"),
        description="Compare a compiled module with the eager recipe (and with transformers, given "
                    "--gguf-file or --model-dir) on prompts and their greedy continuations: max abs "
                    "logits difference, top-1 agreement, pass/fail. Exit 0 if all pass, 1 if not.")
    add_module_files(parser)
    add_archive_source(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--token-ids", action="append", default=[],
                        help="a prompt as comma-separated token ids (repeatable; for archives without a tokenizer)")
    ref = parser.add_mutually_exclusive_group()
    ref.add_argument("--gguf-file", type=Path, help="also compare with transformers loading this GGUF")
    ref.add_argument("--model-dir", type=Path, metavar="DIR",
                     help="also compare with transformers loading this Hugging Face checkpoint folder")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="greedy tokens added to each prompt (default 8)")
    parser.add_argument("--atol", type=float,
                        help=f"largest allowed abs logits difference (default {ATOL['float32']:g}, or "
                             f"{ATOL['float16']:g} for a module with a float16 KV cache, the export's default: "
                             "rounding K and V to float16 moves decode's logits, SmolLM2 Q4_1's by 0.02 against "
                             "transformers over 91 positions)")
    parser.add_argument("--min-top1", type=float, default=0.99,
                        help="smallest allowed share of positions with the same top-1 token (default 0.99)")
    parser.add_argument("--device", help="IREE device (default: local-task for a CPU module, the first GPU of its kind for a GPU module)")
    add_verbose(parser)
    args = parse_args(parser, argv, {"--hf-model": "--model-dir"})
    irpa = archive_path(args)
    if not args.prompt and not args.token_ids:
        parser.error("give at least one --prompt or --token-ids")

    results, atol = verify_files(args.vmfb, irpa, args.config, args.prompt, args.token_ids, args.max_new_tokens,
                                 args.gguf_file, args.model_dir, args.atol, args.min_top1, args.device)
    print(f"\n{'comparison':<26} {'positions':>9} {'max |diff|':>12} {'top-1 agreement':>22}  verdict")
    for r in results:
        print(r.row())
    passed = all(r.passed for r in results)
    print(f"\n{'PASS' if passed else 'FAIL'} (atol {atol:g}, top-1 agreement >= {args.min_top1:.0%})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
