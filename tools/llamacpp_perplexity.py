#!/usr/bin/env python
"""llama.cpp's perplexity of a GGUF over the tokens `sharkport perplexity` scores:

    python tools/llamacpp_perplexity.py --gguf-file x.gguf (--text-file F | --python-docs) [--ctx 512]
        [--chunks N] [--threads 2] [--json]

The text is tokenized by sharkport (so both sides score the same tokens) and cut into the same
chunks (sharkport/quality.py, llama.cpp's rule); each chunk is evaluated by llama.cpp through
llama-cpp-python (a fresh KV cache per chunk, every position's logits) and scored by the same
code as sharkport's. llama.cpp is an optional reference, built as tools/llamacpp_reference.py
says.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from llamacpp_reference import INSTALL, _quiet
from sharkport import quality


def llamacpp_nll(gguf: Path, chunk_tokens: np.ndarray, threads: int = 2, progress=None) -> np.ndarray:
    """Negative log-likelihoods [P] of the chunks' scored positions under llama.cpp."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit(f"error: llama_cpp is not installed; run `{INSTALL}`") from None
    n, ctx = chunk_tokens.shape
    with _quiet():
        llm = Llama(model_path=str(gguf), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True,
                    n_threads=threads, n_threads_batch=threads, verbose=False)
    part, out = quality.scored(ctx), []
    for tokens in chunk_tokens:
        llm.reset()
        llm.eval(tokens.tolist())
        logp = quality.log_softmax(np.array(llm.scores[part], np.float32))
        out.append(-logp[np.arange(len(logp)), tokens[part.start + 1:ctx]])
        if progress is not None:
            progress(1)
    return np.concatenate(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf-file", type=Path, required=True, help="the GGUF to evaluate")
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--text-file", type=Path, help="the text to score (UTF-8)")
    text.add_argument("--python-docs", action="store_true", help="Python's reference documentation")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    parser.add_argument("--chunks", type=int, help="only the first N chunks")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)

    from sharkport.archive import Dataset

    source = args.text_file.read_text(encoding="utf-8") if args.text_file else quality.reference_text()
    tokenizer = Dataset.load(args.gguf_file).tokenizer()
    chunk_tokens = quality.chunks(tokenizer.encode(source), args.ctx,
                                  tokenizer.bos_id if tokenizer.add_bos else None, args.chunks)
    t0 = time.perf_counter()
    nll = llamacpp_nll(args.gguf_file, chunk_tokens, args.threads)
    result = {"ppl": math.exp(nll.mean()), "chunks": len(chunk_tokens), "ctx": args.ctx,
              "scored_positions": len(nll), "seconds": time.perf_counter() - t0}
    print(json.dumps(result, indent=2) if args.json else
          f"llama.cpp perplexity: {result['ppl']:.4f} over {result['chunks']} chunks of {args.ctx} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
