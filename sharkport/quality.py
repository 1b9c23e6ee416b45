"""How good a ported model is: perplexity over a text, and KL-divergence against a base model's
saved distributions, by llama.cpp's method (`llama-perplexity`, `--kl-divergence`).

The text is tokenized once (with BOS where the vocabulary adds it) and cut into chunks of `ctx`
tokens (the first of each replaced by BOS); each chunk is one prefill, and its positions
ctx/2 .. ctx-2 are scored: the negative log-probability of the next token. Perplexity is
exp(mean), with llama.cpp's standard error. Chunks go through the module's largest exported
prefill batch size at once.

`save_logits` keeps, per scored position, the base model's `top_k` largest log-probabilities
and their ids (float32); `kl_divergence` reads them back against another model's full
distribution: KL(base || model) over those ids, with the rest of the vocabulary as one more
outcome (exact when top_k covers the vocabulary, else a lower bound that loses the tail's
shape only).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .errors import SharkportError

LOGITS_FORMAT = "sharkport-logits-1"
DEFAULT_TOP_K = 64


def reference_text() -> str:
    """Python's reference documentation as one text (the `pydoc_data.topics` module of the
    standard library, PSF licence): English prose with some code, offline on every machine."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def chunks(ids: list[int], ctx: int, bos_id: int | None, max_chunks: int | None = None) -> np.ndarray:
    """[n, ctx] int64: llama.cpp's chunks of `ids`, each starting with BOS when `bos_id` is given.
    Needs at least 2 * ctx tokens, as llama.cpp does."""
    if ctx < 4 or ctx % 2:
        raise SharkportError(f"--ctx {ctx}: give an even context of at least 4 tokens")
    if len(ids) < 2 * ctx:
        raise SharkportError(f"the text tokenizes to {len(ids)} tokens; perplexity with --ctx {ctx} needs at least "
                             f"{2 * ctx} (two chunks, as llama.cpp asks); give a longer text or a smaller --ctx")
    n = len(ids) // ctx if max_chunks is None else min(max_chunks, len(ids) // ctx)
    if n < 1:
        raise SharkportError(f"--chunks {max_chunks}: give at least 1")
    out = np.asarray(ids[:n * ctx], np.int64).reshape(n, ctx).copy()
    if bos_id is not None:
        out[:, 0] = bos_id
    return out


def scored(ctx: int) -> slice:
    """The positions of a chunk whose logits are scored (each predicts the token after it)."""
    return slice(ctx // 2, ctx - 1)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of float32 logits [P, V] as float64 log-probabilities."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


@dataclass
class BaseLogits:
    """A base model's saved distributions (see `save_logits`)."""

    tokens: np.ndarray  # [n, ctx] the chunks as evaluated
    top_ids: np.ndarray  # [P, k] int32, most likely first
    top_logprobs: np.ndarray  # [P, k] float32
    nll: np.ndarray  # [P] float64
    vocab_size: int

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BaseLogits":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as f:
                if str(f["format"]) != LOGITS_FORMAT:
                    raise ValueError(f"format {f['format']}")
                return cls(f["tokens"], f["top_ids"], f["top_logprobs"], f["nll"], int(f["vocab_size"]))
        except FileNotFoundError:
            raise SharkportError(f"{path}: no such file; write it first with --save-logits") from None
        except (OSError, KeyError, ValueError) as e:
            raise SharkportError(f"{path}: not a base-logits file written by --save-logits ({e})") from None


@dataclass
class Result:
    """Perplexity over the scored positions, and with a base, how far the model is from it."""

    tokens: int  # tokens of the text
    chunks: int
    ctx: int
    nll: np.ndarray  # [P] per scored position
    kld: np.ndarray | None = None  # [P]
    same_top1: np.ndarray | None = None  # [P] bool
    base_nll: np.ndarray | None = None
    seconds: float = 0.0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll.mean())

    @property
    def ppl_error(self) -> float:
        """llama.cpp's standard error of the perplexity."""
        n = len(self.nll)
        return math.sqrt(max(self.nll.var(), 0.0) / (n - 1)) * self.ppl if n > 1 else float("nan")

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": self.tokens, "chunks": self.chunks, "ctx": self.ctx,
                               "scored_positions": len(self.nll), "ppl": self.ppl, "ppl_error": self.ppl_error,
                               "seconds": self.seconds}
        if self.kld is not None:
            base_ppl = math.exp(self.base_nll.mean())
            q = np.percentile(self.kld, [50, 90, 95, 99, 99.9])
            out.update(base_ppl=base_ppl, delta_ppl=self.ppl - base_ppl, ppl_ratio=self.ppl / base_ppl,
                       kld_mean=float(self.kld.mean()),
                       kld_mean_error=float(self.kld.std() / math.sqrt(max(len(self.kld) - 1, 1))),
                       kld_median=float(q[0]), kld_90=float(q[1]), kld_95=float(q[2]), kld_99=float(q[3]),
                       kld_99_9=float(q[4]), kld_max=float(self.kld.max()),
                       same_top1=float(self.same_top1.mean()))
        return out


def evaluate(prefill: Callable[[np.ndarray], np.ndarray], chunk_tokens: np.ndarray, batch: int,
             base: BaseLogits | None = None, save_top_k: int | None = None,
             progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Runs the chunks `batch` at a time through `prefill` ([b, ctx] int64 → logits [b, >=ctx, V])
    and scores them: returns nll [P] and, as asked, `kld`/`same_top1` against `base` and the
    `top_ids`/`top_logprobs` to save (save_top_k: 0 keeps the whole vocabulary)."""
    n, ctx = chunk_tokens.shape
    part = scored(ctx)
    nlls, extra = [], {"kld": [], "same_top1": [], "top_ids": [], "top_logprobs": []}
    row = 0  # scored positions done so far, into the base's arrays
    width = ctx - 1 - ctx // 2
    for start in range(0, n, batch):
        rows = chunk_tokens[start:start + batch]
        logits = prefill(rows)
        if logits.shape[1] < ctx:
            raise SharkportError("the module returns only each sequence's last logits (--prefill-final-logits); "
                                 "perplexity needs every position's: re-export without that flag")
        for r, tokens in enumerate(rows):
            logp = log_softmax(np.asarray(logits[r, part]))
            targets = tokens[part.start + 1:ctx]
            nlls.append(-logp[np.arange(width), targets])
            if base is not None:
                b = slice(row, row + width)
                extra["kld"].append(_kld(base.top_ids[b], base.top_logprobs[b], logp))
                extra["same_top1"].append(logp.argmax(axis=-1) == base.top_ids[b, 0])
            if save_top_k is not None:
                k = logp.shape[1] if save_top_k == 0 else min(save_top_k, logp.shape[1])
                top = np.argpartition(-logp, k - 1, axis=-1)[:, :k]
                order = np.argsort(-np.take_along_axis(logp, top, -1), axis=-1, kind="stable")
                top = np.take_along_axis(top, order, -1)
                extra["top_ids"].append(top.astype(np.int32))
                extra["top_logprobs"].append(np.take_along_axis(logp, top, -1).astype(np.float32))
            row += width
        if progress is not None:
            progress(len(rows))
    return np.concatenate(nlls), {k: np.concatenate(v) for k, v in extra.items() if v}


def _kld(top_ids: np.ndarray, top_logprobs: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """KL(base || model) per position: over the base's top ids, plus the rest of the vocabulary
    taken as one outcome."""
    p_lp = top_logprobs.astype(np.float64)
    q_lp = np.take_along_axis(logp, top_ids.astype(np.int64), -1)
    p = np.exp(p_lp)
    kl = (p * (p_lp - q_lp)).sum(axis=-1)
    if top_ids.shape[1] >= logp.shape[1]:  # the whole vocabulary: no rest
        return np.maximum(kl, 0.0)
    p_rest = np.clip(1.0 - p.sum(axis=-1), 0.0, 1.0)
    q_rest = np.clip(1.0 - np.exp(q_lp).sum(axis=-1), 1e-300, 1.0)
    tail = np.where(p_rest > 1e-12, p_rest * (np.log(np.maximum(p_rest, 1e-300)) - np.log(q_rest)), 0.0)
    return np.maximum(kl + tail, 0.0)


def save_logits(path: str | os.PathLike, chunk_tokens: np.ndarray, nll: np.ndarray, arrays: dict[str, np.ndarray],
                vocab_size: int) -> None:
    """Writes a base-logits file (.npz) atomically."""
    from .fileio import atomic_output

    path = Path(path)
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, format=np.str_(LOGITS_FORMAT), tokens=chunk_tokens.astype(np.int32), nll=nll,
                     top_ids=arrays["top_ids"], top_logprobs=arrays["top_logprobs"], vocab_size=vocab_size)


def check_base(base: BaseLogits, chunk_tokens: np.ndarray, vocab_size: int, path: Any) -> None:
    """The base file must come from the same tokens and vocabulary."""
    if base.vocab_size != vocab_size:
        raise SharkportError(f"{path}: saved from a vocabulary of {base.vocab_size} tokens, this model has "
                             f"{vocab_size}; compare models of the same vocabulary")
    if base.tokens.shape != chunk_tokens.shape or not np.array_equal(base.tokens, chunk_tokens):
        raise SharkportError(f"{path}: saved from other tokens ({base.tokens.shape[0]} chunks of "
                             f"{base.tokens.shape[1]}); use the same text, --ctx and --chunks as --save-logits did")


def session_prefill(session, ctx: int) -> tuple[Callable[[np.ndarray], np.ndarray], int]:
    """(prefill, batch): `prefill(rows)` runs up to `batch` chunks of `ctx` tokens through the
    session's prefill (the smallest exported batch size that holds them, padding rows on
    pages of their own), `batch` being the largest exported size. The session needs
    batch * ceil(ctx / block_seq_stride) pages."""
    from .runtime.inputs import pick_batch_size

    c = session.config
    blocks = math.ceil(ctx / c.block_seq_stride)
    batch = max(c.prefill_batch_sizes)
    if blocks * c.block_seq_stride > c.max_seq_len:
        raise SharkportError(f"--ctx {ctx} is longer than the module's max_seq_len {c.max_seq_len}; "
                             "give a smaller --ctx or re-export with a larger --max-seq-len")

    def prefill(rows: np.ndarray) -> np.ndarray:
        bs = pick_batch_size(c.prefill_batch_sizes, len(rows), "prefill")
        tokens = np.zeros((bs, blocks * c.block_seq_stride), np.int64)
        tokens[:len(rows), :ctx] = rows
        ids = np.arange(bs * blocks, dtype=np.int64).reshape(bs, blocks)
        return session.prefill(tokens, np.full(bs, ctx, np.int64), ids)

    return prefill, batch
