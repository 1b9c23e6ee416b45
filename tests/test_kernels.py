"""The hand-written matvec kernels (sharkport.kernels, export --matvec-kernels), compiled into
modules by iree-compile and run by the IREE runtime.

References we did not write: `gguf.quants` (each kernel's product: the weights dequantized, and
with quantized weights x quantized to Q8_0 and dequantized, as the kernels multiply 8-bit
integers), and transformers reading a GGUF quantized by our tool (a tiny llama decoding through
the kernels)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from sharkport import kernels
from sharkport.archive.tensors import QuantizedTensor, Theta, weight_from_raw
from sharkport.export.kernels import KernelLinear, KernelRMSNorm, fused_product, use_kernels
from sharkport.layers import Linear, RMSNorm
from sharkport.archive.quantize import quantize_array
from sharkport.quant import BLOCK_TYPES
from sharkport.verify import linear_inputs_per_256, quantize_linear_inputs
from run_cli import run
from tiny_models import TINY_EXPORT, decode_ms, exact_cache

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

KINDS = ["Q8_0", "Q4_0", "Q4_1", "F16"]


class _Linear(torch.nn.Module):
    """x @ w.T through the export's kernel product (KernelLinear), with w's planes as module buffers (constants of the module,
    which IREE packs into one buffer: the kernels must honour each plane's offset in it). bfloat16 values are held as
    their int16 bits (turbine makes no constant of a bfloat16 tensor; an exported model's are parameters)."""

    def __init__(self, w):
        super().__init__()
        self.type_name, self.shape = (w.type_name, w.shape) if isinstance(w, QuantizedTensor) else (w.dtype, None)
        self.interleaved = isinstance(w, QuantizedTensor) and w.interleaved
        self.names = list(w.planes) if isinstance(w, QuantizedTensor) else ["w"]
        for name in self.names:
            plane = w.planes[name] if isinstance(w, QuantizedTensor) else w
            self.register_buffer(name, plane.view(torch.int16) if plane.dtype == torch.bfloat16 else plane)

    def weight(self):
        if isinstance(self.type_name, torch.dtype):
            return self.w.view(self.type_name)
        return QuantizedTensor(self.type_name, self.shape, {n: getattr(self, n) for n in self.names}, self.interleaved)

    def forward(self, x):
        return KernelLinear(Linear(self.weight()))(x)


class _Side(torch.nn.Module):
    """Several modules side by side on the same inputs, their outputs concatenated: one module
    (one compile) for several kernels."""

    def __init__(self, modules):
        super().__init__()
        self.parts = torch.nn.ModuleList(modules)

    def forward(self, *inputs):
        return torch.cat([part(*inputs) for part in self.parts], dim=-1)


class _Products(_Side):
    """x times each of several weights through the export's kernel products, concatenated."""

    def __init__(self, weights):
        super().__init__([_Linear(w) for w in weights])

    def forward(self, x):  # named, for dynamic_shapes={"x": ...}
        return super().forward(x)


@pytest.fixture
def two_cpus(monkeypatch):
    """Products split into workgroups as for 2 CPUs (kernels.workgroups), whatever the machine."""
    monkeypatch.setattr(kernels.layout, "cpus", lambda: 2)


@pytest.fixture(params=[pytest.param(isa, marks=pytest.mark.skipif(
    isa == "avx512" and not kernels.AVX512_FEATURES <= kernels.build._cpu_features(),
    reason="this machine has no AVX-512 with VNNI")) for isa in kernels.ISA_FLAGS])
def isa(request, monkeypatch):
    """Kernels built for each instruction set (kernels.isa), those this machine can run."""
    monkeypatch.setenv(kernels.ISA_ENV, request.param)
    return request.param


def _export(module, *inputs, path, dynamic_shapes=None):
    """module's forward traced into the MLIR file `path` (with torch.export's `dynamic_shapes`); its
    text."""
    from iree.turbine import aot

    exported = aot.export(module, args=inputs, dynamic_shapes=dynamic_shapes, strict_export=False)  # as the exporter traces
    exported.save_mlir(path)
    assert kernels.referenced_by(path), "the product was not routed through a kernel"
    return path.read_text()


def _compiled(module, *inputs, tmp_path, kernel=None, dynamic_shapes=None):
    """module's forward traced on `inputs` and compiled with the kernels (the C function `kernel`,
    or each of a tuple of them, among those it calls, if given): a function of numpy arrays
    running it through IREE."""
    import iree.runtime as rt

    from sharkport.compile import compile_mlir

    mlir, vmfb = tmp_path / "m.mlir", tmp_path / "m.vmfb"
    text = _export(module, *inputs, path=mlir, dynamic_shapes=dynamic_shapes)
    for name in (kernel,) if isinstance(kernel, str) else kernel or ():
        assert f"@{name}(" in text, f"{name} is not called"
    compile_mlir(mlir, vmfb)
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(vmfb)))
    main = ctx.modules.module["main"]
    return lambda *arrays: np.array(main(*(rt.asdevicearray(config.device, a) for a in arrays)).to_host(), copy=True)


def _compile_and_run(module, *inputs, tmp_path, kernel=None):
    """module's forward on `inputs` through IREE with the kernels (see _compiled)."""
    return _compiled(module, *inputs, tmp_path=tmp_path, kernel=kernel)(*(t.numpy() for t in inputs))


def _x_seen(kind: str, x: np.ndarray) -> np.ndarray:
    """x as the kernels multiply it by weights of `kind`: as is for float16; for the K-quants
    quantized as llama.cpp's Q8_K (kernels.quantized_x, which test_x_per_256_is_llama_cpps_q8_k
    holds to llama.cpp's own); else quantized to Q8_0 and dequantized by gguf.quants."""
    if kind in kernels.FLOAT_KINDS:
        return x
    if kind in kernels.X_PER_256:
        return kernels.quantized_x(torch.from_numpy(x), kind).numpy()
    return quants.dequantize(quants.quantize(x, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)


def _dense(kind: str, raw: np.ndarray) -> np.ndarray:
    """The float64 matrix of raw `kind` data (float16 values, bfloat16 bits, or blocks; dequantized
    by gguf.quants)."""
    rows = raw.reshape(raw.shape[0], -1).view(np.uint8)
    return quants.dequantize(rows, GGMLQuantizationType[kind]).astype(np.float64)


@pytest.mark.parametrize("rows, n, k", [(1, 80, 96), (3, 83, 96), (4, 88, 160),
                                        pytest.param(2, 2104, 128, marks=pytest.mark.extended), (8, 2100, 64)])
def test_kernel_product_equals_gguf_dequantization(rows, n, k, isa, two_cpus, tmp_path):
    """Each of KINDS (one module, a product of each). On 2 CPUs, 80, 83 or 88 outputs: 3
    workgroups of 32; 2104 and 2100: 9 workgroups of 256; the last partial. Quantized weights of
    80, 88 and 2104 rows go interleaved eight rows at a time, those of 83 and 2100 one row at a
    time. Rows of 3 or 5 blocks (pairs and an odd one), 4 or 2; at one row of x, float16 rows of
    96 values end in half of the kernel's step of 64. The first block of each row of x is ties:
    half-integers under a max of 127 (scale 1), so rounding half to even, not gguf's half away
    from zero, would move the product by whole weights."""
    rng = np.random.default_rng(rows)
    raws = [quantize_array(rng.standard_normal((n, k)).astype(np.float32), kind) for kind in KINDS]
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, :32] = rng.integers(-127, 127, (rows, 32)) + 0.5
    x[:, 0] = 127
    x = torch.from_numpy(x)
    weights = [weight_from_raw(kind, (n, k), raw) for kind, raw in zip(KINDS, raws)]
    got = _compile_and_run(_Products(weights), x, tmp_path=tmp_path)
    for kind, raw, part in zip(KINDS, raws, np.split(got, len(KINDS), axis=1)):
        want = _x_seen(kind, x.numpy()).astype(np.float64) @ _dense(kind, raw).T
        np.testing.assert_allclose(part, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=kind)


def _random_blocks(kind: str, n: int, k: int, rng) -> np.ndarray:
    """n rows of k values of `kind` as ggml stores them: random bytes (every bit pattern of a
    block's values and scales is valid), with each block's float16 scales (d, and dmin or m)
    random in sign and spread over five decades, so that blocks of very different size meet in a
    row. (Q8_0's values stay in [-127, 127], as ggml's quantizers write them.)"""
    t = BLOCK_TYPES[kind]
    raw = rng.integers(0, 256, (n, k // t.block_size * t.type_size), dtype=np.uint8)
    blocks = raw.reshape(-1).view(t.struct)
    if kind == "Q8_0":
        blocks["qs"] = np.maximum(blocks["qs"], -127)
    for field in ("d", "dmin", "m"):
        if field in blocks.dtype.names:
            size = 10.0 ** rng.uniform(-5, 0, blocks.shape)
            blocks[field] = (size * rng.choice([-1, 1], blocks.shape)).astype(np.float16)
    return raw


ROW_KINDS = ["Q5_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "Q5_1", "IQ4_NL", "IQ4_XS"]


@pytest.mark.parametrize("rows, n, k", [(1, 80, 512), (8, 83, 768), (4, 88, 768),
                                        pytest.param(3, 72, 256, marks=pytest.mark.extended)])
def test_row_kernels_equal_gguf_dequantization(rows, n, k, isa, two_cpus, tmp_path):
    """Q5_0, Q5_1, the K-quants, IQ4_NL and IQ4_XS on random blocks: one, two or three
    super-blocks a row, 1, 3, 4 and 8 rows of x (each row count a loop of its own). Each is read
    interleaved eight rows at a time where its rows are a multiple of 8 (80, 88, 72), else a row at
    a time (83)."""
    rng = np.random.default_rng(rows)
    raws = [_random_blocks(kind, n, k, rng) for kind in ROW_KINDS]
    weights = [weight_from_raw(kind, (n, k), raw) for kind, raw in zip(ROW_KINDS, raws)]
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    got = _compile_and_run(_Products(weights), x, tmp_path=tmp_path,
                           kernel=tuple(f"sharkport_matvec_{kind.lower()}" + ("x8" if w.interleaved else "")
                                        for kind, w in zip(ROW_KINDS, weights)))
    for kind, raw, part in zip(ROW_KINDS, raws, np.split(got, len(ROW_KINDS), axis=1)):
        want = _x_seen(kind, x.numpy()).astype(np.float64) @ _dense(kind, raw).T
        np.testing.assert_allclose(part, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=kind)


QUANTIZED_KINDS = ["Q8_0", "Q4_0", "Q4_1", *ROW_KINDS]


def _largest_blocks(kind: str, n: int, k: int) -> np.ndarray:
    """n rows of k values of `kind` whose every value has its type's largest magnitude: every bit
    of the values and sub-block scales set (Q8_0's values 127), block scales 1/1024, mins 0."""
    t = BLOCK_TYPES[kind]
    raw = np.full((n, k // t.block_size * t.type_size), 0xFF, np.uint8)
    blocks = raw.reshape(-1).view(t.struct)
    if kind == "Q8_0":
        blocks["qs"] = 127
    for field in ("d", "dmin", "m"):
        if field in blocks.dtype.names:
            blocks[field] = np.float16(2.0 ** -10 if field == "d" else 0)
    return raw


@pytest.mark.parametrize("rows, n", [(1, 80), (4, 80), (8, 80), (4, 83)])
def test_products_of_the_largest_values_equal_gguf_dequantization(rows, n, isa, two_cpus, tmp_path):
    """Every quantized type at its largest values times x whose every value quantizes to 127 or
    -127 (rows of ones and of minus ones): the sums of a block's products at their largest, which
    must not overflow whatever width the kernels add them in. Interleaved (80 rows) and a row at a
    time (83), 1, 4 and 8 rows of x."""
    raws = [_largest_blocks(kind, n, 512) for kind in QUANTIZED_KINDS]
    weights = [weight_from_raw(kind, (n, 512), raw) for kind, raw in zip(QUANTIZED_KINDS, raws)]
    x = torch.ones((rows, 512))
    x[1::2] = -1
    got = _compile_and_run(_Products(weights), x, tmp_path=tmp_path)
    for kind, raw, part in zip(QUANTIZED_KINDS, raws, np.split(got, len(QUANTIZED_KINDS), axis=1)):
        want = _x_seen(kind, x.numpy()).astype(np.float64) @ _dense(kind, raw).T
        np.testing.assert_allclose(part, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=kind)


def test_x_per_256_is_llama_cpps_q8_k():
    """x quantized for the K-quants (quantized_x, as matvec.c's quantize_x_k) is llama.cpp's own
    Q8_K: quantize_row_q8_K_ref then dequantize_row_q8_K from the llama-cpp-python build, bit for
    bit, on blocks of scales over sixteen decades, of zeros, and with ties of magnitude (+3 and
    -3: the first gives the scale its sign)."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's reference: pip install -e '.[bench]'")
    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-18, 18, (64, 1)))).astype(np.float32)
    x[0], x[1], x[1, 7], x[1, 9], x[2, 5] = 0, 0, 3.0, -3.0, -1e-30
    x[3] = (rng.integers(-126, 126, 256) + 0.5) / 2  # under a max of 63.5, -127 / max is -2: all ties
    x[3, 0] = 63.5
    blocks = np.zeros(64, np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)]))
    want = np.zeros_like(x)
    ggml.quantize_row_q8_K_ref(x.ctypes.data_as(ctypes.c_void_p), blocks.ctypes.data_as(ctypes.c_void_p),
                               ctypes.c_int64(x.size))
    ggml.dequantize_row_q8_K(blocks.ctypes.data_as(ctypes.c_void_p), want.ctypes.data_as(ctypes.c_void_p),
                             ctypes.c_int64(x.size))
    got = kernels.quantized_x(torch.from_numpy(x), "Q4_K").numpy()
    np.testing.assert_array_equal(got, want)


def test_products_over_a_dynamic_row_count_equal_gguf_dequantization(isa, two_cpus, tmp_path):
    """Prefill's products: x of a dynamic row count, every kernel type in one module, run at 21
    rows (two chunks of eight and five left; quantized x in the dispatch's scratch) and at 3 (on
    the workgroups' stacks), the quantized types interleaved (80 rows).
    BF16 shares F16's loops but for its conversion, so it is tested here alone: at 3 rows its rows
    of w go two at a time, at 21 eight rows of x at a time."""
    rng = np.random.default_rng(0)
    n, k = 80, 512
    kinds = KINDS + ["BF16"] + ROW_KINDS
    raws = [_random_blocks(kind, n, k, rng) if kind in ROW_KINDS
            else quantize_array(rng.standard_normal((n, k)).astype(np.float32), kind) for kind in kinds]
    weights = [weight_from_raw(kind, (n, k), raw)
               for kind, raw in zip(kinds, raws)]
    # quantized x of a dynamic row count goes in the dispatch's scratch
    names = tuple(f"sharkport_matvec_{kind.lower()}" + ("x8" if kind in kernels.INTERLEAVED else "")
                  + ("" if kind in kernels.FLOAT_KINDS else "_scratch") for kind in kinds)
    run_main = _compiled(_Products(weights), torch.zeros(21, k), tmp_path=tmp_path, kernel=names,
                         dynamic_shapes={"x": {0: torch.export.Dim("rows")}})
    for rows in (21, 3):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        got = run_main(x)
        for kind, raw, part in zip(kinds, raws, np.split(got, len(kinds), axis=1)):
            want = _x_seen(kind, x).astype(np.float64) @ _dense(kind, raw).T
            np.testing.assert_allclose(part, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{kind}, {rows} rows")


@pytest.mark.parametrize("mode", ["loads", "none"])
@pytest.mark.parametrize("kind, n, k", [("Q4_1", 80, 96), ("Q4_1", 83, 96), ("Q8_0", 88, 96), ("F16", 80, 96),
                                         ("Q5_0", 80, 96), ("Q6_K", 88, 256), ("Q4_K", 83, 256)])
def test_measuring_aid_products_are_zeros(kind, n, k, mode, two_cpus, monkeypatch, tmp_path):
    """$SHARKPORT_KERNEL_PRODUCTS=loads or none (tools/bench_bounds.py) builds kernels whose
    products only read the weights (every plane: Q5's fifth bits, the K-quants' scales and high
    bits), or read nothing, and give zeros, in an object of their own; the same product without it
    is test_kernel_product_equals_gguf_dequantization's. Rows interleaved (80, 88) and as stored (83)."""
    monkeypatch.setenv(kernels.PRODUCTS_ENV, mode)
    assert f"-DSHARKPORT_PRODUCTS={kernels.PRODUCTS[mode]}" in kernels.cflags()
    rng = np.random.default_rng(n)
    raw = (_random_blocks(kind, n, k, rng) if kind.endswith("_K")
           else quantize_array(rng.standard_normal((n, k)).astype(np.float32), kind))
    w = weight_from_raw(kind, (n, k), raw)
    got = _compile_and_run(_Linear(w), torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32)),
                           tmp_path=tmp_path)
    assert got.shape == (2, n) and not got.any()


@pytest.mark.parametrize("rows", [2, 4, 5])
def test_f16_rows_ending_in_half_a_vector(rows, isa, two_cpus, tmp_path):
    """float16 rows of 88 values: with AVX-512 (16 a vector, two to a loop step) their last 24 take
    a vector and a half-vector step of their own; with AVX2's f16_pair (8 a vector, four to a step)
    two vectors and one. Two and four rows of x multiply two rows of w at a time (f16_pair), each
    workgroup's odd row (41 rows on 2 CPUs) on its own; five, one at a time."""
    rng = np.random.default_rng(rows)
    w = torch.from_numpy(rng.standard_normal((41, 88)).astype(np.float16))
    x = torch.from_numpy(rng.standard_normal((rows, 88)).astype(np.float32))
    got = _compile_and_run(_Linear(w), x, tmp_path=tmp_path)
    want = x.numpy().astype(np.float64) @ w.numpy().astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


class _Fused(torch.nn.Module):
    """kernels.matvec_qkv (q, k, v of one x, concatenated) or kernels.swiglu over weights as buffers."""

    def __init__(self, form, weights):
        super().__init__()
        self.form, self.parts = form, [_Linear(w) for w in weights]
        for i, part in enumerate(self.parts):
            self.add_module(f"w{i}", part)

    def forward(self, x):
        w = [p.weight() for p in self.parts]
        return torch.cat(kernels.matvec_qkv(x, *w), dim=-1) if self.form == "qkv" else kernels.swiglu(x, *w)


@pytest.mark.parametrize("form, sizes", [("qkv", [80, 42, 26]), ("qkv", [80, 48, 24]), ("swiglu", [83, 83]),
                                         ("swiglu", [88, 88])])
def test_fused_products_equal_gguf_dequantization(form, sizes, isa, two_cpus, tmp_path):
    """One dispatch for q, k, v of 80, 42 and 26 outputs (on 2 CPUs, workgroups of 64 span two
    matrices), or for silu(x gate^T) * (x up^T), of each of KINDS (one module). Quantized matrices
    whose rows are all a multiple of 8 go interleaved (80, 48, 24; 88), the others one row at a
    time."""
    rng = np.random.default_rng(7)
    k = 96
    raws = {kind: [quantize_array(rng.standard_normal((n, k)).astype(np.float32), kind) for n in sizes]
            for kind in KINDS}
    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32))
    fused = [_Fused(form, [weight_from_raw(kind, (n, k), r) for n, r in zip(sizes, raws[kind])]) for kind in KINDS]
    got = _compile_and_run(_Side(fused), x, tmp_path=tmp_path)
    for kind, part in zip(KINDS, np.split(got, len(KINDS), axis=1)):
        ys = [_x_seen(kind, x.numpy()).astype(np.float64) @ _dense(kind, r).T for r in raws[kind]]
        want = np.concatenate(ys, axis=1) if form == "qkv" else ys[0] / (1 + np.exp(-ys[0])) * ys[1]
        np.testing.assert_allclose(part, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=kind)


class _NormResidual(torch.nn.Module):
    """The export's kernel products of x RMS-normalized by g (`matvec_norm`: KernelLinear with a
    norm, `qkv_norm`: kernels.matvec_qkv, concatenated, `swiglu_norm`: kernels.swiglu, each
    through fused_product), or `matvec_add`: KernelLinear with a residual r; the weights and g
    as buffers."""

    def __init__(self, form, weights, g, eps):
        super().__init__()
        self.form, self.eps, self.fused = form, eps, _Fused(form, weights)
        self.register_buffer("g", g)

    def forward(self, x, r=None):
        w = [p.weight() for p in self.fused.parts]
        norm = KernelRMSNorm(RMSNorm(self.g, self.eps))
        if self.form == "matvec_add":
            return KernelLinear(Linear(w[0]))(x, residual=r)
        if self.form == "matvec_norm":
            return KernelLinear(Linear(w[0]))(x, norm=norm)
        if self.form == "qkv_norm":
            ys, _ = fused_product(lambda rows, n: kernels.matvec_qkv(rows, *w, n), x, norm)
            return torch.cat(ys, dim=-1)
        y, _ = fused_product(lambda rows, n: kernels.swiglu(rows, *w, n), x, norm)
        return y


@pytest.mark.parametrize("form, sizes", [("matvec_norm", [83]), ("qkv_norm", [80, 42, 26]),
                                         ("swiglu_norm", [88, 88]), ("matvec_add", [88])])
def test_products_normalize_x_and_add_the_residual(form, sizes, isa, two_cpus, tmp_path):
    """A decode layer's RMSNorms and residual adds inside its products' dispatches (the export's
    kernel modules), for each of KINDS (one module): x normalized as transformers' LlamaRMSNorm
    does (then, for quantized weights, quantized to Q8_0), times the matrices (gguf's
    dequantization), plus the residual. Three rows of x, one of them small enough that eps counts;
    matrices of 88 and 80, 48, 24 rows interleaved, 83 and 42 one row at a time."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rng = np.random.default_rng(len(sizes))
    k, eps = 96, 1e-5
    raws = {kind: [quantize_array(rng.standard_normal((n, k)).astype(np.float32), kind) for n in sizes]
            for kind in KINDS}
    g = torch.from_numpy(rng.uniform(0.5, 1.5, k).astype(np.float32))
    x = rng.standard_normal((3, k)).astype(np.float32) * 3
    x[1] *= 1e-3  # mean square about 1e-5
    x = torch.from_numpy(x)
    inputs = (x, torch.from_numpy(rng.standard_normal((3, sizes[0])).astype(np.float32))) if form == "matvec_add" else (x,)
    modules = [_NormResidual(form, [weight_from_raw(kind, (n, k), r) for n, r in zip(sizes, raws[kind])], g, eps)
               for kind in KINDS]
    interleaved = all(n % 8 == 0 for n in sizes)
    got = _compile_and_run(_Side(modules), *inputs, tmp_path=tmp_path,
                           kernel=tuple(f"sharkport_matvec_{form.removeprefix('matvec_')}_{kind.lower()}"
                                        f"{'x8' if kind not in kernels.FLOAT_KINDS and interleaved else ''}"
                                        for kind in KINDS))
    if form == "matvec_add":
        x_normed = x.numpy()
    else:
        reference = LlamaRMSNorm(k, eps=eps)
        with torch.no_grad():
            reference.weight.copy_(g)
            x_normed = reference(x).numpy()
    for kind, part in zip(KINDS, np.split(got, len(KINDS), axis=1)):
        ys = [_x_seen(kind, x_normed).astype(np.float64) @ _dense(kind, r).T for r in raws[kind]]
        want = ys[0] / (1 + np.exp(-ys[0])) * ys[1] if form == "swiglu_norm" else np.concatenate(ys, axis=1)
        if form == "matvec_add":
            want = want + inputs[1].numpy()
        np.testing.assert_allclose(part, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=kind)


class _NormedProducts(torch.nn.Module):
    """`matvec_norm` (see _NormResidual) of one x by each weight, concatenated."""

    def __init__(self, weights, g, eps):
        super().__init__()
        self.parts = torch.nn.ModuleList(_NormResidual("matvec_norm", [w], g, eps) for w in weights)

    def forward(self, x):
        return torch.cat([part(x) for part in self.parts], dim=-1)


def test_prefill_products_normalize_x_of_any_row_count(two_cpus, tmp_path):
    """Prefill's RMSNorms inside its products too: x of a dynamic row count normalized a row at a
    time as it is quantized (float16 weights: the rows multiplied at a time), run at 21 rows (two
    chunks of eight and five left) and at 3, Q8_0 and Q4_K (interleaved) and F16 weights; as
    transformers' LlamaRMSNorm, then quantized as the kernels quantize x."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rng = np.random.default_rng(7)
    n, k, eps, kinds = 80, 512, 1e-5, ["Q8_0", "Q4_K", "F16"]
    raws = [_random_blocks(kind, n, k, rng) if kind == "Q4_K"
            else quantize_array(rng.standard_normal((n, k)).astype(np.float32), kind) for kind in kinds]
    weights = [weight_from_raw(kind, (n, k), raw)
               for kind, raw in zip(kinds, raws)]
    g = torch.from_numpy(rng.uniform(0.5, 1.5, k).astype(np.float32))
    run_main = _compiled(_NormedProducts(weights, g, eps), torch.zeros(21, k), tmp_path=tmp_path,
                         kernel=("sharkport_matvec_norm_q8_0x8_scratch", "sharkport_matvec_norm_q4_kx8_scratch",
                                 "sharkport_matvec_norm_f16"),
                         dynamic_shapes={"x": {0: torch.export.Dim("rows")}})
    reference = LlamaRMSNorm(k, eps=eps)
    with torch.no_grad():
        reference.weight.copy_(g)
    for rows in (21, 3):
        x = rng.standard_normal((rows, k)).astype(np.float32) * 3
        x[1] *= 1e-3  # mean square about 1e-5: eps counts
        got = run_main(x)
        with torch.no_grad():
            normed = reference(torch.from_numpy(x)).numpy()
        for kind, raw, part in zip(kinds, raws, np.split(got, len(kinds), axis=1)):
            want = _x_seen(kind, normed).astype(np.float64) @ _dense(kind, raw).T
            np.testing.assert_allclose(part, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{kind}, {rows} rows")


class _Forms(torch.nn.Module):
    """qkv_norm, swiglu_norm and matvec_add (see _NormResidual) of one x in one module, concatenated."""

    def __init__(self, weights, g, eps):
        super().__init__()
        self.qkv = _NormResidual("qkv_norm", weights[:3], g, eps)
        self.swiglu = _NormResidual("swiglu_norm", weights[3:5], g, eps)
        self.add = _NormResidual("matvec_add", weights[5:], g, eps)

    def forward(self, x, r):
        return torch.cat([self.qkv(x), self.swiglu(x), self.add(x, r)], dim=-1)


@pytest.mark.parametrize("kind", [k if k in ("Q5_0", "Q4_K") else pytest.param(k, marks=pytest.mark.extended)
                                  for k in ROW_KINDS])  # the forms are shared code; each type's loop is tested above
def test_row_kernels_normalize_x_fuse_and_add_the_residual(kind, two_cpus, tmp_path):
    """The fused forms over Q5_0 and K-quant weights: q, k, v of x normalized as transformers'
    LlamaRMSNorm does (80, 48 and 24 rows; Q5_0 and Q4_K interleaved), SwiGLU's gate and up of it
    (83 rows; a row at a time), and x times 256 rows plus a residual, on random blocks of 512
    values a row."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rng = np.random.default_rng(5)
    k, eps, sizes = 512, 1e-5, [80, 48, 24, 83, 83, 256]
    raws = [_random_blocks(kind, n, k, rng) for n in sizes]
    weights = [weight_from_raw(kind, (n, k), raw) for n, raw in zip(sizes, raws)]
    dense = [_dense(kind, raw) for raw in raws]
    g = torch.from_numpy(rng.uniform(0.5, 1.5, k).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32) * 3)
    r = torch.from_numpy(rng.standard_normal((3, sizes[-1])).astype(np.float32))
    x8 = "x8" if kind in kernels.INTERLEAVED else ""  # matrices of whole groups of eight rows are interleaved
    got = _compile_and_run(_Forms(weights, g, eps), x, r, tmp_path=tmp_path,
                           kernel=(f"sharkport_matvec_qkv_norm_{kind.lower()}{x8}",
                                   f"sharkport_matvec_swiglu_norm_{kind.lower()}",
                                   f"sharkport_matvec_add_{kind.lower()}{x8}"))
    reference = LlamaRMSNorm(k, eps=eps)
    with torch.no_grad():
        reference.weight.copy_(g)
        normed = _x_seen(kind, reference(x).numpy()).astype(np.float64)
    ys = [normed @ d.T for d in dense[:5]]
    added = _x_seen(kind, x.numpy()).astype(np.float64) @ dense[5].T + r.numpy()
    silu = ys[3] * 0.5 * (1 + np.tanh(ys[3] / 2))  # x sigmoid(x), without overflow at large |x|
    want = np.concatenate([*ys[:3], silu * ys[4], added], axis=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


class _Passes(torch.nn.Module):
    """q, k, v and SwiGLU's gate and up of x, x times a matrix plus a residual r, and s normalized
    then times a matrix (see _NormResidual), concatenated."""

    def __init__(self, weights, g, eps):
        super().__init__()
        self.qkv, self.swiglu = _Fused("qkv", weights[:3]), _Fused("swiglu", weights[3:5])
        self.add, self.norm = _NormResidual("matvec_add", weights[5:6], g, eps), _NormResidual("matvec_norm", weights[6:], g, eps)

    def forward(self, x, r, s):
        return torch.cat([self.qkv(x), self.swiglu(x), self.add(x, r), self.norm(s)], dim=-1)


@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q8_0", *(pytest.param(k, marks=pytest.mark.extended)
                                                            for k in ("Q6_K", "IQ4_XS", "Q3_K"))])
def test_prefill_products_take_x_in_passes_over_the_weights(kind, two_cpus, tmp_path):
    """Prefill's products with rows of 8192 values: x of a dynamic row count quantized into the
    dispatch's scratch, 64 rows (kernels.PASS_BYTES) for each pass over the weights; run at 150
    rows (passes of 64, 64 and 22), 9 (one pass) and 2 (on the workgroups' stacks). q, k, v
    (interleaved), SwiGLU's gate and up (83 rows: a row at a time), x times 256 rows plus a
    residual, and s normalized then times 88 rows, on random blocks. Each row of s is +-2^j,
    whose mean square is a power of four, so that transformers' LlamaRMSNorm and the kernel
    normalize it alike to the bit (at 8192 values a row, float32 sums in another order move a
    few values across a rounding boundary of the quantized x)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rng = np.random.default_rng(9)
    k, eps, sizes = 8192, 1e-30, [80, 48, 24, 83, 83, 256, 88]
    assert kernels.layout.PASS_BYTES // k == 64
    raws = [_random_blocks(kind, n, k, rng) for n in sizes]
    weights = [weight_from_raw(kind, (n, k), raw) for n, raw in zip(sizes, raws)]
    dense = [_dense(kind, raw) for raw in raws]
    g = torch.from_numpy(rng.uniform(0.5, 1.5, k).astype(np.float32))
    rows = torch.export.Dim("rows")
    x8 = "x8" if kind in kernels.INTERLEAVED else ""
    run_main = _compiled(_Passes(weights, g, eps), torch.zeros(9, k), torch.zeros(9, sizes[5]), torch.ones(9, k),
                         tmp_path=tmp_path, dynamic_shapes={"x": {0: rows}, "r": {0: rows}, "s": {0: rows}},
                         kernel=(f"sharkport_matvec_qkv_{kind.lower()}{x8}_scratch",
                                 f"sharkport_matvec_swiglu_{kind.lower()}_scratch",
                                 f"sharkport_matvec_add_{kind.lower()}{x8}_scratch",
                                 f"sharkport_matvec_norm_{kind.lower()}{x8}_scratch"))
    reference = LlamaRMSNorm(k, eps=eps)
    with torch.no_grad():
        reference.weight.copy_(g)
    for m in (150, 9, 2):
        x = rng.standard_normal((m, k)).astype(np.float32) * 3
        r = rng.standard_normal((m, sizes[5])).astype(np.float32)
        s = (rng.choice([-1, 1], (m, k)) * 2.0 ** rng.integers(-4, 5, (m, 1))).astype(np.float32)
        got = np.split(run_main(x, r, s), np.cumsum([sum(sizes[:3]), sizes[3], sizes[5]]), axis=1)
        with torch.no_grad():
            normed = reference(torch.from_numpy(s)).numpy()
        seen = _x_seen(kind, x).astype(np.float64)
        ys = [seen @ d.T for d in dense[:5]]
        silu = ys[3] * 0.5 * (1 + np.tanh(ys[3] / 2))  # x sigmoid(x), without overflow at large |x|
        wants = [np.concatenate(ys[:3], axis=1), silu * ys[4], seen @ dense[5].T + r,
                 _x_seen(kind, normed).astype(np.float64) @ dense[6].T]
        for part, want, name in zip(got, wants, ("qkv", "swiglu", "add", "norm")):
            np.testing.assert_allclose(part, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=f"{name}, {m} rows")


def test_rows_too_long_to_normalize_in_the_product_take_a_norm_dispatch(monkeypatch, tmp_path):
    """The product keeps x normalized on its stack a row at a time, so it normalizes x of any row
    count whose rows have at most kernels.MAX_NORMED values (prefill's too); longer rows are
    normalized by a dispatch region of their own, and the product is the kernel without the norm."""
    weights = [torch.from_numpy(np.ones((8, 64), np.float16))] * 3
    module = _NormResidual("qkv_norm", weights, torch.ones(64), 1e-5)
    monkeypatch.setattr(kernels, "MAX_NORMED", 64)
    for rows in (1, 2):
        assert "@sharkport_matvec_qkv_norm_f16(" in _export(module, torch.ones(rows, 64), path=tmp_path / "in.mlir")
    monkeypatch.setattr(kernels, "MAX_NORMED", 63)
    text = _export(module, torch.ones(2, 64), path=tmp_path / "two.mlir")
    assert "@sharkport_matvec_qkv_f16(" in text and "sharkport_rms_norm_2x64" in text
    assert "qkv_norm" not in text


class _Attention(torch.nn.Module):
    def __init__(self, cache, layer, scale, layout, window=0):
        super().__init__()
        self.cache, self.layer, self.scale, self.layout, self.window = cache, layer, scale, layout, window

    def forward(self, q, k, v, cache_state, pages, starts, lens, cos, sin):
        return kernels.decode_attention(q, k, v, cache_state, self.cache, self.layer, pages, starts, lens,
                                        (cos, sin), self.layout, self.scale, self.window)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x [H, D] rotated over its first 2 cos.numel() dims at angles atan2(sin, cos): as complex
    multiplication of its pairs (2i, 2i+1) (interleaved, llama.cpp's rope), or by transformers'
    rotate_half (half, HF's llama)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    r = 2 * cos.numel()
    if layout == "interleaved":
        z = torch.view_as_complex(x[:, :r].reshape(x.shape[0], -1, 2).to(torch.float64).contiguous())
        turned = torch.view_as_real(z * torch.complex(cos.double(), sin.double())).flatten(1).float()
    else:
        c, s = torch.cat([cos, cos])[None, None], torch.cat([sin, sin])[None, None]
        turned = apply_rotary_pos_emb(x[None, :, None, :r], x[None, :, None, :r], c, s)[0][0, :, 0]
    return torch.cat([turned, x[:, r:]], dim=1)


@pytest.mark.parametrize("head_dim, rope_dim, layout, dtype, cpus, H, window", [
    (64, 64, "interleaved", torch.float32, 1, 6, 0),
    (64, 64, "interleaved", torch.float32, 4, 6, 0),
    (40, 32, "half", torch.float32, 4, 6, 0),
    (64, 64, "interleaved", torch.float16, 1, 6, 0),
    (64, 64, "interleaved", torch.float16, 4, 8, 0),  # 4 query heads a kv head: two pairs
    (128, 128, "half", torch.float32, 1, 14, 0),  # 7: three, three and one
    (64, 64, "interleaved", torch.float16, 4, 2, 0),  # one: no groups
    (64, 64, "interleaved", torch.float16, 1, 6, 20),  # from positions 17 and 50: into pages 1 and 3
    pytest.param(40, 32, "half", torch.float32, 4, 6, 40,  # all 37 positions; 70's from 30, the last of page 1
                 marks=pytest.mark.extended)])
def test_decode_attention_equals_torch_sdpa(head_dim, rope_dim, layout, dtype, cpus, H, window, monkeypatch,
                                            tmp_path):
    """The attention kernel (layer 1 of 2, 16 positions a page, H query heads on 2 kv heads,
    sequences of 37 and 70 positions on shuffled pages) rotates q and the new k, writes the new k
    and v into their page's slot in place (and nothing else), and equals torch's
    scaled_dot_product_attention over K/V gathered position by position. head_dim 40: the
    kernel's 8-value tail alone (64: its 64-value chunks), and rotary over 32 of the 40 dims. A float16
    cache: the new k and v stored as torch's `.half()` rounds them (to within one unit in the last
    place: k is rotated in float32 by the kernel, in float64 here), the cached values read exactly.
    Exported for 1 CPU, each workgroup takes a sequence with both kv heads (and prefetches their
    whole next page); for 4, a (sequence, kv head). With AVX-512 and head_dim a multiple of 64,
    the query heads of a kv head go two or three at a time (group_scores, group_values): 3 and 3
    for 6 query heads, 2 and 2 for 8, 3, 3 and 1 for 14; 2 query heads take the one-head path.
    With a sliding window, only the last `window` positions are seen. The op run eagerly computes
    the same."""
    import iree.runtime as rt
    from iree.turbine import aot

    from sharkport.compile import compile_mlir
    from sharkport.layers import PagedCache

    cache = PagedCache(block_count=2, kv_heads=2, head_dim=head_dim, stride=16)
    B, blocks, lens = 2, 5, [37, 70]
    rng = np.random.default_rng(head_dim)
    f32 = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    state = f32(12, cache.page_elems).to(dtype)
    pages = torch.from_numpy(rng.permutation(12)[:B * blocks].reshape(B, blocks).astype(np.int64))
    q, k, v = f32(B, 1, H, head_dim), f32(B, 1, 2, head_dim), f32(B, 1, 2, head_dim)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    starts = seq_lens - 1
    angles = torch.rand(B, 1, rope_dim // 2, dtype=torch.float64) * 6.28
    cos, sin = angles.cos().float(), angles.sin().float()
    scale = 0.7 / head_dim ** 0.5

    monkeypatch.setattr(kernels.layout, "cpus", lambda: cpus)
    # the kernel updates the cache in place: functionalized in the form turbine imports, as the exporter does
    with torch._export.config.patch(enable_auto_functionalized_v2_for_export=False):
        exported = aot.export(_Attention(cache, 1, scale, layout, window), strict_export=False,
                              args=(q, k, v, state.clone(), pages, starts, seq_lens, cos, sin))
    mlir, vmfb = tmp_path / "m.mlir", tmp_path / "m.vmfb"
    exported.save_mlir(mlir)
    assert f"sharkport_decode_attention{'_f16' if dtype == torch.float16 else ''}(" in mlir.read_text()
    assert ("_w2" in mlir.read_text()) == (cpus == 1), "kv heads a workgroup"
    compile_mlir(mlir, vmfb)
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(vmfb)))
    args = [rt.asdevicearray(config.device, t.numpy()) for t in (q, k, v, state, pages, starts, seq_lens, cos, sin)]
    got = np.array(ctx.modules.module["main"](*args).to_host(), copy=True)
    written = torch.from_numpy(np.array(args[3].to_host(), copy=True))

    want_state = state.clone()
    pages_of = want_state.view(12, 2, 2, 16, 2, head_dim)  # [page, layer, K|V, slot, kv head, D]
    for b in range(B):
        page, slot = pages[b, starts[b] // 16], starts[b] % 16
        pages_of[page, 1, 0, slot] = _rotated(k[b, 0], cos[b, 0], sin[b, 0], layout).to(dtype)
        pages_of[page, 1, 1, slot] = v[b, 0].to(dtype)
    np.testing.assert_allclose(written.float().numpy(), want_state.float().numpy(),
                               rtol=2 ** -10 if dtype == torch.float16 else 0, atol=1e-6)
    written_of = written.view(12, 2, 2, 16, 2, head_dim)
    for b in range(B):
        seen = range(max(0, lens[b] - window) if window else 0, lens[b])
        kv = torch.stack([written_of[pages[b, t // 16], 1, :, t % 16] for t in seen], dim=1).float()
        k_all, v_all = (kv[i].transpose(0, 1).repeat_interleave(H // 2, dim=0) for i in (0, 1))  # [H, T, D]
        qr = _rotated(q[b, 0], cos[b, 0], sin[b, 0], layout)
        want = torch.nn.functional.scaled_dot_product_attention(qr[:, None], k_all, v_all, scale=scale)[:, 0]
        np.testing.assert_allclose(got[b, 0], want.numpy(), rtol=0, atol=2e-6 * want.abs().max().item())

    # the op run eagerly (what tracing falls back on outside IREE) writes and attends the same
    eager_state = state.clone()
    eager = _Attention(cache, 1, scale, layout, window)(q, k, v, eager_state, pages, starts, seq_lens, cos, sin)
    np.testing.assert_allclose(eager_state.float().numpy(), written.float().numpy(),
                               rtol=2 ** -10 if dtype == torch.float16 else 0, atol=1e-6)
    np.testing.assert_allclose(eager.numpy(), got, rtol=0, atol=2e-6 * np.abs(got).max())


@pytest.mark.parametrize("batch, kv_heads, gd, cpus, want", [
    (1, 3, 192, 2, 1),  # SmolLM2 decode bs1 on 2 CPUs: a workgroup per kv head
    (4, 3, 192, 2, 3),  # bs4: a workgroup per sequence
    (2, 4, 128, 4, 2),  # two sequences on 4 CPUs: two workgroups each
    (4, 8, 512, 2, 4),  # 8 kv heads of 512 values a group: 4 fill MAX_GD
    (8, 3, 192, 64, 1)])  # more CPUs than (sequence, kv head) pairs
def test_attention_workgroups_leave_one_for_each_cpu(batch, kv_heads, gd, cpus, want, monkeypatch):
    monkeypatch.setattr(kernels.layout, "cpus", lambda: cpus)
    assert kernels.kv_heads_per_workgroup(batch, kv_heads, gd) == want


@pytest.mark.parametrize("batch, kv_heads, gd, cpus, want, splits", [
    (1, 3, 192, 2, 3, 2),  # SmolLM2 decode bs1 on 2 CPUs: all 3 kv heads, the pages in two parts
    (1, 3, 192, 8, 1, 2),  # on 8 CPUs: 3 items in 6 parts, where one item would give 4
    (1, 2, 448, 2, 2, 2),  # Qwen2.5-0.5B's shapes at bs1
    (1, 8, 384, 2, 4, 1),  # Llama-3.2-3B's: 8 kv heads of 384 values a group, 4 fill MAX_GD
    (4, 3, 192, 8, 3, 2),  # bs4 on 8 CPUs: a sequence an item, each in two parts
    (1, 1, 1024, 2, 1, 2)])  # Gemma-3-270M's one kv head
def test_block_attention_items_read_whole_pages_where_as_even(batch, kv_heads, gd, cpus, want, splits, monkeypatch):
    """A block's attention items take the most kv heads that share the work as evenly among the
    workgroups as fewer do once split by pages (so each part reads its pages' rows whole)."""
    monkeypatch.setattr(kernels.layout, "cpus", lambda: cpus)
    assert kernels.block_kv_heads_per_workgroup(batch, kv_heads, gd) == want
    assert kernels.layout.attention_splits(batch * kv_heads // want, cpus) == splits


class _PrefillAttention(torch.nn.Module):
    def __init__(self, scale, window=0):
        super().__init__()
        self.scale, self.window = scale, window

    def forward(self, q, k, v):
        return kernels.prefill_attention(q, k, v, self.scale, self.window)


@pytest.mark.parametrize("head_dim, window", [(64, 0), (40, 0), (64, 45)])
def test_prefill_attention_equals_torch_sdpa(head_dim, window, tmp_path):
    """The prefill attention kernel (6 query heads on 2 kv heads, batch 2), exported once for
    any prompt length, equals torch's causal scaled_dot_product_attention at lengths 1 to 300:
    within one workgroup's 12 positions (1, 7, 8: partial tiles of 6), across several (37), and
    over many chunks of 32 keys (300: the running softmax). head_dim 40: blocks of 16 dims and
    a tail of 8. A sliding window of 45 (transformers' and ops.causal_mask's: keys i - j < 45)
    starts inside a chunk of 32 keys, and from position 77 on leaves whole chunks out."""
    import iree.runtime as rt
    from iree.turbine import aot

    from sharkport.compile import compile_mlir

    B, H, Hkv, scale = 2, 6, 2, 0.7 / head_dim ** 0.5
    rng = np.random.default_rng(head_dim)
    f32 = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    seq = torch.export.Dim("seq", max=4096)
    exported = aot.export(_PrefillAttention(scale, window), args=(f32(B, 9, H, head_dim), f32(B, 9, Hkv, head_dim),
                                                          f32(B, 9, Hkv, head_dim)),
                          dynamic_shapes={"q": {1: seq}, "k": {1: seq}, "v": {1: seq}}, strict_export=False)
    mlir, vmfb = tmp_path / "m.mlir", tmp_path / "m.vmfb"
    exported.save_mlir(mlir)
    assert "sharkport_prefill_attention(" in mlir.read_text()
    compile_mlir(mlir, vmfb)
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(vmfb)))
    for S in (1, 7, 8, 37, 300):
        q, k, v = f32(B, S, H, head_dim), f32(B, S, Hkv, head_dim), f32(B, S, Hkv, head_dim)
        got = np.array(ctx.modules.module["main"](*(rt.asdevicearray(config.device, t.numpy()) for t in (q, k, v)))
                       .to_host(), copy=True)
        heads = lambda t: t.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # noqa: E731  [B, H, S, D]
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        seen = (j <= i) & ((i - j < window) if window else True)
        want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), heads(k), heads(v), attn_mask=seen,
                                                                scale=scale).transpose(1, 2)
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=2e-6 * want.abs().max().item(),
                                   err_msg=f"{S} positions")


def test_eager_products_keep_dequantized_matrices_while_their_planes_are_unchanged():
    """The eager product (verify's and the tests' reference) computes as gguf.quants dequantizes,
    keeps each matrix dequantized for the next call, and dequantizes again once a plane is
    written in place; a matrix's entry goes with its planes."""
    import gc

    from sharkport.kernels import ops

    rng = np.random.default_rng(5)
    raw = quantize_array(rng.standard_normal((16, 64)).astype(np.float32), "Q8_0")
    w = weight_from_raw("Q8_0", (16, 64), raw)
    x = torch.from_numpy(rng.standard_normal((2, 64)).astype(np.float32))

    def product():
        return KernelLinear(Linear(w))(x).numpy()

    def want():
        return _x_seen("Q8_0", x.numpy()).astype(np.float64) @ _dense("Q8_0", raw).T

    held = len(ops._eager_cache)
    np.testing.assert_allclose(product(), want(), rtol=0, atol=1e-5 * np.abs(want()).max())
    assert len(ops._eager_cache) == held + 1
    np.testing.assert_array_equal(product(), product())
    w.planes["d"].mul_(2)  # every row's scales doubled: the products double
    np.testing.assert_allclose(product(), 2 * want(), rtol=0, atol=2e-5 * np.abs(want()).max())
    del w
    gc.collect()
    assert len(ops._eager_cache) == held


def test_x_not_in_float32_keeps_the_traced_product():
    """Rows of x beyond decode's (prefill's) take the kernel; x not in float32 does not."""
    w = torch.zeros(32, 64, dtype=torch.float16)
    assert kernels.matvec(torch.zeros(kernels.MAX_ROWS + 1, 64), w) is not None
    assert kernels.matvec(torch.zeros(2, 64, dtype=torch.float16), w) is None


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
                "--output-irpa", str(irpa), "--output-gguf", str(gguf_path))
            made[type_name] = gguf_path, irpa
        return made[type_name]

    return get


@pytest.fixture(scope="module")
def kernel_module(quantized_tiny, tmp_path_factory):
    """(type name, KV cache dtype) → (vmfb, irpa, config json, GGUF) of the tiny llama quantized
    to that type, exported with --matvec-kernels (after checking decode calls the kernels) and
    compiled."""
    import gguf

    from sharkport.archive import Dataset
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export
    from sharkport.models import ModelConfig

    made = {}

    def get(type_name: str, cache_dtype: torch.dtype = torch.float32):
        if (type_name, cache_dtype) not in made:
            gguf_path, irpa = quantized_tiny(type_name)
            matrices = {t.tensor_type.name for t in gguf.GGUFReader(gguf_path).tensors if len(t.shape) == 2}
            assert matrices == {type_name.upper()}, "every linear's input is quantized below: every matrix must be"
            out = tmp_path_factory.mktemp(f"kernel_module_{type_name}")
            config = dataclasses.replace(TINY_EXPORT, matvec_kernels=True)
            output, service = export_model(Dataset.load(irpa), config,
                                           ModelConfig(block_seq_stride=config.block_seq_stride,
                                                       kv_cache_dtype=cache_dtype))
            save_export(output, service, out / "m.mlir", out / "m.json")
            mlir = (out / "m.mlir").read_text()
            cache = "_f16" if cache_dtype == torch.float16 else ""
            # decode's layer, its output projection; prefill's products (decode's are in the layer), each
            # normalizing x where a norm comes before it (quantized x in the dispatch's scratch), and attention
            scratch = "" if type_name.upper() in kernels.FLOAT_KINDS else "_scratch"
            for kernel in (rf"sharkport_layer_block_{type_name}(x8)?{cache}\(", f"sharkport_matvec_norm_{type_name}",
                           rf"sharkport_matvec_swiglu_norm_{type_name}(x8)?{scratch}\(", r"sharkport_prefill_attention\("):
                assert re.search(kernel, mlir), f"{kernel} is not called: the traced form was taken"
            assert "sharkport_rms_norm" not in mlir and "torch.aten.mean" not in mlir, "a norm took a dispatch of its own"
            compile_mlir(out / "m.mlir", out / "m.vmfb")
            made[type_name, cache_dtype] = out / "m.vmfb", irpa, out / "m.json", gguf_path
        return made[type_name, cache_dtype]

    return get


@pytest.mark.parametrize("type_name, cache_dtype", [("q8_0", torch.float32), ("q4_1", torch.float32),
                                                    pytest.param("f16", torch.float32, marks=pytest.mark.extended),
                                                    ("f16", torch.float16), ("bf16", torch.float16)])
def test_tiny_llama_decodes_through_the_kernels_as_transformers(kernel_module, type_name, cache_dtype):
    """Prefill 5 tokens, then teacher-forced decode at batch 4 (every row the same sequence, on
    its own pages; products (q, k, v in one dispatch, gate and up with SiLU in one), rotary, the
    cache write and attention through the kernels, the 4 query heads on one kv head, positions
    over two pages): each step's logits equal transformers' over the same quantized GGUF, for
    quantized weights with its prefill and decode multiplying x quantized to Q8_0 by gguf.quants
    (the kernels' 8-bit products, prefill's over its dynamic row count included). With a
    float16 KV cache (`--kv-cache-dtype float16`), within what rounding K and V to float16 moves
    them (3e-3 of the max logit; float32: 2e-4)."""
    from transformers import AutoModelForCausalLM

    from sharkport.runtime.session import IreeSession

    vmfb, irpa, config_json, gguf_path = kernel_module(type_name, cache_dtype)
    session = IreeSession(vmfb, irpa, config_json, pages=TINY_EXPORT.device_block_count)

    ids = [3, 99, 14, 200, 7, 7, 51, 128, 60, 2, 31, 90, 17, 5, 250, 33, 8, 64, 101, 12]  # 20: two pages of 16
    prompt, stride = 5, TINY_EXPORT.block_seq_stride
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    want = {}
    with torch.no_grad():
        hooks = quantize_linear_inputs(hf) if type_name not in ("f16", "bf16") else []
        past = hf(torch.tensor([ids[:prompt]]), use_cache=True).cache
        for pos in range(prompt, len(ids)):
            out = hf(torch.tensor([[ids[pos]]]), cache=past, use_cache=True)
            past, want[pos] = out.cache, out.logits[0, -1].numpy()
        for h in hooks:
            h.remove()

    tolerance = 3e-3 if cache_dtype == torch.float16 else 2e-4
    pages = np.arange(4, dtype=np.int64)[:, None] * 2 + np.arange(2)  # rows own pages 2r, 2r+1
    tokens = np.zeros((4, stride), np.int64)
    tokens[:, :prompt] = ids[:prompt]
    session.prefill(tokens, np.full(4, prompt), pages[:, :1].copy())
    for pos in range(prompt, len(ids)):
        got = session.decode(np.full((4, 1), ids[pos]), np.full(4, pos + 1), np.full(4, pos),
                             pages[:, :pos // stride + 1].copy())
        for row in range(4):
            np.testing.assert_allclose(got[row, 0], want[pos], rtol=0, atol=tolerance * np.abs(want[pos]).max(),
                                       err_msg=f"position {pos}, row {row}")


# a llama layer's matrices at llama.cpp's Q4_K_M kinds: Q4_K q, k, output projection, gate and
# up, a Q5_K v (a type apart from q and k, as the Q6_K attn_v of llama.cpp's mixtures), a Q6_K
# down projection, and an untied Q8_0 output
Q4_K_M_LAYER = {"token_embd": "Q4_K", "output": "Q8_0", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q5_K",
                "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
# and at llama.cpp's Q2_K kinds (Q2_K, with Q3_K attn_v, attn_output and ffn_down, a Q6_K output)
Q2_K_LAYER = {"token_embd": "Q2_K", "output": "Q6_K", "attn_q": "Q2_K", "attn_k": "Q2_K", "attn_v": "Q3_K",
              "attn_output": "Q3_K", "ffn_gate": "Q2_K", "ffn_up": "Q2_K", "ffn_down": "Q3_K"}
# and of an IQ4_XS file (IQ4_XS, with IQ4_NL where llama.cpp falls back to it, a Q6_K output)
IQ4_XS_LAYER = {"token_embd": "IQ4_XS", "output": "Q6_K", "attn_q": "IQ4_XS", "attn_k": "IQ4_XS", "attn_v": "IQ4_NL",
                "attn_output": "IQ4_NL", "ffn_gate": "IQ4_XS", "ffn_up": "IQ4_XS", "ffn_down": "IQ4_XS"}


def _k_quant_layer(tmp_path, kinds: dict[str, str] = Q4_K_M_LAYER):
    """(GGUF, archive) of a llama layer whose matrices are of `kinds` (by GGUF name without blk.0.
    and .weight), random blocks."""
    from gguf_fixtures import random_tensor, write_gguf
    from sharkport.archive import import_gguf

    d, ff, heads, kv, hd, vocab = 256, 512, 4, 2, 64, 64
    shapes = {"token_embd": (vocab, d), "output": (vocab, d), "attn_q": (heads * hd, d), "attn_k": (kv * hd, d),
              "attn_v": (kv * hd, d), "attn_output": (d, heads * hd), "ffn_gate": (ff, d), "ffn_up": (ff, d),
              "ffn_down": (d, ff)}
    types = {name if name in ("token_embd", "output") else f"blk.0.{name}": (kinds[name], shape)
             for name, shape in shapes.items()}
    rng = np.random.default_rng(0)
    tensors = {f"{name}.weight": (kind, shape, random_tensor(kind, shape, rng, std=0.05))
               for name, (kind, shape) in types.items()}
    for norm in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        tensors[norm] = ("F32", (d,), (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    (tmp_path / "gguf").mkdir()
    gguf_path = write_gguf(tmp_path / "gguf" / "k.gguf", tensors, {
        "llama.block_count": 1, "llama.context_length": 256, "llama.embedding_length": d,
        "llama.feed_forward_length": ff, "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv,
        "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-6, "llama.vocab_size": vocab})
    irpa = tmp_path / "k.irpa"
    import_gguf(gguf_path, irpa, progress=False)
    return gguf_path, irpa


def test_transformers_quantizes_each_linear_input_as_the_kernels(tmp_path):
    """On _k_quant_layer (K-quant matrices, whose kernels take x quantized per 256 values, and a
    Q8_0 output, per 32): with its linear layers' inputs quantized as linear_inputs_per_256 names
    them, transformers' prefill logits over the GGUF are the eager recipe's with the kernel layers
    (torch computing what each kernel computes); with every input quantized per 32 instead, most
    positions' are not."""
    from transformers import AutoModelForCausalLM

    from sharkport.api import TextGenerator
    from sharkport.archive import Dataset

    gguf_path, irpa = _k_quant_layer(tmp_path)
    per_256 = linear_inputs_per_256(Dataset.load(irpa))
    assert sorted(per_256) == sorted(f"model.layers.0.{m}" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))

    ids = np.random.default_rng(1).integers(0, 64, 24).tolist()
    session = TextGenerator.eager(irpa, block_seq_stride=32, batch_size=1, max_seq_len=64,
                                  matvec_kernels=True).session
    tokens = np.zeros((1, 32), np.int64)
    tokens[0, :len(ids)] = ids
    got = np.asarray(session.prefill(tokens, np.array([len(ids)]), np.array([[1]])))[0, :len(ids)]
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)

    def transformers_logits(names):
        hooks = quantize_linear_inputs(hf, names)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].numpy()
        for h in hooks:
            h.remove()
        return logits

    want, per_32 = transformers_logits(per_256), transformers_logits(())
    scale = np.abs(want).max()
    diff = np.abs(got - want).max(-1) / scale  # by position
    # equal but where a float32 rounding apart puts a value of x a quantization step away, which
    # moves that position's logits by up to about 1%
    assert np.median(diff) <= 1e-5 and diff.max() <= 2e-2, diff
    assert np.median(np.abs(got - per_32).max(-1)) > 1e-3 * scale


def test_norms_of_layers_of_mixed_types_go_inside_the_products(tmp_path):
    """_k_quant_layer's q and k (Q4_K) and v (Q5_K) cannot share a dispatch (and their planes are
    more than the layer block of mixed types takes), so each product normalizes x itself: prefill
    and decode export no RMSNorm reduction of IREE's (over prefill's dynamic rows of a 3072-wide
    model, iree-compile put its tile on the stack past the 32 KiB limit)."""
    from sharkport.archive import Dataset
    from sharkport.export import export_model, save_export

    _, irpa = _k_quant_layer(tmp_path)
    config = dataclasses.replace(TINY_EXPORT, matvec_kernels=True)
    output, service = export_model(Dataset.load(irpa), config, exact_cache(config.block_seq_stride))
    save_export(output, service, tmp_path / "m.mlir", tmp_path / "m.json")
    text = (tmp_path / "m.mlir").read_text()
    for name in ("matvec_norm_q4_kx8", "matvec_norm_q5_kx8", "matvec_norm_q8_0x8", "matvec_swiglu_norm_q4_kx8",
                 "matvec_norm_q4_kx8_scratch", "matvec_swiglu_norm_q4_kx8_scratch"):
        assert re.search(rf"@sharkport_{name}\(", text), f"{name} is not called"
    assert "torch.aten.mean" not in text and "sharkport_rms_norm" not in text


@pytest.mark.parametrize("kinds, kernels_called", [
    (Q2_K_LAYER, ("matvec_swiglu_norm_q2_kx8", "matvec_add_q3_kx8", "matvec_norm_q6_kx8")),
    (IQ4_XS_LAYER, ("layer_block_mixed", "matvec_swiglu_norm_iq4_xsx8_scratch", "matvec_add_iq4_nlx8_scratch",
                    "matvec_norm_q6_kx8")),
    (Q4_K_M_LAYER, ("matvec_norm_q5_kx8", "matvec_add_q6_kx8", "matvec_norm_q8_0x8"))],
    ids=["Q2_K", "IQ4_XS", "Q4_K_M"])
def test_layer_through_the_compiled_kernels_computes_as_transformers(kinds, kernels_called, tmp_path):
    """_k_quant_layer at llama.cpp's Q2_K kinds (Q2_K and Q3_K matrices, a Q6_K output), at an
    IQ4_XS file's (IQ4_XS and IQ4_NL) and at Q4_K_M's (Q4_K, Q5_K, Q6_K, a Q8_0 output), exported
    with the kernels and compiled (decode's layer a dispatch a product, each normalizing x, or for
    IQ4_XS's 24 planes the layer block of mixed types): prefill of 20 tokens over two pages, then 6
    teacher-forced decode steps. Each position's logits are transformers' over the same GGUF with
    each linear layer's input quantized as the kernels quantize it (per 256 values for the
    K-quants, per 32 for the rest), as in test_transformers_quantizes_each_linear_input_as_the_kernels."""
    from transformers import AutoModelForCausalLM

    from sharkport.archive import Dataset
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export
    from sharkport.runtime.session import IreeSession

    gguf_path, irpa = _k_quant_layer(tmp_path, kinds)
    dataset = Dataset.load(irpa)
    config = dataclasses.replace(TINY_EXPORT, matvec_kernels=True)
    output, service = export_model(dataset, config, exact_cache(config.block_seq_stride))
    save_export(output, service, tmp_path / "m.mlir", tmp_path / "m.json")
    text = (tmp_path / "m.mlir").read_text()
    for name in kernels_called:
        assert re.search(rf"@sharkport_{name}\(", text), f"{name} is not called"
    compile_mlir(tmp_path / "m.mlir", tmp_path / "m.vmfb")
    session = IreeSession(tmp_path / "m.vmfb", irpa, tmp_path / "m.json", pages=TINY_EXPORT.device_block_count)

    ids, prompt, stride = np.random.default_rng(2).integers(0, 64, 26).tolist(), 20, TINY_EXPORT.block_seq_stride
    tokens = np.zeros((1, 2 * stride), np.int64)
    tokens[0, :prompt] = ids[:prompt]
    pages = np.array([[0, 1]], np.int64)
    got = list(np.asarray(session.prefill(tokens, np.array([prompt]), pages))[0, :prompt])
    for pos in range(prompt, len(ids)):
        got.append(np.asarray(session.decode(np.array([[ids[pos]]]), np.array([pos + 1]), np.array([pos]),
                                             pages))[0, 0])
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    quantize_linear_inputs(hf, linear_inputs_per_256(dataset))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    diff = np.abs(np.array(got) - want).max(-1) / np.abs(want).max()  # by position
    assert np.median(diff) <= 1e-5 and diff.max() <= 2e-2, diff


def test_weights_in_several_buffers_compute_as_in_one(tmp_path):
    """A CPU module gathers its weights into buffers of at most compile.MAX_ALLOCATION bytes as it
    loads, each weight at an offset in one (which a layer block of mixed types reads in its planes'
    own element types). The IQ4_XS layer (decode's layer that block) compiled with its weights
    spread over buffers of 64 KiB gives the logits of one buffer, prefill and decode."""
    from sharkport.archive import Dataset
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export
    from sharkport.runtime.session import IreeSession

    _, irpa = _k_quant_layer(tmp_path, IQ4_XS_LAYER)
    config = dataclasses.replace(TINY_EXPORT, matvec_kernels=True)
    output, service = export_model(Dataset.load(irpa), config, exact_cache(config.block_seq_stride))
    save_export(output, service, tmp_path / "m.mlir", tmp_path / "m.json")
    logits = []
    for name, flags in (("one", []), ("split", ["--iree-stream-resource-max-allocation-size=65536"])):
        compile_mlir(tmp_path / "m.mlir", tmp_path / f"{name}.vmfb", extra_flags=flags)
        session = IreeSession(tmp_path / f"{name}.vmfb", irpa, tmp_path / "m.json",
                              pages=TINY_EXPORT.device_block_count)
        ids, prompt, stride = np.random.default_rng(3).integers(0, 64, 24).tolist(), 20, TINY_EXPORT.block_seq_stride
        tokens = np.zeros((1, 2 * stride), np.int64)
        tokens[0, :prompt] = ids[:prompt]
        pages = np.array([[0, 1]], np.int64)
        got = [np.asarray(session.prefill(tokens, np.array([prompt]), pages))[0, :prompt]]
        for pos in range(prompt, len(ids)):
            got.append(np.asarray(session.decode(np.array([[ids[pos]]]), np.array([pos + 1]), np.array([pos]),
                                                 pages))[0])
        logits.append(np.concatenate(got))
    assert np.isfinite(logits[0]).all()
    np.testing.assert_array_equal(logits[1], logits[0])


def test_kernel_decode_writes_the_cache_in_place(kernel_module):
    """A decode step through the kernels costs the same with 16 pages as with 65536 (268 MB of
    cache): IREE copying the cache_state argument in and out of each call (as it does when the
    kernels' in-place write is not recognised as such) would cost tens of ms."""
    vmfb, irpa, config_json, _ = kernel_module("q8_0")
    small, large = (decode_ms((vmfb, irpa, config_json), pages) for pages in (16, 65536))
    assert large < 3 * small + 1.0, (small, large)


def _decode_bs1_commands(mlir) -> str:
    """The VM code of decode_bs1 (its command buffer's recording) compiled from `mlir`
    (iree-compile --compile-to=vm)."""
    from sharkport.compile import compile_flags

    vm = subprocess.run(["iree-compile", str(mlir), *compile_flags(), *kernels.compile_flags_for(mlir),
                         "--compile-to=vm"], capture_output=True, text=True, check=True).stdout
    start = vm.index("vm.func private @decode_bs1$async(")
    decode = vm[start:vm.index("vm.func private", start + 1)]
    assert decode.count("@hal.command_buffer.dispatch") >= 2 + 7, "not decode's command buffer"
    return decode


def test_batch1_decode_copies_no_index_arguments(kernel_module):
    """iree-compile's command buffer of decode_bs1 through the kernels copies no page ids,
    positions or lengths: IREE 3.9 copies a batch-1 call's arguments into a transient buffer before
    each kernel dispatch that reads them unless they come from a dispatch
    (kernels.decode_indices; 117 copy commands a SmolLM2 step without it). Nor does it copy the
    token id: the embedding's gathers read the token's row at offsets a dispatch computes from it."""
    decode = _decode_bs1_commands(kernel_module("q8_0")[0].with_suffix(".mlir"))
    copies = re.findall(r"@hal\.command_buffer\.copy_buffer\(.*?, %c(\d+), %zero\)", decode)
    assert copies == [], f"copy commands in decode_bs1 of these byte counts: {copies}"


def test_a_decode_layer_is_one_dispatch(kernel_module):
    """Through the kernels a llama layer's decode step is one dispatch (the layer block: q/k/v with
    the attention norm, attention with rotary and the cache write, the output product with the
    residual, SwiGLU with the FFN norm, the down product with the residual). iree-compile's command
    buffer of decode_bs1 for the tiny llama (2 layers) holds them and the step's own 10 (the clamped
    page ids, positions and lengths of kernels.decode_indices, the rotary angles, the embedding's
    three: the token's row of each interleaved plane gathered at its offsets, d's and qs's, then
    dequantized; the final norm with the logits' product), and no fill: the blocks' phase counters
    are module globals the dispatches leave zeroed. (They were two dispatches a layer before the
    layer block, five before the attention and FFN blocks, six before the cache write moved into
    attention.)"""
    decode = _decode_bs1_commands(kernel_module("q8_0")[0].with_suffix(".mlir"))
    ordinals = re.findall(r"@hal\.command_buffer\.dispatch\(%\w+, %\w+, %(\w+),", decode)
    assert len(ordinals) == 2 + 10, f"decode_bs1 dispatches executables {ordinals}"
    assert "@hal.command_buffer.fill_buffer" not in decode


_DECODE_STEPS = """
import sys
import numpy as np
from iree import runtime
from sharkport.runtime.session import IreeSession

vmfb, irpa, config, out = sys.argv[1:5]
if len(sys.argv) > 5:  # IREE flags, such as the worker count
    runtime.flags.parse_flags(*sys.argv[5:])
session = IreeSession(vmfb, irpa, config, pages=16)
ids = [i % session.config.vocab_size for i in [3, 99, 14, 200, 7, 7, 51, 128, 60, 2, 31, 90, 17, 5, 250, 33, 8, 64,
                                               101, 12]]
pages = np.arange(4, dtype=np.int64)[:, None] * 2 + np.arange(2)
tokens = np.zeros((4, 16), np.int64)
tokens[:, :5] = ids[:5]
session.prefill(tokens, np.full(4, 5), pages[:, :1].copy())
logits = [np.array(session.decode(np.full((4, 1), ids[p]), np.full(4, p + 1), np.full(4, p),
                                  pages[:, :p // 16 + 1].copy()), copy=True) for p in range(5, 20)]
logits += [np.array(session.decode(np.full((1, 1), ids[p]), np.full(1, p + 1), np.full(1, p),
                                   pages[:1, :p // 16 + 1].copy()), copy=True) for p in range(5, 20)]
np.save(out, np.concatenate([x.reshape(-1) for x in logits]))
"""


def _decode_logits(module, tmp_path, name: str, *iree_flags: str) -> np.ndarray:
    """Logits of 15 decode steps at batch 4, then 15 at batch 1, of the tiny llama `module` (vmfb,
    irpa, config json) run in a process of its own, with `iree_flags` (and IREE's own topology)."""
    script, out = tmp_path / "decode_steps.py", tmp_path / f"{name}.npy"
    script.write_text(_DECODE_STEPS)
    env = {**os.environ, "SHARKPORT_KEEP_IREE_TOPOLOGY": "1"} if iree_flags else None
    subprocess.run([sys.executable, str(script), *map(str, module), str(out), *iree_flags], check=True, env=env,
                   timeout=600)
    return np.load(out)


def _export_without(names, irpa, tmp_path, stem: str, monkeypatch):
    """The tiny llama `irpa` exported with --matvec-kernels and the kernels functions `names`
    (kernels.layer_block, ...) declining, and compiled: (vmfb, irpa, config json)."""
    from sharkport.archive import Dataset
    from sharkport.compile import compile_mlir
    from sharkport.export import export_model, save_export

    with monkeypatch.context() as m:
        for name in names:
            m.setattr(kernels, name, lambda *args, **kwargs: None)
        # as kernel_module("q4_1"), less the prefill function _decode_logits does not call
        config = dataclasses.replace(TINY_EXPORT, matvec_kernels=True, bs_prefill=(4,))
        output, service = export_model(Dataset.load(irpa), config, exact_cache())
    save_export(output, service, tmp_path / f"{stem}.mlir", tmp_path / f"{stem}.json")
    compile_mlir(tmp_path / f"{stem}.mlir", tmp_path / f"{stem}.vmfb")
    return tmp_path / f"{stem}.vmfb", irpa, tmp_path / f"{stem}.json"


def test_blocks_compute_what_the_five_kernels_do_on_any_worker_count(kernel_module, quantized_tiny, monkeypatch,
                                                                      tmp_path):
    """The block kernels (a decode layer in one dispatch, or in two, each workgroup claiming the
    phases' items and waiting for the rest) give bit for bit the logits of the five dispatches a
    layer (layer, attention and FFN blocks left out), and so with IREE's workers at 1 (a block's
    workgroups one after the other: the first does every item, the second finds them done) or 3
    (more workers than workgroups) as with two: no wait needs another workgroup to run at once."""
    vmfb, irpa, config_json, _ = kernel_module("q4_1")
    five = _export_without(["layer_block", "attention_block", "ffn_block"], irpa, tmp_path, "five", monkeypatch)
    assert not re.search(r"sharkport_(layer|attention|ffn)_block_", five[0].with_suffix(".mlir").read_text())
    two = _export_without(["layer_block"], irpa, tmp_path, "two", monkeypatch)
    assert re.search(r"sharkport_attention_block_", two[0].with_suffix(".mlir").read_text())
    assert re.search(r"sharkport_ffn_block_", two[0].with_suffix(".mlir").read_text())

    want = _decode_logits(five, tmp_path, "five")
    assert np.abs(want).max() > 1  # logits, not zeros
    np.testing.assert_array_equal(_decode_logits(two, tmp_path, "two"), want, err_msg="two blocks a layer")
    for workers in (2, 1, 3):
        got = _decode_logits((vmfb, irpa, config_json), tmp_path, f"layer{workers}",
                             f"--task_topology_group_count={workers}")
        np.testing.assert_array_equal(got, want, err_msg=f"{workers} IREE workers")

    # exported for 3 CPUs: three spans of each product's chunks, of unequal lengths (the tiny
    # model's 64 outputs are two chunks, so one span is empty), whatever is left taken from the
    # other spans' backs, on 2 workers and on 1
    monkeypatch.setattr(kernels.layout, "cpus", lambda: 3)
    three = _export_without([], irpa, tmp_path, "three", monkeypatch)
    assert re.search(r"sharkport_layer_block_\w+_wg3", three[0].with_suffix(".mlir").read_text())
    for workers in (2, 1):
        got = _decode_logits(three, tmp_path, f"three{workers}", f"--task_topology_group_count={workers}")
        np.testing.assert_array_equal(got, want, err_msg=f"three workgroups on {workers} IREE workers")


def test_attention_items_split_among_more_workgroups_than_items(kernel_module, monkeypatch, tmp_path):
    """Exported for more CPUs than a block's attention items (the tiny llama's one kv head at batch
    1 on 4 CPUs), each item's pages are split into the parts kernels.attention_splits gives (4),
    which any workgroup takes and each merges before the output projection: the logits agree to
    float32 rounding with those of the export without blocks (whose attention is a dispatch of its
    own, unsplit), over one page and two (parts without a page among them), on 4, 2 and 1 IREE
    workers; the split op run eagerly decodes as it does."""
    _, irpa, _, _ = kernel_module("q4_1")
    monkeypatch.setattr(kernels.layout, "cpus", lambda: 4)
    assert kernels.layout.attention_splits(1, 4) == 4 and kernels.layout.attention_splits(4, 4) == 1
    split = _export_without([], irpa, tmp_path, "split", monkeypatch)
    assert re.search(r"sharkport_layer_block_\w+_m1_\w+_p4_wg4", split[0].with_suffix(".mlir").read_text())
    products = _export_without(["layer_block", "attention_block", "ffn_block"], irpa, tmp_path, "products",
                               monkeypatch)
    want = _decode_logits(products, tmp_path, "products")
    for workers in (4, 2, 1):
        got = _decode_logits(split, tmp_path, f"split{workers}", f"--task_topology_group_count={workers}")
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=f"{workers} workers")
    _eager_decodes_as_compiled(*split)


def test_block_attention_items_of_every_kv_head_split_by_pages(tiny, monkeypatch, tmp_path):
    """The tiny llama with 4 kv heads (Q4_1) exported for 2 CPUs: a block's attention at batch 1 is
    one item of all 4 kv heads whose pages are split in two (kernels.block_kv_heads_per_workgroup),
    where the export without blocks has an attention dispatch of 2 workgroups of 2 kv heads each; the
    logits agree to float32 rounding, over one page and two, on 2 IREE workers and on 1."""
    monkeypatch.setattr(kernels.layout, "cpus", lambda: 2)
    irpa, gguf_path = tmp_path / "q.irpa", tmp_path / "q.gguf"
    run("sharkport.tools.quantize", "--gguf-file", str(tiny["mha-tied"].gguf_path), "--type", "q4_1",
        "--output-irpa", str(irpa), "--output-gguf", str(gguf_path))
    blocks = _export_without([], irpa, tmp_path, "blocks", monkeypatch)
    assert re.search(r"sharkport_layer_block_\w+_m1_\w+_w4_\w+_p2_wg2", blocks[0].with_suffix(".mlir").read_text())
    products = _export_without(["layer_block", "attention_block", "ffn_block"], irpa, tmp_path, "products",
                               monkeypatch)
    assert re.search(r"sharkport_decode_attention\w*_w2", products[0].with_suffix(".mlir").read_text())
    want = _decode_logits(products, tmp_path, "products")
    for workers in (2, 1):
        got = _decode_logits(blocks, tmp_path, f"blocks{workers}", f"--task_topology_group_count={workers}")
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=f"{workers} workers")


def test_layer_block_run_eagerly_decodes_as_compiled(kernel_module):
    """The layer block's op run eagerly (what tracing falls back on outside IREE: the products as
    the kernels compute them, attention writing the cache in place) gives the compiled module's
    decode logits, step after step at batch 4 over two pages, after the same prefill (the kernels'
    products run eagerly too)."""
    vmfb, irpa, config_json, _ = kernel_module("q4_1")
    _eager_decodes_as_compiled(vmfb, irpa, config_json)


def _eager_decodes_as_compiled(vmfb, irpa, config_json):
    """The kernel model of `irpa` run eagerly decodes as the compiled module does (see
    test_layer_block_run_eagerly_decodes_as_compiled)."""
    from sharkport.archive import Dataset
    from sharkport.models import build_model
    from sharkport.runtime.session import IreeSession

    session = IreeSession(vmfb, irpa, config_json, pages=TINY_EXPORT.device_block_count)
    kernel_model = use_kernels(build_model(Dataset.load(irpa), exact_cache()))  # as kernel_module("q4_1")
    cache = kernel_model.new_cache(TINY_EXPORT.device_block_count)
    ids = [i % session.config.vocab_size
           for i in [3, 99, 14, 200, 7, 7, 51, 128, 60, 2, 31, 90, 17, 5, 250, 33, 8, 64, 101, 12]]
    pages = np.arange(4, dtype=np.int64)[:, None] * 2 + np.arange(2)
    tokens = np.zeros((4, TINY_EXPORT.block_seq_stride), np.int64)
    tokens[:, :5] = ids[:5]
    session.prefill(tokens, np.full(4, 5), pages[:, :1].copy())
    with torch.no_grad():
        kernel_model.prefill(torch.from_numpy(tokens), torch.full((4,), 5), torch.from_numpy(pages[:, :1].copy()),
                             cache)
        for pos in range(5, len(ids)):
            args = (np.full((4, 1), ids[pos]), np.full(4, pos + 1), np.full(4, pos), pages[:, :pos // 16 + 1].copy())
            want = np.array(session.decode(*args), copy=True)
            got = kernel_model.decode(*(torch.from_numpy(a) for a in args), cache).numpy()
            np.testing.assert_allclose(got.reshape(want.shape), want, rtol=0, atol=1e-4 * np.abs(want).max(),
                                       err_msg=f"position {pos}")


# the tiny llama as llama.cpp's mixtures of SmolLM2's 576-wide matrices: Q5_1 q, k, output and
# down projections, a Q8_0 v, Q5_0 gate and up (24 planes, the most one dispatch takes:
# kernels.MIXED_LAYER_PLANES); and the tiny qwen2 (q, k and v biases) at Q5_0 with a Q8_0 v, as
# Qwen2.5's files (20 planes and its biases' buffer)
MIXED_TINY = {"gqa-untied": [r"attn_(q|k|output)\.|ffn_down\.=q5_1", r"attn_v\.=q8_0"],
              "qwen2": [r"attn_v\.=q8_0"]}


# extended for the suite's time: the block without biases (gqa-untied) stays in the suite through
# test_layer_through_the_compiled_kernels_computes_as_transformers[IQ4_XS]
@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.extended if v == "gqa-untied" else ())
                                     for v in MIXED_TINY])
def test_a_layer_of_mixed_types_is_one_dispatch(variant, tiny, monkeypatch, tmp_path):
    """The tiny llamas of MIXED_TINY exported with the kernels: decode's layer is the layer block
    of mixed types (q and k in one phase, v in one of its own; the biases added in the block),
    whose logits are bit for bit those of the export without blocks (a dispatch a product, each
    normalizing x, the biases added after them), at batch 4 and 1 over two pages, on two IREE
    workers and on one (the workgroups one after the other); its op run eagerly decodes as it
    does."""
    from tiny_models import TinyRecipes

    model = tiny[variant] if variant == "gqa-untied" else TinyRecipes(tmp_path / "recipe")[variant]
    gguf_path = model.gguf_path
    irpa = tmp_path / "mixed.irpa"
    run("sharkport.tools.quantize", "--gguf-file", str(gguf_path), "--type", "q5_0",
        *(a for rule in MIXED_TINY[variant] for a in ("--type-map", rule)), "--output-irpa", str(irpa))
    assert sum(len(kernels.PLANES[t]) for t in ("Q5_1", "Q5_1", "Q8_0", "Q5_1", "Q5_0", "Q5_0", "Q5_1")) == \
        kernels.MIXED_LAYER_PLANES
    products = _export_without(["layer_block", "attention_block", "ffn_block"], irpa, tmp_path, "products",
                               monkeypatch)
    mixed = _export_without([], irpa, tmp_path, "mixed", monkeypatch)
    assert not re.search(r"sharkport_\w+_block", products[0].with_suffix(".mlir").read_text())
    block = "layer_block_mixed_bias" if variant == "qwen2" else "layer_block_mixed"
    assert re.search(rf"@sharkport_{block}\(", mixed[0].with_suffix(".mlir").read_text())
    want = _decode_logits(products, tmp_path, "products")
    assert np.abs(want).max() > 0.1  # logits, not zeros
    for workers in (2, 1):
        got = _decode_logits(mixed, tmp_path, f"mixed{workers}", f"--task_topology_group_count={workers}")
        np.testing.assert_array_equal(got, want, err_msg=f"{workers} IREE workers")
    _eager_decodes_as_compiled(*mixed)


def test_blocks_take_no_x_their_workgroups_cannot_hold():
    """A block takes decode's products only where each one's x fits a workgroup's stack
    (kernels.x_on_stack): else it would read its weights once for each part of x (four rows of a
    4128-wide x are two), where a product's own dispatch takes x in one pass (its scratch)."""
    E, I = 64, kernels.MAX_K // 4 + 32
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(I, E, generator=gen).half() for _ in range(2))
    down = torch.randn(E, I, generator=gen).half()
    for rows, taken in ((3, True), (4, False)):
        y = kernels.ffn_block(torch.randn(rows, E, generator=gen), (torch.ones(E), 1e-6), gate, up, down)
        assert (y is not None) == taken, rows


def test_interleaved_rows_are_read_from_the_archive_as_stored(kernel_module, quantized_tiny, monkeypatch, tmp_path):
    """Q4 products read their weights with rows interleaved eight at a time as the archive holds
    them (`:x8` parameters): the program permutes no weight, so the module maps the archive and
    makes no copy as it loads. Planes held in row order are permuted in the program, a transpose
    of each parameter, which IREE hoists into the module's initializer (a copy of each)."""
    from sharkport.archive import Dataset
    from sharkport.export import export_model, save_export

    def permutes(mlir):  # the embedding's gathers permute the rows they gather, as both programs do
        return mlir.count("torch.aten.permute")

    mlir = kernel_module("q4_1")[0].with_suffix(".mlir").read_text()
    assert "sharkport_layer_block_q4_1x8(" in mlir and '"model"::"blk.0.ffn_up.weight:qs:x8"' in mlir
    x8 = len(re.findall(r'"model"::"[^"]*:x8"', mlir))  # planes read with rows interleaved
    dataset = Dataset.load(quantized_tiny("q4_1")[1])
    row_order = {n: w.row_order() if isinstance(w, QuantizedTensor) else w for n, w in dataset.theta.items()}
    output, service = export_model(dataclasses.replace(dataset, theta=Theta(row_order)),
                                   dataclasses.replace(TINY_EXPORT, matvec_kernels=True), exact_cache())
    save_export(output, service, tmp_path / "permuted.mlir", tmp_path / "permuted.json")
    permuted = (tmp_path / "permuted.mlir").read_text()
    assert "sharkport_layer_block_q4_1x8(" in permuted and ":x8" not in permuted
    assert permutes(permuted) >= permutes(mlir) + x8, "the weights permuted in the program"


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q5_0"])
def test_interleaved_rows_read_as_the_weights_as_stored(kind):
    """quant.interleave_planes puts 4 bytes of each of eight rows' block b side by side (chunk j of
    row r at byte 32 j + 4 r of the group's block; Q5's fifth bits placed by value), and the eager form of the interleaved kernels
    (what tracing falls back on outside IREE) computes the same product as the stored kernels'."""
    from sharkport.kernels.ops import OPS

    from sharkport.quant import interleave_planes

    rng = np.random.default_rng(3)
    n, k = 16, 96
    w = weight_from_raw(kind, (n, k), quantize_array(rng.standard_normal((n, k)).astype(np.float32), kind))
    assert w.interleaved  # as an archive holds it
    planes = [w.row_order().planes[p] for p in kernels.PLANES[kind]]
    mixed = [interleave_planes(kind, w.row_order().planes)[p] for p in kernels.PLANES[kind]]
    assert all(torch.equal(a, w.planes[p]) for a, p in zip(mixed, kernels.PLANES[kind]))
    size = planes[0].shape[2]  # bytes of a row's block
    qs, group1 = mixed[0].reshape(-1), 8 * size * (k // 32)  # bytes of a group of eight rows
    chunk = group1 + 2 * 8 * size + 32 * 3 + 4 * 5  # row 13 (5 of the second group), block 2, chunk 3
    assert torch.equal(qs[chunk:chunk + 4], planes[0][8 + 5, 2, 12:16])
    assert torch.equal(mixed[1].reshape(-1)[8 * 2 + 6], planes[1][6, 2])  # row 6's scale of block 2
    if kind == "Q5_0":  # and its 4 bytes of fifth bits, value 4j + t's at bit 2j of byte t, 16 + 4j + t's at 2j + 1
        stored = int.from_bytes(bytes(planes[2][6, 2].tolist()), "little")
        placed = mixed[2].reshape(-1)[4 * (8 * 2 + 6):4 * (8 * 2 + 7)].tolist()
        for v in range(32):
            t, j, high = v % 4, v // 4 % 4, v // 16
            assert (placed[t] >> (2 * j + high)) & 1 == (stored >> v) & 1, f"value {v}'s fifth bit"
    x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32))
    torch.testing.assert_close(OPS[kernels.INTERLEAVED[kind], "matvec"](x, *mixed), OPS[kind, "matvec"](x, *planes),
                               rtol=0, atol=0)


def test_mlir_naming_a_kernel_object_no_longer_built_says_so(tmp_path):
    """An MLIR exported with another version of matvec.c names that version's object (by its
    hash), which this one does not build: compile_mlir says so in one line naming it, where
    iree-compile would fail on the missing file, and writes nothing."""
    from sharkport.compile import compile_mlir
    from sharkport.errors import SharkportError

    mlir, vmfb = tmp_path / "old.mlir", tmp_path / "old.vmfb"
    mlir.write_text('// calls sharkport_matvec_q4_1\n#object = #hal.executable.object<{path = "matvec-0123456789abcdef.o"}>\n')
    assert kernels.objects_named_by(mlir) == {"matvec-0123456789abcdef.o"}
    with pytest.raises(SharkportError) as e:
        compile_mlir(mlir, vmfb)
    message = str(e.value)
    assert "\n" not in message and str(mlir) in message and "matvec-0123456789abcdef.o" in message, message
    assert "export the model again" in message and kernels.object_name() in message, message
    assert not vmfb.exists()


def _failed_kernel_export(tiny, tmp_path, **env) -> str:
    """The last stderr line of an export with --matvec-kernels that must fail (exit 2, no
    traceback, no MLIR written) under these environment variables."""
    proc = subprocess.run(
        [sys.executable, "-m", "sharkport.export", "--gguf-file", str(tiny["gqa-untied"].gguf_path),
         "--output-mlir", str(tmp_path / "m.mlir"), "--output-config", str(tmp_path / "m.json"),
         "--bs-prefill", "1", "--bs-decode", "1", "--max-seq-len", "64", "--matvec-kernels"],
        capture_output=True, text=True, env=dict(os.environ, **env), timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "m.mlir").exists()
    return proc.stderr.strip().splitlines()[-1]


def test_missing_c_compiler_is_one_line(tiny, tmp_path):
    line = _failed_kernel_export(tiny, tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert "C compiler" in line and "no-such-cc" in line, line


def test_unknown_kernel_isa_is_one_line(tiny, tmp_path):
    """SHARKPORT_KERNEL_ISA names the instruction set the kernels are built for; anything else is
    one line naming the variable and the choices, before anything is written."""
    line = _failed_kernel_export(tiny, tmp_path, SHARKPORT_KERNEL_ISA="sse2")
    assert "SHARKPORT_KERNEL_ISA" in line and "'sse2'" in line and "avx2" in line and "avx512" in line, line


def test_unknown_kernel_products_is_one_line(tiny, tmp_path):
    line = _failed_kernel_export(tiny, tmp_path, SHARKPORT_KERNEL_PRODUCTS="half")
    assert "SHARKPORT_KERNEL_PRODUCTS" in line and "'half'" in line and "full" in line and "none" in line, line


def test_failed_kernel_build_is_one_line(tiny, tmp_path):
    """A compiler that fails (here `false`) is one line naming it and matvec.c; for an AVX-512
    build it says how to build without AVX-512 (a compiler too old for it fails so)."""
    false = shutil.which("false")
    line = _failed_kernel_export(tiny, tmp_path, CC=false, SHARKPORT_KERNEL_ISA="avx512")
    assert f"{false} failed to compile" in line and "matvec.c" in line, line
    assert "SHARKPORT_KERNEL_ISA=avx2" in line and "--no-matvec-kernels" in line, line
    assert not list(kernels.cache_dir().glob("*.part*.o")) and not list(kernels.cache_dir().glob("*.tmp"))


def test_each_kernel_is_built_in_one_part_and_the_object_holds_them_all():
    """matvec.c builds as build.PARTS objects at once (-DSHARKPORT_PART=k), combined into one: each
    exported kernel is defined in exactly one part, the parts define every kernel the whole file
    does, and the combined object (what iree-compile links) holds each of them."""
    from sharkport.kernels import build

    cc = os.environ.get("CC", "cc")

    def defined(part: int) -> list[str]:
        run = subprocess.run([cc, *kernels.cflags(), f"-DSHARKPORT_PART={part}", "-E", "-P", str(build.SOURCE)],
                             capture_output=True, text=True, check=True)
        return re.findall(r"\bvoid (sharkport_\w+)\(", run.stdout)

    whole = defined(-1)
    parts = [name for k in range(build.PARTS) for name in defined(k)]
    assert build.PARTS > 1 and len(set(whole)) == len(whole) > 100
    assert sorted(parts) == sorted(whole)
    nm = subprocess.run(["nm", str(kernels.object_path())], capture_output=True, text=True, check=True).stdout
    assert set(whole) <= {line.split()[-1] for line in nm.splitlines() if " T " in line}


def test_each_kernel_isa_builds_its_own_object(monkeypatch):
    """The object's name hashes its flags: an AVX2 build and an AVX-512 build are two objects, so
    an MLIR links the one it was exported with."""
    names = {}
    for isa in kernels.ISA_FLAGS:
        monkeypatch.setenv(kernels.ISA_ENV, isa.upper())
        assert kernels.isa() == isa and kernels.cflags() == kernels.CFLAGS + kernels.ISA_FLAGS[isa]
        names[isa] = kernels.object_name()
    for mode in ("loads", "none"):  # the measuring aid's objects (tools/bench_bounds.py)
        monkeypatch.setenv(kernels.PRODUCTS_ENV, mode)
        names[mode] = kernels.object_name()
    assert len(set(names.values())) == len(names), names
