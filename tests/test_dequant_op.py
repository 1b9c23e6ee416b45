"""Q8_0, Q4_0 and Q4_1 weights dequantize as one traced node (sharkport.quant.dequant_op): the
exported MLIR calls the op's function instead of tracing shifts, masks and casts, and the values
equal gguf.quants' dequantization. (tests/test_quant_compiled.py compiles the op's MLIR body for
every type and checks it bit for bit.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from iree.turbine import aot
from iree.turbine.aot import FxProgramsBuilder

from sharkport.archive import Dataset, import_gguf
from sharkport.export import externalize
from sharkport.ops import dense

from gguf_fixtures import random_blocks, write_gguf

TYPES = ["Q8_0", "Q4_0", "Q4_1"]
SHAPE = (6, 512)  # 16 blocks per row


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("dequant_op")
    rng = np.random.default_rng(3)
    gguf_path = write_gguf(root / "w.gguf", {f"w.{t}": (t, SHAPE, random_blocks(t, SHAPE, rng)) for t in TYPES})
    import_gguf(gguf_path, root / "w.irpa", progress=False)
    return gguf.GGUFReader(gguf_path), Dataset.load(root / "w.irpa")


@pytest.mark.parametrize("type_name", TYPES)
def test_eager_values_equal_gguf(weights, type_name):
    reader, dataset = weights
    t = next(t for t in reader.tensors if t.name == f"w.{type_name}")
    expected = quants.dequantize(t.data, t.tensor_type).reshape(SHAPE)
    got = dense(dataset.theta[f"w.{type_name}"], torch.float32).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_export_traces_one_op_per_weight(weights):
    _, dataset = weights
    externalize(dataset)
    fxb = FxProgramsBuilder(torch.nn.Module())
    x = torch.zeros(2, SHAPE[1])
    for t in TYPES:
        w = dataset.theta[f"w.{t}"]

        @fxb.export_program(name=f"mm_{t}", args=(x,), strict=False)
        def _mm(module, x, w=w):
            return torch.mm(x, dense(w, torch.float32).t())

    with torch.no_grad():
        text = str(aot.export(fxb).mlir_module)
    for t in TYPES:
        assert f"util.func private @sharkport_dequant_{t.lower()}_6x16(" in text
    assert "torch.aten.__rshift__" not in text and "torch.prims.convert_element_type" not in text
