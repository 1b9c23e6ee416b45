"""The layer shapes of the models people download, at Q4_K_M's block types (random blocks written
with gguf.GGUFWriter): one layer of Qwen2.5-0.5B (d 896, so llama.cpp stores most matrices as
Q5_0, with Q6_K/Q4_K down projections, q/k/v biases and an untied Q8_0 output of 151936 rows) and
one of Llama-3.2-3B (d 3072: Q4_K and Q6_K throughout). Each exports for the default target with
IREE's code alone and with the x86 kernels, compiles (iree-compile once refused these with a stack allocation past
32 KiB), and the compiled module's teacher-forced top-1 agrees with the eager recipe's (with the
kernels, the recipe with the kernel layers computing in torch)."""

from __future__ import annotations

import numpy as np
import pytest

from gguf_fixtures import random_tensor, write_gguf
from run_cli import run

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # ~1.5 min a case: 0.3-0.6 GB files

SHAPES = {  # arch, d, ffn, vocab, heads, kv heads, head dim, {tensor: type}, biases
    "qwen2.5-0.5b": ("qwen2", 896, 4864, 151936, 14, 2, 64,
                     {"token_embd": "Q8_0", "output": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0",
                      "attn_output": "Q5_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K"}, True),
    "llama-3.2-3b": ("llama", 3072, 8192, 128256, 24, 8, 128,
                     {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
                      "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}, False),
}


def _write(path, name: str):
    arch, d, ff, vocab, heads, kv, hd, types, biases = SHAPES[name]
    shapes = {"token_embd": (vocab, d), "output": (vocab, d), "attn_q": (heads * hd, d), "attn_k": (kv * hd, d),
              "attn_v": (kv * hd, d), "attn_output": (d, heads * hd), "ffn_gate": (ff, d), "ffn_up": (ff, d),
              "ffn_down": (d, ff)}
    rng = np.random.default_rng(0)
    tensors = {}
    for t, shape in shapes.items():
        full = f"{t}.weight" if t in ("token_embd", "output") else f"blk.0.{t}.weight"
        tensors[full] = (types[t], shape, random_tensor(types[t], shape, rng, std=0.05))
    for norm in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        tensors[norm] = ("F32", (d,), (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    if biases:
        for t, rows in (("attn_q", heads * hd), ("attn_k", kv * hd), ("attn_v", kv * hd)):
            tensors[f"blk.0.{t}.bias"] = ("F32", (rows,), (0.05 * rng.standard_normal(rows)).astype(np.float32))
    metadata = {f"{arch}.block_count": 1, f"{arch}.context_length": 4096, f"{arch}.embedding_length": d,
                f"{arch}.feed_forward_length": ff, f"{arch}.attention.head_count": heads,
                f"{arch}.attention.head_count_kv": kv, f"{arch}.rope.freq_base": 1000000.0,
                f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.vocab_size": vocab}
    return write_gguf(path, tensors, metadata, arch=arch)


def _top1(generator, tokens: list[int]):
    session = generator.session
    stride = session.config.block_seq_stride
    padded = -(-len(tokens) // stride) * stride
    ids = np.zeros((1, padded), np.int64)
    ids[0, :len(tokens)] = tokens
    pages = np.arange(1, padded // stride + 1, dtype=np.int64)[None]
    logits = np.asarray(session.prefill(ids, np.array([len(tokens)], np.int64), pages))[0, :len(tokens)]
    return logits.argmax(-1), logits


@pytest.mark.parametrize("kernels", [False, True], ids=["no-matvec-kernels", "matvec-kernels"])
@pytest.mark.parametrize("name", SHAPES)
def test_downloaded_shapes_compile_and_agree_with_the_recipe(tmp_path, name, kernels):
    from sharkport.api import TextGenerator
    from sharkport.archive import import_gguf

    gguf_path, irpa = _write(tmp_path / f"{name}.gguf", name), tmp_path / f"{name}.irpa"
    import_gguf(gguf_path, irpa, progress=False)
    out = {k: tmp_path / f"m.{k}" for k in ("mlir", "json", "vmfb")}
    run("sharkport.export", "--irpa-file", str(irpa), "--output-mlir", str(out["mlir"]),
        "--output-config", str(out["json"]), "--output-vmfb", str(out["vmfb"]), "--bs-prefill", "1",
        "--bs-decode", "1", "--max-seq-len", "256", "--matvec-kernels" if kernels else "--no-matvec-kernels")
    # 256 positions: with the kernels a position's logits can move by about 1% (below), enough to swap
    # a near-tied top two at about one position in a hundred
    tokens = np.random.default_rng(1).integers(0, SHAPES[name][3], 256).tolist()
    compiled, compiled_logits = _top1(TextGenerator.from_files(out["vmfb"], irpa, out["json"]), tokens)
    # with the kernels, the reference computes as they do (x quantized to 8 bits for the products)
    eager, eager_logits = _top1(TextGenerator.eager(irpa, block_seq_stride=32, batch_size=1, max_seq_len=256,
                                                    matvec_kernels=kernels), tokens)
    assert (compiled == eager).mean() >= 0.99
    diff, scale = np.abs(compiled_logits - eager_logits).max(-1), np.abs(eager_logits).max()  # diff by position
    if kernels:
        # a float32 rounding apart before x is quantized can put one of its values a step apart
        # (1/127 of its block's max), which moves that position's logits by up to about 1%
        assert np.median(diff) <= 1e-3 * scale and diff.max() <= 2e-2 * scale, (np.median(diff), diff.max(), scale)
    else:
        assert diff.max() <= 1e-3 * scale
