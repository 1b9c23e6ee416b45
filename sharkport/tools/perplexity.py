"""Perplexity of a model over a text, and KL-divergence against a base model, by llama.cpp's
method (sharkport/quality.py; docs/quality.md).

    sharkport perplexity --gguf-file x.gguf --text-file wiki.txt [--ctx 512] [--chunks N]
    sharkport perplexity --vmfb x.vmfb --config x.json --irpa-file x.irpa --python-docs \\
        [--save-logits base.npz | --kl-divergence base.npz] [--json]

The library is sharkport/perplexity.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import SharkportError, cli_main, prog
from ..perplexity import open_session, perplexity, read_text, report
from ..quality import DEFAULT_TOP_K, BaseLogits
from ._cli import add_device, add_model_source, add_verbose, hf_dataset_path, model_path


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.tools.perplexity"),
        description="Perplexity of a model over a text (llama.cpp's method: chunks of --ctx tokens, each "
                    "scored on its second half), and with --kl-divergence its distance from a base model "
                    "whose distributions --save-logits wrote. Without --vmfb the model is imported, exported "
                    "and compiled once (cached, as TextGenerator.from_gguf does).")
    add_model_source(parser)
    parser.add_argument("--vmfb", type=Path, help="a compiled module of the model (default: build one, cached)")
    parser.add_argument("--config", type=Path, help="with --vmfb: the service config JSON exported with it")
    parser.add_argument("--eager", action="store_true", help="run the eager PyTorch recipe instead (the reference)")
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--text-file", type=Path, metavar="FILE", help="the text to score (UTF-8)")
    text.add_argument("--python-docs", action="store_true",
                      help="score Python's reference documentation (pydoc_data, in every Python)")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512, as llama.cpp)")
    parser.add_argument("--chunks", type=int, metavar="N", help="score only the first N chunks (default: all)")
    kl = parser.add_mutually_exclusive_group()
    kl.add_argument("--save-logits", type=Path, metavar="FILE",
                    help="save this model's distributions (top --top-k log-probabilities per position) as a base")
    kl.add_argument("--kl-divergence", type=Path, metavar="FILE",
                    help="compare with the base distributions --save-logits wrote: KLD, top-1 agreement, delta-PPL")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                        help=f"with --save-logits: log-probabilities kept per position (default {DEFAULT_TOP_K}; "
                             "0: the whole vocabulary, exact KLD, V x 8 bytes a position)")
    add_device(parser)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_verbose(parser)
    args = parser.parse_args(argv)
    if args.top_k < 0:
        parser.error("--top-k must be >= 0")

    source = read_text(args.text_file)
    base = BaseLogits.load(args.kl_divergence) if args.kl_divergence else None
    if args.vmfb is not None and args.gguf_file is not None:
        raise SharkportError("--vmfb runs over the archive it was exported from: give --irpa-file, not --gguf-file")
    path = hf_dataset_path(args.hf_dataset, "irpa") if args.vmfb and args.hf_dataset else model_path(args)
    session, archive = open_session(path, args.ctx, args.vmfb, args.config, args.eager, args.device)
    summary = perplexity(session, archive, source, args.ctx, args.chunks, base, args.kl_divergence,
                         args.save_logits, args.top_k, progress=sys.stderr.isatty())
    print(json.dumps(summary, indent=2) if args.json else report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
