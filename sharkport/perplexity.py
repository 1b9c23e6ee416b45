"""Perplexity of a model file over a text, and KL-divergence against a base model: opens the
session the files name (compiling the model once, cached, when no module is given) and scores
the text by sharkport/quality.py's method (`python -m sharkport.tools.perplexity`)."""

from __future__ import annotations

import math
import time
from pathlib import Path

from . import quality
from .errors import SharkportError


def read_text(text_file: Path | None) -> str:
    """The text of `text_file` (UTF-8), or Python's reference documentation without one."""
    if text_file is not None:
        try:
            source = text_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise SharkportError(f"{text_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    else:
        source = quality.reference_text()
    if not source.strip():
        raise SharkportError(f"{text_file}: the text is empty")
    return source


def open_session(path: Path, ctx: int, vmfb: Path | None = None, config: Path | None = None, eager: bool = False,
                 device: str | None = None):
    """(session, archive): the eager recipe of the model at `path`, the module `vmfb` over the
    archive `path`, or without either a module built from `path` (cached, as
    TextGenerator.from_gguf builds one), with pages for a whole prefill batch of chunks."""
    from .api import TextGenerator, build_artifacts
    from .export.abi import ExportConfig, ServiceConfig
    from .kernels import available
    from .runtime.session import IreeSession

    if eager:
        stride, batch = 32, 4
        blocks = math.ceil(ctx / stride)
        return TextGenerator.eager(path, stride, batch, blocks * stride, pages=batch * blocks).session, path
    if vmfb is None:
        export = ExportConfig(bs_prefill=(1, 4), bs_decode=(1,), max_seq_len=max(2048, -(-ctx // 32) * 32),
                              matvec_kernels=available())
        vmfb, path, config = build_artifacts(path, export=export)
    if config is None:
        raise SharkportError("--vmfb needs --config, the service config JSON exported with it")
    if not config.is_file():
        raise SharkportError(f"{config}: no such file; pass the JSON written by --output-config")
    service = ServiceConfig.load(config)
    pages = max(service.prefill_batch_sizes) * math.ceil(ctx / service.block_seq_stride)
    return IreeSession(vmfb, path, service, pages=pages, device=device), path


def perplexity(session, archive: Path, source: str, ctx: int, max_chunks: int | None = None,
               base: quality.BaseLogits | None = None, base_path: Path | None = None, save_logits: Path | None = None,
               top_k: int = quality.DEFAULT_TOP_K, progress: bool = False) -> dict:
    """quality.Result.summary() of `session` over `source` in chunks of `ctx` tokens, with
    KL-divergence against `base` (read from `base_path`); with `save_logits`, this model's
    distributions (top_k log-probabilities per position) saved there as a base."""
    from tqdm import tqdm

    from .archive import Dataset

    tokenizer = Dataset.load(archive).tokenizer()
    if tokenizer.add_eos:
        raise SharkportError(f"{archive}: its vocabulary appends EOS to every text; perplexity, as llama.cpp's, "
                             "needs one that does not")
    ids = tokenizer.encode(source)
    chunks = quality.chunks(ids, ctx, tokenizer.bos_id if tokenizer.add_bos else None, max_chunks)
    vocab = session.config.vocab_size
    if base is not None:
        quality.check_base(base, chunks, vocab, base_path)
    prefill, batch = quality.session_prefill(session, ctx)
    t0 = time.perf_counter()
    with tqdm(total=len(chunks), unit="chunk", desc="perplexity", disable=not progress) as bar:
        nll, arrays = quality.evaluate(prefill, chunks, batch, base, top_k if save_logits else None, bar.update)
    result = quality.Result(len(ids), len(chunks), ctx, nll, arrays.get("kld"), arrays.get("same_top1"),
                            base.nll if base is not None else None, time.perf_counter() - t0)
    if save_logits:
        quality.save_logits(save_logits, chunks, nll, arrays, vocab)
    return result.summary()


def report(s: dict) -> str:
    """perplexity()'s summary as text."""
    lines = [f"perplexity: {s['ppl']:.4f} +/- {s['ppl_error']:.4f} over {s['chunks']} chunks of {s['ctx']} tokens "
             f"({s['scored_positions']} scored positions; the text has {s['tokens']} tokens), {s['seconds']:.1f} s"]
    if "kld_mean" in s:
        lines += [f"base perplexity: {s['base_ppl']:.4f}; delta-PPL {s['delta_ppl']:+.4f} (ratio {s['ppl_ratio']:.4f})",
                  f"KL-divergence: mean {s['kld_mean']:.6f} +/- {s['kld_mean_error']:.6f}, median {s['kld_median']:.6f}, "
                  f"90% {s['kld_90']:.6f}, 99% {s['kld_99']:.6f}, max {s['kld_max']:.6f}",
                  f"same top-1 token: {100 * s['same_top1']:.2f}%"]
    return "\n".join(lines)
