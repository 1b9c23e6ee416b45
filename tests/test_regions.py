"""Ops traced as dispatch regions of their own (sharkport.ops.regions).

* SwiGLU's silu(g) * u over a dynamic number of rows (prefill): the exported MLIR holds the
  region, and the compiled module gives the same values, bit for bit, as the same product traced
  as torch ops, and torch's within float rounding, at several row counts.
* Decode's RMSNorm, alone and after the residual add, while exporting with the matvec kernels:
  one region each in the MLIR; compiled, transformers' LlamaRMSNorm's values within float
  rounding at batch 1 and 4."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from iree.turbine import aot
from iree.turbine.aot import FxProgramsBuilder

from sharkport.compile import compile_mlir
from sharkport.export.kernels import KernelRMSNorm
from sharkport.layers import Linear, RMSNorm
from sharkport.ops import silu_gate

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

K, N = 64, 96


def _export(path, gate, up, plain: bool):
    """A module with `swiglu(x [M, K]) -> [M, N]`, M dynamic: through ops.silu_gate (its products
    layers.Linear), or (plain) the same product as torch ops."""
    fxb = FxProgramsBuilder(torch.nn.Module())
    m = torch.export.Dim("m", min=1, max=4096)

    @fxb.export_program(name="swiglu", args=(torch.zeros(8, K),), dynamic_shapes={"x": {0: m}}, strict=False)
    def _swiglu(module, x):
        if plain:
            return torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())
        return silu_gate(x, Linear(gate), Linear(up))

    with torch.no_grad():
        text = str(aot.export(fxb).mlir_module)
    path.write_text(text)
    return text


def _run(vmfb, x):
    import iree.runtime as rt

    config = rt.Config("local-task")
    hal = rt.create_hal_module(config.vm_instance, config.device)
    main = rt.VmModule.mmap(config.vm_instance, str(vmfb))
    module = rt.load_vm_modules(hal, main, config=config)[-1]
    return np.array(module["swiglu"](x).to_host(), copy=True)  # to_host() is a view of a buffer we drop


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    root = tmp_path_factory.mktemp("regions")
    rng = np.random.default_rng(5)
    gate, up = (torch.from_numpy(rng.standard_normal((N, K), dtype=np.float32)) for _ in range(2))
    out = {}
    for name, plain in (("region", False), ("plain", True)):
        mlir, vmfb = root / f"{name}.mlir", root / f"{name}.vmfb"
        out[name] = _export(mlir, gate, up, plain)
        compile_mlir(mlir, vmfb)
        out[name + ".vmfb"] = vmfb
    return gate, up, out


def test_the_product_traces_as_a_region(modules):
    _, _, out = modules
    assert f"util.func private @sharkport_silu_mul_{N}(" in out["region"]
    assert "flow.dispatch.region" in out["region"]
    assert "flow.dispatch.region" not in out["plain"] and "torch.aten.silu" in out["plain"]


@pytest.mark.parametrize("rows", [1, 7, 128, 300])
def test_compiled_region_equals_the_traced_ops_and_torch(modules, rows):
    gate, up, out = modules
    x = np.random.default_rng(rows).standard_normal((rows, K), dtype=np.float32) * 2
    got = _run(out["region.vmfb"], x)
    np.testing.assert_array_equal(got.view(np.uint32), _run(out["plain.vmfb"], x).view(np.uint32))
    t = torch.from_numpy(x)
    want = (torch.nn.functional.silu(t @ gate.t()) * (t @ up.t())).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


E, EPS = 96, 1e-5


@pytest.fixture(scope="module")
def norm_module(tmp_path_factory):
    """`norm_bs{B}(h [B, 1, E]) -> rms_norm(h)` and `post_bs{B}(r, h) -> r + rms_norm(h)` (a
    post-norm with its residual add, KernelRMSNorm.add_to) for B 1 and 4, traced as the exporter
    traces decode (the export's kernel norm, KernelRMSNorm)."""
    root = tmp_path_factory.mktemp("norms")
    w = torch.from_numpy(np.random.default_rng(11).uniform(0.5, 1.5, E).astype(np.float32))
    fxb = FxProgramsBuilder(torch.nn.Module())
    norm = KernelRMSNorm(RMSNorm(w, EPS))
    for b in (1, 4):
        h = torch.zeros(b, 1, E)

        @fxb.export_program(name=f"norm_bs{b}", args=(h,), strict=False)
        def _norm(module, h):
            return norm(h)

        @fxb.export_program(name=f"post_bs{b}", args=(torch.zeros(b, 1, E), h), strict=False)
        def _post(module, r, h):
            return norm.add_to(r, h)

    with torch.no_grad():
        text = str(aot.export(fxb).mlir_module)
    mlir, vmfb = root / "norms.mlir", root / "norms.vmfb"
    mlir.write_text(text)
    compile_mlir(mlir, vmfb)
    return w, text, vmfb


def test_decode_norms_trace_as_regions(norm_module):
    _, text, _ = norm_module
    for b in (1, 4):
        assert f"util.func private @sharkport_rms_norm_{b}x{E}_" in text
        assert f"util.func private @sharkport_add_rms_norm_{b}x{E}_" in text
    assert text.count("flow.dispatch.region") == 4 and "torch.aten.rsqrt" not in text


@pytest.mark.parametrize("batch", [1, 4])
def test_compiled_decode_norms_equal_transformers(norm_module, batch):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    import iree.runtime as rt

    w, _, vmfb = norm_module
    reference = LlamaRMSNorm(E, eps=EPS)
    with torch.no_grad():
        reference.weight.copy_(w)
    rng = np.random.default_rng(batch)
    h = rng.standard_normal((batch, 1, E), dtype=np.float32) * 3
    small = h * 1e-3  # mean square about 1e-5: eps counts
    config = rt.Config("local-task")
    main = rt.VmModule.mmap(config.vm_instance, str(vmfb))
    module = rt.load_vm_modules(rt.create_hal_module(config.vm_instance, config.device), main, config=config)[-1]
    for x in (h, small):
        normed = np.array(module[f"norm_bs{batch}"](x).to_host(), copy=True)
        with torch.no_grad():
            want = reference(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(normed, want, rtol=1e-6, atol=1e-6)
        r = rng.standard_normal(x.shape, dtype=np.float32)
        added = np.array(module[f"post_bs{batch}"](r, x).to_host(), copy=True)
        np.testing.assert_allclose(added, r + want, rtol=1e-6, atol=1e-6)
