"""Every ggml type through the compiled module: the planes are read from the archive as external
parameters and dequantized inside the IREE program, bit-for-bit as gguf.quants does; one row by a
matrix of a type quant.product_op takes is one dispatch that matches gguf.quants' values; and a tiny
llama whose matrices each use a different type compiles and matches the eager recipe."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from iree.turbine import aot
from iree.turbine.aot import FxProgramsBuilder

from sharkport.archive import Dataset, QuantizedTensor, import_gguf
from sharkport.compile import compile_mlir
from sharkport.export import ExportConfig, export_model, externalize, save_export
from sharkport.models import ModelConfig, build_model
from sharkport.quant import BLOCK_TYPES, product_op
from sharkport.runtime.eager import EagerSession
from sharkport.runtime.session import IreeSession

from gguf_fixtures import random_blocks, random_tensor, write_gguf

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

QUANT_TYPES = sorted(BLOCK_TYPES)
SHAPE = (4, 512)  # two K-quant super-blocks per row


def _params(names):
    return [pytest.param(n, id=n) for n in names]


def _run_iree(vmfb, irpa, fn_name: str, *args) -> np.ndarray:
    import iree.runtime as rt

    config = rt.Config("local-task")
    index = rt.ParameterIndex()
    index.load(str(irpa), mmap=True)
    params = rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope="model"))
    hal = rt.create_hal_module(config.vm_instance, config.device)
    main = rt.VmModule.mmap(config.vm_instance, str(vmfb))
    module = rt.load_vm_modules(params, hal, main, config=config)[-1]
    result = module[fn_name](*args)
    return np.array(result.to_host(), copy=True)  # to_host() is a view of a buffer we drop


def _external_archive(root, name: str, shape, types, seed: int):
    """A GGUF with a tensor `{name}.{type}` of random blocks for each of `types` → an .irpa →
    (gguf path, irpa path, its Dataset with the tensors as external parameters)."""
    rng = np.random.default_rng(seed)
    gguf_path = write_gguf(root / f"{name}.gguf", {f"{name}.{t}": (t, shape, random_blocks(t, shape, rng)) for t in types})
    irpa = root / f"{name}.irpa"
    import_gguf(gguf_path, irpa, progress=False)
    dataset = Dataset.load(irpa)
    externalize(dataset)
    return gguf_path, irpa, dataset


def _save(fxb: FxProgramsBuilder, mlir):
    with torch.no_grad():
        aot.export(fxb).save_mlir(mlir)
    return mlir


@pytest.fixture(scope="module", params=["llvm-cpu", "llvm-cpu-lean"])
def dequant_module(request, tmp_path_factory):
    """A GGUF with one tensor per block type → .irpa → a module with `dequant_<type>(rows)`
    functions that gather rows of the external planes and dequantize them in the graph: for
    llvm-cpu, which may unpack the planes at load, and for llvm-cpu-lean, which reads them as
    stored in every call."""
    root = tmp_path_factory.mktemp("dequant")
    gguf_path, irpa, dataset = _external_archive(root, "t", SHAPE, QUANT_TYPES, seed=7)
    fxb = FxProgramsBuilder(torch.nn.Module())
    rows = torch.zeros(SHAPE[0], dtype=torch.int64)
    for t in QUANT_TYPES:
        w = dataset.theta[f"t.{t}"]
        assert isinstance(w, QuantizedTensor)

        @fxb.export_program(name=f"dequant_{t}", args=(rows,), strict=False)
        def _dequant(module, ids, w=w):
            return w.rows(ids)

    vmfb = root / "types.vmfb"
    compile_mlir(_save(fxb, root / "types.mlir"), vmfb, request.param)
    return gguf_path, irpa, vmfb


@pytest.mark.parametrize("type_name", _params(QUANT_TYPES))
def test_compiled_dequant_is_bit_exact(dequant_module, type_name):
    gguf_path, irpa, vmfb = dequant_module
    reader = gguf.GGUFReader(gguf_path)
    t = next(t for t in reader.tensors if t.name == f"t.{type_name}")
    expected = quants.dequantize(t.data, t.tensor_type).reshape(SHAPE)
    ids = np.array([3, 0, 2, 1], dtype=np.int64)  # out of order: the gather is real
    got = _run_iree(vmfb, irpa, f"dequant_{type_name}", ids)
    assert got.dtype == np.float32 and got.shape == SHAPE
    np.testing.assert_array_equal(got.view(np.uint32), expected[ids].view(np.uint32))


PRODUCT_SHAPE = (24, 512)  # three groups of eight interleaved rows


@pytest.fixture(scope="module")
def product_module(tmp_path_factory):
    """A GGUF with a matrix of each of product_op.TYPES → .irpa (rows interleaved) → the MLIR of
    `product_<type>(x)`: one row x [1, K] times the external matrix, through product_op."""
    root = tmp_path_factory.mktemp("product")
    gguf_path, irpa, dataset = _external_archive(root, "w", PRODUCT_SHAPE, product_op.TYPES, seed=5)
    fxb = FxProgramsBuilder(torch.nn.Module())
    x = torch.zeros(1, PRODUCT_SHAPE[1])
    for t in product_op.TYPES:
        w = dataset.theta[f"w.{t}"]
        assert product_op.applies(x, w)

        @fxb.export_program(name=f"product_{t}", args=(x,), strict=False)
        def _product(module, rows, w=w):
            return product_op.product(rows, w)

    return gguf_path, irpa, _save(fxb, root / "w.mlir")


@pytest.fixture(scope="module")
def product_lean(product_module):
    """product_module compiled for llvm-cpu-lean: (gguf path, irpa path, vmfb)."""
    gguf_path, irpa, mlir = product_module
    vmfb = mlir.with_suffix(".vmfb")
    compile_mlir(mlir, vmfb, "llvm-cpu-lean")
    return gguf_path, irpa, vmfb


@pytest.mark.parametrize("spec", ["llvm-cpu-lean", "cuda:sm_90", "rocm:gfx942", "vulkan"])
def test_one_row_product_is_one_dispatch(product_module, spec, tmp_path):
    """The dequantization and the product share a dispatch on every target that keeps the weights
    as stored, where the two apart write the whole matrix in float32 and read it back."""
    _, _, mlir = product_module
    flow = tmp_path / "flow.mlir"
    compile_mlir(mlir, flow, spec, ["--compile-to=flow"])
    text = flow.read_text()
    for t in product_op.TYPES:
        body = text.split(f"@product_{t}$async(", 1)[1].split("util.return", 1)[0]
        assert body.count("flow.dispatch @") == 1, t
    compile_mlir(mlir, tmp_path / "w.vmfb", spec)


@pytest.mark.parametrize("type_name", _params(product_op.TYPES))
def test_one_row_product_matches_gguf_quants(product_lean, type_name):
    gguf_path, irpa, vmfb = product_lean
    reader = gguf.GGUFReader(gguf_path)
    t = next(t for t in reader.tensors if t.name == f"w.{type_name}")
    w = quants.dequantize(t.data, t.tensor_type).reshape(PRODUCT_SHAPE).astype(np.float64)
    x = np.random.default_rng(9).standard_normal((1, PRODUCT_SHAPE[1])).astype(np.float32)
    got = _run_iree(vmfb, irpa, f"product_{type_name}", x)
    expected = x.astype(np.float64) @ w.T
    assert got.shape == (1, PRODUCT_SHAPE[0])
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


# ---------------------------------------------------------------------------------------------
# A tiny llama with every type: hidden 256 and ffn 512, so every matrix row holds whole
# K-quant super-blocks.
# ---------------------------------------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 256
HEAD_DIM = HIDDEN // HEADS
PLAIN = ["F32", "F16", "BF16"]
STRIDE, PAGES = 16, 8
EXPORT = ExportConfig(bs_prefill=(1,), bs_decode=(1,), block_seq_stride=STRIDE,
                      device_block_count=PAGES, max_seq_len=STRIDE * 4)


def _matrices() -> dict[str, tuple[int, int]]:
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    return shapes


@pytest.fixture(scope="module")
def mixed_llama(tmp_path_factory):
    """The tiny llama's GGUF: its 16 matrices cycle through all 13 types (norms stay F32)."""
    root = tmp_path_factory.mktemp("mixed_llama")
    rng = np.random.default_rng(11)
    types = QUANT_TYPES + PLAIN
    tensors = {}
    for k, (name, shape) in enumerate(_matrices().items()):
        t = types[k % len(types)]
        tensors[name] = (t, shape, random_tensor(t, shape, rng, std=0.05))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = ("F32", (HIDDEN,), rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    tensors["output_norm.weight"] = ("F32", (HIDDEN,), rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    meta = {
        "llama.block_count": LAYERS, "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS, "llama.context_length": 256,
        "llama.rope.dimension_count": HEAD_DIM, "llama.vocab_size": VOCAB,
    }
    gguf_path = write_gguf(root / "mixed.gguf", tensors, meta)
    assert {t for t, _, _ in tensors.values()} == set(types)
    irpa = root / "mixed.irpa"
    import_gguf(gguf_path, irpa, progress=False)
    return root, irpa


@pytest.fixture(scope="module")
def mixed_llama_export(mixed_llama):
    """The tiny llama's exported program (MLIR), its service config and that config's path."""
    root, irpa = mixed_llama
    output, service = export_model(Dataset.load(irpa), EXPORT)
    mlir, config = root / "m.mlir", root / "m.json"
    save_export(output, service, mlir, config)
    return mlir, service, config


def test_functions_share_the_dequantization_constants(mixed_llama_export):
    """prefill and decode name the same constant for the same table, so IREE sees one expression
    per weight across functions (and llvm-cpu packs each weight once, not once per function)."""
    import re

    text = mixed_llama_export[0].read_text()
    blobs = re.findall(r'^\s*[\w.]+: "(0x[0-9A-Fa-f]*)"', text.rpartition("{-#")[2], re.M)
    used = set(re.findall(r"dense_resource<([\w.]+)>", text))
    assert len(blobs) == len(set(blobs)) == len(used) > 1
    assert re.search(r"func.func @prefill_bs1", text) and re.search(r"func.func @decode_bs1", text)


@pytest.mark.parametrize("spec", ["llvm-cpu-lean", "cuda:sm_90", "rocm:gfx942", "vulkan"])
def test_weights_stay_as_stored(mixed_llama_export, spec, tmp_path):
    """The lean CPU and GPU targets keep no load-time copy of any weight: IREE's global
    optimization, left to itself, hoists the unpacking of every type's planes into initializers
    that run at load (thousands for a K-quant model)."""
    mlir = mixed_llama_export[0]

    def hoisted(flags: list[str]) -> int:
        out = tmp_path / "global-opt.mlir"
        compile_mlir(mlir, out, spec, [*flags, "--compile-to=global-optimization"])
        return out.read_text().count("util.global private @__hoisted")

    assert hoisted([]) == 0
    if spec == "llvm-cpu-lean":  # with IREE's default the count tells them apart
        assert hoisted(["--iree-opt-const-expr-hoisting=true"]) > 0


@pytest.mark.extended  # every type is compiled by test_compiled_dequant_is_bit_exact already
@pytest.mark.parametrize("spec", ["llvm-cpu", "llvm-cpu-lean"])
def test_mixed_type_llama_compiled_matches_eager(mixed_llama, mixed_llama_export, spec, tmp_path):
    mlir, service, config = mixed_llama_export
    _compiled_matches_eager(mixed_llama[1], mlir, service, config, spec, tmp_path)


def test_stored_products_match_eager(mixed_llama, tmp_path):
    """Exported for a target that keeps the weights as stored, the tiny llama's decode takes its
    one-row products by the Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 matrices through product_op (one for
    each), and its lean CPU module matches the eager recipe."""
    import dataclasses
    import re

    root, irpa = mixed_llama
    output, service = export_model(Dataset.load(irpa), dataclasses.replace(EXPORT, dequant_in_products=True))
    mlir, config = tmp_path / "m.mlir", tmp_path / "m.json"
    save_export(output, service, mlir, config)
    assert len(set(re.findall(r"util.func private @(sharkport_product_\w+)", mlir.read_text()))) == len(product_op.TYPES)
    _compiled_matches_eager(irpa, mlir, service, config, "llvm-cpu-lean", tmp_path)


def _compiled_matches_eager(irpa, mlir, service, config, spec: str, tmp_path) -> None:
    vmfb = tmp_path / "m.vmfb"
    compile_mlir(mlir, vmfb, spec)

    model = build_model(Dataset.load(irpa), ModelConfig(block_seq_stride=STRIDE))
    sessions = [EagerSession(model, service, pages=PAGES), IreeSession(vmfb, irpa, config, pages=PAGES)]
    prompt = np.random.default_rng(3).integers(0, VOCAB, 21)
    tokens = np.zeros((1, 2 * STRIDE), np.int64)
    tokens[0, :21] = prompt
    pages = np.array([[5, 0]], np.int64)
    prefill = [s.prefill(tokens, np.array([21]), pages) for s in sessions]
    _assert_close(prefill[1][0, :21], prefill[0][0, :21])
    for step in range(4):  # decode continues each session's own cache
        pos = 21 + step
        next_token = np.array([[int(prefill[0][0, 20].argmax()) if step == 0 else 7 * step]], np.int64)
        decode = [s.decode(next_token, np.array([pos + 1]), np.array([pos]), pages) for s in sessions]
        _assert_close(decode[1], decode[0])


def _assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    scale = np.abs(expected).max()
    assert scale > 0.1, "logits are degenerate; the check would be vacuous"
    assert np.abs(got - expected).max() <= 1e-3 * scale
