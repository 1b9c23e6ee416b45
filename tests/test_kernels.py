"""The hand-written matvec kernels (sharkport.kernels, export --matvec-kernels), compiled into
modules by iree-compile and run by the IREE runtime.

References we did not write: `gguf.quants` (each kernel's product: the weights dequantized, and
with quantized weights x quantized to Q8_0 and dequantized, as the kernels multiply 8-bit
integers), and transformers reading a GGUF quantized by our tool (a tiny llama decoding through
the kernels)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from sharkport import kernels, ops
from sharkport.archive.tensors import QuantizedTensor, weight_from_raw
from sharkport.quant.quantize import quantize_array
from run_cli import run
from tiny_models import TINY_EXPORT

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

KINDS = ["Q8_0", "Q4_0", "Q4_1", "F16"]


class _Linear(torch.nn.Module):
    """x @ w.T through ops.linear, with w's planes as module buffers (constants of the module,
    which IREE packs into one buffer: the kernels must honour each plane's offset in it)."""

    def __init__(self, w):
        super().__init__()
        self.type_name, self.shape = (w.type_name, w.shape) if isinstance(w, QuantizedTensor) else ("F16", None)
        self.names = list(w.planes) if isinstance(w, QuantizedTensor) else ["w"]
        for name in self.names:
            self.register_buffer(name, w.planes[name] if isinstance(w, QuantizedTensor) else w)

    def forward(self, x):
        if self.type_name == "F16":
            return ops.linear(x, self.w)
        return ops.linear(x, QuantizedTensor(self.type_name, self.shape, {n: getattr(self, n) for n in self.names}))


def _compile_and_run(module, x, tmp_path):
    import iree.runtime as rt
    from iree.turbine import aot

    from sharkport.compile import compile_mlir

    with kernels.enabled():
        exported = aot.export(module, args=(x,))
    mlir, vmfb = tmp_path / "m.mlir", tmp_path / "m.vmfb"
    exported.save_mlir(mlir)
    assert kernels.referenced_by(mlir), "the product was not routed through a kernel"
    compile_mlir(mlir, vmfb)
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(vmfb)))
    out = ctx.modules.module["main"](rt.asdevicearray(config.device, x.numpy()))
    return np.array(out.to_host(), copy=True)


@pytest.mark.parametrize("rows, n", [(1, 80), (3, 80), (2, 2100)])
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_product_equals_gguf_dequantization(kind, rows, n, tmp_path):
    """80 outputs: 2.5 workgroups of 32; 2100: 9 workgroups of 256, the last partial."""
    k = 96  # 3 blocks per row
    rng = np.random.default_rng(rows)
    raw = quantize_array(rng.standard_normal((n, k)).astype(np.float32), kind)
    w = torch.from_numpy(raw) if kind == "F16" else weight_from_raw(kind, (n, k), raw)
    dense = raw.astype(np.float64) if kind == "F16" else quants.dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    got = _compile_and_run(_Linear(w), x, tmp_path)
    x_seen = x.numpy() if kind == "F16" else quants.dequantize(quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0),
                                                                 GGMLQuantizationType.Q8_0)
    want = x_seen.astype(np.float64) @ dense.T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


class _Fused(torch.nn.Module):
    """ops.linear3 (q, k, v of one x, concatenated) or ops.silu_gate over weights as buffers."""

    def __init__(self, form, weights):
        super().__init__()
        self.form, self.parts = form, [_Linear(w) for w in weights]
        for i, part in enumerate(self.parts):
            self.add_module(f"w{i}", part)

    def weight(self, part):
        if part.type_name == "F16":
            return part.w
        return QuantizedTensor(part.type_name, part.shape, {n: getattr(part, n) for n in part.names})

    def forward(self, x):
        w = [self.weight(p) for p in self.parts]
        return torch.cat(ops.linear3(x, *w), dim=-1) if self.form == "qkv" else ops.silu_gate(x, *w)


@pytest.mark.parametrize("form", ["qkv", "swiglu"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_products_equal_gguf_dequantization(kind, form, tmp_path):
    """One dispatch for q, k, v of 80, 40 and 24 outputs (workgroups of 32 span two matrices), or
    for silu(x gate^T) * (x up^T)."""
    rng = np.random.default_rng(7)
    k, sizes = 96, ([80, 40, 24] if form == "qkv" else [80, 80])
    raws = [quantize_array(rng.standard_normal((n, k)).astype(np.float32), kind) for n in sizes]
    weights = [torch.from_numpy(r) if kind == "F16" else weight_from_raw(kind, (n, k), r) for n, r in zip(sizes, raws)]
    dense = [r.astype(np.float64) if kind == "F16" else quants.dequantize(r, GGMLQuantizationType[kind]).astype(np.float64)
             for r in raws]
    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32))
    got = _compile_and_run(_Fused(form, weights), x, tmp_path)
    x_seen = x.numpy() if kind == "F16" else quants.dequantize(quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0),
                                                                 GGMLQuantizationType.Q8_0)
    ys = [x_seen.astype(np.float64) @ d.T for d in dense]
    want = np.concatenate(ys, axis=1) if form == "qkv" else ys[0] / (1 + np.exp(-ys[0])) * ys[1]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


class _Attention(torch.nn.Module):
    def __init__(self, cache, layer, scale):
        super().__init__()
        self.cache, self.layer, self.scale = cache, layer, scale

    def forward(self, q, cache_state, pages, lens):
        return kernels.decode_attention(q, cache_state, self.cache, self.layer, pages, lens, self.scale)


@pytest.mark.parametrize("head_dim", [64, 40])
def test_decode_attention_equals_torch_sdpa(head_dim, tmp_path):
    """The attention kernel reading pages in place (layer 1 of 2, 16 positions a page, 6 query
    heads on 2 kv heads, sequences of 37 and 70 positions on shuffled pages) equals torch's
    scaled_dot_product_attention over K/V gathered position by position. head_dim 40: the
    kernel's 32-value chunks and its 8-value tail."""
    import iree.runtime as rt
    from iree.turbine import aot

    from sharkport.compile import compile_mlir
    from sharkport.layers import PagedCache

    cache = PagedCache(block_count=2, kv_heads=2, head_dim=head_dim, stride=16)
    B, H, blocks, lens = 2, 6, 5, [37, 70]
    rng = np.random.default_rng(head_dim)
    state = torch.from_numpy(rng.standard_normal((12, cache.page_elems)).astype(np.float32))
    pages = torch.from_numpy(rng.permutation(12)[:B * blocks].reshape(B, blocks).astype(np.int64))
    q = torch.from_numpy(rng.standard_normal((B, 1, H, head_dim)).astype(np.float32))
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    scale = 0.7 / head_dim ** 0.5

    with kernels.enabled():
        exported = aot.export(_Attention(cache, 1, scale), args=(q, state, pages, seq_lens), strict_export=False)
    mlir, vmfb = tmp_path / "m.mlir", tmp_path / "m.vmfb"
    exported.save_mlir(mlir)
    assert "sharkport_decode_attention" in mlir.read_text()
    compile_mlir(mlir, vmfb)
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(vmfb)))
    args = [rt.asdevicearray(config.device, t.numpy()) for t in (q, state, pages, seq_lens)]
    got = np.array(ctx.modules.module["main"](*args).to_host(), copy=True)

    pages_of = state.view(12, 2, 2, 16, 2, head_dim)  # [page, layer, K|V, slot, kv head, D]
    for b in range(B):
        kv = torch.stack([pages_of[pages[b, t // 16], 1, :, t % 16] for t in range(lens[b])], dim=1)  # [2, T, Hkv, D]
        k, v = (kv[i].transpose(0, 1).repeat_interleave(H // 2, dim=0) for i in (0, 1))  # [H, T, D]
        want = torch.nn.functional.scaled_dot_product_attention(q[b, 0][:, None], k, v, scale=scale)[:, 0]
        np.testing.assert_allclose(got[b, 0], want.numpy(), rtol=0, atol=2e-6 * want.abs().max().item())


def test_many_rows_keep_the_traced_product():
    """Beyond MAX_ROWS rows (prefill) and outside `enabled()` no kernel is used."""
    w = torch.zeros(32, 64, dtype=torch.float16)
    with kernels.enabled():
        assert kernels.matvec(torch.zeros(kernels.MAX_ROWS + 1, 64), w) is None
        assert kernels.matvec(torch.zeros(2, 64, dtype=torch.float16), w) is None
    assert kernels.matvec(torch.zeros(1, 64), w) is None


@pytest.fixture(scope="module")
def quantized_tiny(tiny, tmp_path_factory):
    """type name → (GGUF written by our quantize tool, its archive) for the tiny GQA llama."""
    made = {}

    def get(type_name: str):
        if type_name not in made:
            out = tmp_path_factory.mktemp(f"kernels_{type_name}")
            (out / "gguf").mkdir()
            irpa, gguf_path = out / "q.irpa", out / "gguf" / "q.gguf"
            run("sharkport.tools.quantize", "--gguf-file", str(tiny["gqa-untied"].gguf_path), "--type", type_name,
                "--save", str(irpa), "--output-gguf", str(gguf_path))
            made[type_name] = gguf_path, irpa
        return made[type_name]

    return get


def _q8_0_inputs(model: torch.nn.Module) -> list:
    """Makes every nn.Linear of a transformers model multiply its input quantized to Q8_0 and
    dequantized by gguf.quants, as the kernels multiply x by quantized weights. Returns the hooks."""
    def hook(module, args):
        x = args[0]
        rows = x.detach().reshape(-1, x.shape[-1]).numpy()
        seen = quants.dequantize(quants.quantize(rows, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        return (torch.from_numpy(seen).reshape(x.shape),)

    return [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("type_name", ["q8_0", "q4_1", "f16"])
def test_tiny_llama_decodes_through_the_kernels_as_transformers(quantized_tiny, type_name, tmp_path):
    """Prefill 5 tokens, then teacher-forced decode at batch 4 (every row the same sequence, on
    its own pages; products (q, k, v in one dispatch, gate and up with SiLU in one) and attention
    through the kernels, the 4 query heads on one kv head,
    positions over two pages): each step's logits equal transformers' over the same quantized GGUF, with its
    prefill in float32 and, for quantized weights, its decode steps multiplying x quantized to
    Q8_0 by gguf.quants (the kernels' 8-bit products; prefill keeps the float32 product)."""
    import gguf
    from transformers import AutoModelForCausalLM

    from sharkport.archive import Dataset
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export
    from sharkport.models import ModelConfig
    from sharkport.runtime.session import IreeSession

    gguf_path, irpa = quantized_tiny(type_name)
    matrices = {t.tensor_type.name for t in gguf.GGUFReader(gguf_path).tensors if len(t.shape) == 2}
    assert matrices == {type_name.upper()}, "every linear's input is quantized below: every matrix must be"
    config = dataclasses.replace(TINY_EXPORT, matvec_kernels=True)
    output, service = export_model(Dataset.load(irpa), config, ModelConfig(block_seq_stride=config.block_seq_stride))
    save_export(output, service, tmp_path / "m.mlir", tmp_path / "m.json")
    assert kernels.referenced_by(tmp_path / "m.mlir")
    mlir = (tmp_path / "m.mlir").read_text()
    for kernel in ("sharkport_decode_attention", f"sharkport_matvec_qkv_{type_name}", f"sharkport_matvec_swiglu_{type_name}"):
        assert kernel in mlir, f"{kernel} is not called: decode took the traced form"
    compile_mlir(tmp_path / "m.mlir", tmp_path / "m.vmfb")
    session = IreeSession(tmp_path / "m.vmfb", irpa, tmp_path / "m.json", pages=config.device_block_count)

    ids = [3, 99, 14, 200, 7, 7, 51, 128, 60, 2, 31, 90, 17, 5, 250, 33, 8, 64, 101, 12]  # 20: two pages of 16
    prompt, stride = 5, config.block_seq_stride
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    want = {}
    with torch.no_grad():
        past = hf(torch.tensor([ids[:prompt]]), use_cache=True).past_key_values
        hooks = _q8_0_inputs(hf) if type_name != "f16" else []
        for pos in range(prompt, len(ids)):
            out = hf(torch.tensor([[ids[pos]]]), past_key_values=past, use_cache=True)
            past, want[pos] = out.past_key_values, out.logits[0, -1].numpy()
        for h in hooks:
            h.remove()

    pages = np.arange(4, dtype=np.int64)[:, None] * 2 + np.arange(2)  # rows own pages 2r, 2r+1
    tokens = np.zeros((4, stride), np.int64)
    tokens[:, :prompt] = ids[:prompt]
    session.prefill(tokens, np.full(4, prompt), pages[:, :1].copy())
    for pos in range(prompt, len(ids)):
        got = session.decode(np.full((4, 1), ids[pos]), np.full(4, pos + 1), np.full(4, pos),
                             pages[:, :pos // stride + 1].copy())
        for row in range(4):
            np.testing.assert_allclose(got[row, 0], want[pos], rtol=0, atol=2e-4 * np.abs(want[pos]).max(),
                                       err_msg=f"position {pos}, row {row}")


def test_missing_c_compiler_is_one_line(tiny, tmp_path):
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"))
    proc = subprocess.run(
        [sys.executable, "-m", "sharkport.export", "--gguf-file", str(tiny["gqa-untied"].gguf_path),
         "--output-mlir", str(tmp_path / "m.mlir"), "--output-config", str(tmp_path / "m.json"),
         "--bs-prefill", "1", "--bs-decode", "1", "--max-seq-len", "64", "--matvec-kernels"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and "C compiler" in lines[-1] and "no-such-cc" in lines[-1], proc.stderr
    assert not (tmp_path / "m.mlir").exists()
