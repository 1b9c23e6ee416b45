"""python -m sharkport.tools.verify: does the compiled module compute what the recipe computes
(and what transformers computes)?

    python -m sharkport.tools.verify --vmfb x.vmfb --irpa-file x.irpa --config x.json \\
        --prompt "The capital of France is" [--gguf-file x.gguf | --model-dir DIR]

Each prompt is continued greedily by the compiled module; then the whole sequence is run through
every backend with the same calls the runner makes (prefill over the prompt, one decode step per
generated token; transformers: one forward pass), and the logits that predict every position are
compared: max abs difference (also in standard deviations of the reference's logits), top-1
agreement, and a verdict: against --atol for a module without the kernels, against --sigmas for
one with them (8-bit activations; docs/verify.md).
Exit status 0 when every comparison passes, 1 otherwise. The library is sharkport/verify.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import cli_main, prog
from ..verify import ATOL, DECISIVE, HEADER, SIGMAS, verify_files
from ._cli import add_archive_source, add_device, add_module_files, add_verbose, archive_path, parse_args


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
    bound = parser.add_mutually_exclusive_group()
    bound.add_argument("--atol", type=float,
                       help=f"largest allowed abs logits difference, top-1 counted at every position (default for "
                            f"a module without the kernels: {ATOL['float32']:g}, or {ATOL['float16']:g} with a "
                            "float16 KV cache, the export's default: rounding K and V to float16 moves decode's "
                            "logits, SmolLM2 Q4_1's by 0.02 against transformers over 91 positions)")
    bound.add_argument("--sigmas", type=float,
                       help=f"largest allowed abs logits difference in standard deviations of the reference's "
                            f"logits at that position, top-1 counted where the reference's top two are at least "
                            f"{DECISIVE:g} of them apart (default {SIGMAS:g} for a module with the x86-64 kernels: "
                            "8-bit activations move a real model's logits by up to about 0.9 of them)")
    parser.add_argument("--min-top1", type=float, default=0.99,
                        help="smallest allowed share of the positions counted with the same top-1 token (default 0.99)")
    add_device(parser)
    add_verbose(parser)
    args = parse_args(parser, argv, {"--hf-model": "--model-dir"})
    irpa = archive_path(args)
    if not args.prompt and not args.token_ids:
        parser.error("give at least one --prompt or --token-ids")

    results, tol = verify_files(args.vmfb, irpa, args.config, args.prompt, args.token_ids, args.max_new_tokens,
                                args.gguf_file, args.model_dir, args.atol, args.sigmas, args.min_top1, args.device)
    print(f"\n{HEADER}")
    for r in results:
        print(r.row())
    passed = all(r.passed for r in results)
    print(f"\n{'PASS' if passed else 'FAIL'} ({tol})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
