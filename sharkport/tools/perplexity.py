"""Perplexity of a model over a text, and KL-divergence against a base model, by llama.cpp's
method (sharkport/quality.py; docs/quality.md).

    sharkport perplexity --gguf-file x.gguf --text-file wiki.txt [--ctx 512] [--chunks N]
    sharkport perplexity --vmfb x.vmfb --config x.json --irpa-file x.irpa --python-docs \\
        [--save-logits base.npz | --kl-divergence base.npz] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from ..errors import SharkportError, cli_main, prog
from ..quality import DEFAULT_TOP_K
from ._cli import add_model_source, add_verbose, hf_dataset_path, model_path


def _session(args, ctx: int):
    """The session the flags name, with pages for a whole prefill batch of chunks."""
    from ..api import TextGenerator, build_artifacts
    from ..export.abi import ExportConfig, ServiceConfig
    from ..kernels import available
    from ..runtime.session import IreeSession

    if args.vmfb is not None and args.gguf_file is not None:
        raise SharkportError("--vmfb runs over the archive it was exported from: give --irpa-file, not --gguf-file")
    path = hf_dataset_path(args.hf_dataset, "irpa") if args.vmfb and args.hf_dataset else model_path(args)
    if args.eager:
        stride, batch = 32, 4
        blocks = math.ceil(ctx / stride)
        return TextGenerator.eager(path, stride, batch, blocks * stride, pages=batch * blocks).session, path
    if args.vmfb is None:
        export = ExportConfig(bs_prefill=(1, 4), bs_decode=(1,), max_seq_len=max(2048, -(-ctx // 32) * 32),
                              matvec_kernels=available())
        args.vmfb, irpa, args.config = build_artifacts(path, export=export)
        path = irpa
    if args.config is None:
        raise SharkportError("--vmfb needs --config, the service config JSON exported with it")
    if not args.config.is_file():
        raise SharkportError(f"{args.config}: no such file; pass the JSON written by --output-config")
    config = ServiceConfig.load(args.config)
    pages = max(config.prefill_batch_sizes) * math.ceil(ctx / config.block_seq_stride)
    return IreeSession(args.vmfb, path, config, pages=pages, device=args.device), path


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
    parser.add_argument("--device", help="IREE device (default: local-task for a CPU module, the first GPU of its kind for a GPU module)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_verbose(parser)
    args = parser.parse_args(argv)
    if args.top_k < 0:
        parser.error("--top-k must be >= 0")

    from tqdm import tqdm

    from .. import quality
    from ..archive import Dataset

    if args.text_file is not None:
        try:
            source = args.text_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise SharkportError(f"{args.text_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    else:
        source = quality.reference_text()
    if not source.strip():
        raise SharkportError(f"{args.text_file}: the text is empty")
    base = quality.BaseLogits.load(args.kl_divergence) if args.kl_divergence else None
    session, archive = _session(args, args.ctx)
    tokenizer = Dataset.load(archive).tokenizer()
    if tokenizer.add_eos:
        raise SharkportError(f"{archive}: its vocabulary appends EOS to every text; perplexity, as llama.cpp's, "
                             "needs one that does not")
    ids = tokenizer.encode(source)
    chunks = quality.chunks(ids, args.ctx, tokenizer.bos_id if tokenizer.add_bos else None, args.chunks)
    vocab = session.config.vocab_size
    if base is not None:
        quality.check_base(base, chunks, vocab, args.kl_divergence)
    prefill, batch = quality.session_prefill(session, args.ctx)
    t0 = time.perf_counter()
    with tqdm(total=len(chunks), unit="chunk", desc="perplexity", disable=not sys.stderr.isatty()) as bar:
        nll, arrays = quality.evaluate(prefill, chunks, batch, base, args.top_k if args.save_logits else None,
                                       bar.update)
    result = quality.Result(len(ids), len(chunks), args.ctx, nll, arrays.get("kld"), arrays.get("same_top1"),
                            base.nll if base is not None else None, time.perf_counter() - t0)
    if args.save_logits:
        quality.save_logits(args.save_logits, chunks, nll, arrays, vocab)
    summary = result.summary()
    print(json.dumps(summary, indent=2) if args.json else _report(summary))
    return 0


def _report(s: dict) -> str:
    lines = [f"perplexity: {s['ppl']:.4f} +/- {s['ppl_error']:.4f} over {s['chunks']} chunks of {s['ctx']} tokens "
             f"({s['scored_positions']} scored positions; the text has {s['tokens']} tokens), {s['seconds']:.1f} s"]
    if "kld_mean" in s:
        lines += [f"base perplexity: {s['base_ppl']:.4f}; delta-PPL {s['delta_ppl']:+.4f} (ratio {s['ppl_ratio']:.4f})",
                  f"KL-divergence: mean {s['kld_mean']:.6f} +/- {s['kld_mean_error']:.6f}, median {s['kld_median']:.6f}, "
                  f"90% {s['kld_90']:.6f}, 99% {s['kld_99']:.6f}, max {s['kld_max']:.6f}",
                  f"same top-1 token: {100 * s['same_top1']:.2f}%"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
