"""Block types against gguf.quants (llama.cpp's reference dequantization, ported to numpy)."""

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from sharkport.archive import QuantizedTensor
from sharkport.quant import BLOCK_TYPES
from sharkport.ops import embedding, linear

from gguf_fixtures import random_blocks

SHAPE = (8, 256)


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES), ids=sorted(BLOCK_TYPES))
def test_dequant_is_bit_exact(type_name):
    raw = random_blocks(type_name, SHAPE, np.random.default_rng(1))
    expected = quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    planes = BLOCK_TYPES[type_name].unpack(raw, SHAPE)
    got = BLOCK_TYPES[type_name].dequant({k: torch.from_numpy(v) for k, v in planes.items()})
    assert got.dtype == torch.float32 and tuple(got.shape) == SHAPE
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES), ids=sorted(BLOCK_TYPES))
def test_pack_is_the_inverse_of_unpack(type_name):
    raw = random_blocks(type_name, SHAPE, np.random.default_rng(4))
    bt = BLOCK_TYPES[type_name]
    assert bt.pack(bt.unpack(raw, SHAPE)).tobytes() == raw.tobytes()
    row = raw[0]
    assert bt.pack(bt.unpack(row, SHAPE[1:])).tobytes() == row.tobytes()  # 1-D tensors too


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES), ids=sorted(BLOCK_TYPES))
def test_plane_shapes_follow_the_block_struct(type_name):
    bt = BLOCK_TYPES[type_name]
    planes = bt.unpack(random_blocks(type_name, SHAPE, np.random.default_rng(2)), SHAPE)
    expected = bt.plane_shapes(SHAPE)
    assert list(planes) == [f for f, _, _ in bt.fields]
    assert {k: (v.shape, v.dtype) for k, v in planes.items()} == expected
    assert sum(v.nbytes for v in planes.values()) == SHAPE[0] * SHAPE[1] // bt.block_size * bt.type_size


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"], ids=["Q8_0", "Q4_1"])
def test_linear_and_embedding_over_planes(type_name):
    rng = np.random.default_rng(3)
    raw = random_blocks(type_name, SHAPE, rng)
    dense = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]))
    planes = {k: torch.from_numpy(v) for k, v in BLOCK_TYPES[type_name].unpack(raw, SHAPE).items()}
    w = QuantizedTensor(type_name, SHAPE, planes)
    x = torch.from_numpy(rng.standard_normal((3, SHAPE[1])).astype(np.float32))
    torch.testing.assert_close(linear(x, w), x @ dense.T, rtol=0, atol=0)
    ids = torch.tensor([[0, 7, 3]])
    torch.testing.assert_close(embedding(ids, w, torch.float32), dense[ids], rtol=0, atol=0)
