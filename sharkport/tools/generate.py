"""python -m sharkport.tools.generate: the reference runner, the PyTorch recipe run eagerly.

    python -m sharkport.tools.generate --irpa-file x.irpa --prompt "..." [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import sys

from ..errors import cli_main
from ..run import add_generation_args
from ._cli import add_model_source, add_verbose, encode_prompts, load_dataset, print_generations


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sharkport.tools.generate",
        description="Greedy generation with the eager PyTorch recipe (the reference for compiled modules).")
    add_model_source(parser)
    parser.add_argument("--block-seq-stride", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences decoded together (default 4)")
    add_generation_args(parser)
    add_verbose(parser)
    args = parser.parse_args(argv)

    from ..export import service_config
    from ..export.abi import ExportConfig
    from ..models import ModelConfig, build_model
    from ..runtime.generate import GenerateStats, generate
    from ..runtime.session import EagerSession

    dataset = load_dataset(args)
    tokenizer = dataset.tokenizer()
    model = build_model(dataset, ModelConfig(block_seq_stride=args.block_seq_stride))
    prompts = encode_prompts(tokenizer, args.prompt)
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    stride = args.block_seq_stride
    max_seq_len = -(-max(longest, model.context_length) // stride) * stride
    pages = len(prompts) * (-(-longest // stride)) + args.batch_size * (-(-longest // stride))
    config = ExportConfig(bs_prefill=(args.batch_size,), bs_decode=(args.batch_size,),
                          block_seq_stride=stride, device_block_count=pages, max_seq_len=max_seq_len)
    session = EagerSession(model, service_config(model, config))
    stats = GenerateStats()
    eos = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    outputs = generate(session, prompts, args.max_new_tokens, eos, stats=stats)
    print_generations(tokenizer, args.prompt, outputs, show_ids=True)
    print(stats.summary(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
