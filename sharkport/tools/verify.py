"""python -m sharkport.tools.verify: does the compiled module compute what the recipe computes
(and what transformers computes)?

    python -m sharkport.tools.verify --vmfb x.vmfb --irpa-file x.irpa --config x.json \\
        --prompt "The capital of France is" [--gguf-file x.gguf | --model-dir DIR]

Each prompt is continued greedily by the compiled module; then the whole sequence is run through
every backend with the same calls the runner makes (prefill over the prompt, one decode step per
generated token; transformers: one forward pass), and the logits that predict every position are
compared: max abs difference, top-1 agreement, and a verdict against --atol and --min-top1.
Exit status 0 when every comparison passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SharkportError, cli_main, prog
from ._cli import add_archive_source, add_module_files, add_verbose, archive_path, parse_args


# --atol's default by the module's KV cache type: a float16 cache rounds K and V, which moves
# decode's logits (SmolLM2 Q4_1 without kernels, 2 prompts and 40 new tokens each: 0.020 against
# transformers, 0.014 against the eager recipe with its own float16 cache; float32: below 1e-4)
ATOL = {"float32": 1e-2, "float16": 5e-2}


@dataclass(frozen=True)
class Comparison:
    name: str
    positions: int
    max_abs_diff: float
    top1_agree: int
    passed: bool

    def row(self) -> str:
        share = self.top1_agree / max(self.positions, 1)
        return (f"{self.name:<26} {self.positions:>9} {self.max_abs_diff:>12.3g} "
                f"{self.top1_agree:>6}/{self.positions:<6} ({share:6.1%})  {'PASS' if self.passed else 'FAIL'}")


def teacher_forced_logits(session, ids: list[int], prompt_len: int) -> np.ndarray:
    """Logits [len(ids) - 1, V] predicting positions 1.. of `ids`: a prefill over the first
    `prompt_len` ids, then a decode step for each later id but the last, at batch size 1 (or the
    smallest exported, padded with rows on a scratch page). For a module exported with
    --prefill-final-logits (whose prefill returns one position) the prompt is one id and the rest
    is decoded, so every position is still checked. The session's cache needs
    ceil(len(ids) / stride) + 1 pages."""
    from ..runtime.generate import _pick

    c = session.config
    stride = c.block_seq_stride
    scratch, pages = 0, list(range(1, math.ceil(len(ids) / stride) + 1))
    if pages[-1] >= session.pages:
        raise SharkportError(f"{len(ids)} tokens need {len(pages) + 1} cache pages; the session has {session.pages}")
    bs = _pick(c.prefill_batch_sizes, 1, "prefill")
    blocks = math.ceil(prompt_len / stride)
    tokens = np.zeros((bs, blocks * stride), np.int64)
    tokens[0, :prompt_len] = ids[:prompt_len]
    lens = np.ones(bs, np.int64)
    lens[0] = prompt_len
    table = np.full((bs, blocks), scratch, np.int64)
    table[0] = pages[:blocks]
    prefill = session.prefill(tokens, lens, table)
    if prefill.shape[1] == 1 and prompt_len > 1:  # final logits only: prefill one id instead
        return teacher_forced_logits(session, ids, 1)
    rows = [prefill[0, :prompt_len]]
    bs = _pick(c.decode_batch_sizes, 1, "decode")
    for pos in range(prompt_len, len(ids) - 1):
        blocks = pos // stride + 1
        tokens = np.zeros((bs, 1), np.int64)
        tokens[0, 0] = ids[pos]
        positions = np.zeros(bs, np.int64)
        positions[0] = pos
        table = np.full((bs, blocks), scratch, np.int64)
        table[0] = pages[:blocks]
        rows.append(session.decode(tokens, positions + 1, positions, table)[0])
    return np.concatenate(rows).astype(np.float32)


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids], dtype=torch.int64)).logits[0, :-1].float().numpy()


def compare(name: str, got: list[np.ndarray], want: list[np.ndarray], atol: float, min_top1: float) -> Comparison:
    diff = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
    agree = sum(int((g.argmax(-1) == w.argmax(-1)).sum()) for g, w in zip(got, want))
    positions = sum(len(g) for g in got)
    return Comparison(name, positions, diff, agree, diff <= atol and agree >= min_top1 * positions)


def verify(compiled, eager, prompts: list[list[int]], max_new_tokens: int, hf_model=None,
           atol: float = 1e-2, min_top1: float = 0.99, log=print) -> list[Comparison]:
    """Compares the sessions (and a transformers model) on each prompt plus its compiled greedy
    continuation. Returns one Comparison per pair of backends."""
    from ..runtime.generate import GenerationRun
    from ..runtime.sampling import GenerationConfig

    run = GenerationRun(compiled, prompts, GenerationConfig(max_new_tokens=max_new_tokens))
    sequences = [p + g[0].token_ids for p, g in zip(prompts, run.results())]
    logits: dict[str, list[np.ndarray]] = {"compiled": [], "eager": [], "transformers": []}
    for i, (prompt, ids) in enumerate(zip(prompts, sequences)):
        log(f"prompt {i}: {len(prompt)} tokens + {len(ids) - len(prompt)} generated by the compiled module")
        logits["compiled"].append(teacher_forced_logits(compiled, ids, len(prompt)))
        logits["eager"].append(teacher_forced_logits(eager, ids, len(prompt)))
        if hf_model is not None:
            logits["transformers"].append(hf_logits(hf_model, ids))
    pairs = [("compiled", "eager")]
    if hf_model is not None:
        pairs += [("compiled", "transformers"), ("eager", "transformers")]
    return [compare(f"{a} vs {b}", logits[a], logits[b], atol, min_top1) for a, b in pairs]


def _load_transformers(args):
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise SharkportError("--gguf-file/--model-dir need transformers: pip install transformers") from None
    if args.gguf_file:
        if not args.gguf_file.is_file():
            raise SharkportError(f"{args.gguf_file}: no such file")
        model = AutoModelForCausalLM.from_pretrained(args.gguf_file.parent, gguf_file=args.gguf_file.name,
                                                     dtype=torch.float32)
    else:
        if not (args.model_dir / "config.json").is_file():
            raise SharkportError(f"{args.model_dir}: no config.json; give a save_pretrained directory")
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    return model.eval()


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
    args.irpa_file = archive_path(args)
    if not args.prompt and not args.token_ids:
        parser.error("give at least one --prompt or --token-ids")

    import torch

    from ..api import encode_prompt
    from ..archive import Dataset
    from ..export.abi import ServiceConfig
    from ..models import ModelConfig, build_model
    from ..runtime.session import EagerSession, IreeSession

    if not args.config.is_file():
        raise SharkportError(f"{args.config}: no such file; pass the JSON written by --output-config")
    config = ServiceConfig.load(args.config)
    atol = args.atol if args.atol is not None else ATOL.get(config.kv_cache_dtype, ATOL["float32"])
    dataset = Dataset.load(args.irpa_file)
    prompts = []
    for text in args.token_ids:
        try:
            prompts.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise SharkportError(f"--token-ids takes comma-separated integers, got {text!r}") from None
    if args.prompt:
        tokenizer = dataset.tokenizer()
        prompts += [encode_prompt(tokenizer, p) for p in args.prompt]
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    pages = max(math.ceil(longest / config.block_seq_stride) + 1, 2)
    compiled = IreeSession(args.vmfb, args.irpa_file, config, pages=pages, device=args.device)
    model = build_model(dataset, ModelConfig(block_seq_stride=config.block_seq_stride,
                                             kv_cache_dtype=getattr(torch, config.kv_cache_dtype)))
    eager = EagerSession(model, config, pages=pages)
    hf_model = _load_transformers(args) if args.gguf_file or args.model_dir else None

    results = verify(compiled, eager, prompts, args.max_new_tokens, hf_model, atol, args.min_top1)
    print(f"\n{'comparison':<26} {'positions':>9} {'max |diff|':>12} {'top-1 agreement':>22}  verdict")
    for r in results:
        print(r.row())
    passed = all(r.passed for r in results)
    print(f"\n{'PASS' if passed else 'FAIL'} (atol {atol:g}, top-1 agreement >= {args.min_top1:.0%})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
