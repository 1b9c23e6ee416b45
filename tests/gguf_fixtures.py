"""Small GGUF files written with gguf.GGUFWriter: random but valid blocks of any ggml type."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import quants


# Byte offsets of the f16 scale fields in each ggml block struct (ggml-common.h).
F16_FIELD_OFFSETS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator,
                  std: float | None = None) -> np.ndarray:
    """Raw bytes [rows, bytes per row] of a tensor of numpy `shape`, with finite f16 scales.
    With `std`, the scales are rescaled so the dequantized values have about that spread (a
    usable weight for a model, rather than K-quant products of up to 6-bit x 6-bit x scale)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    *outer, n = shape
    raw = rng.integers(0, 256, size=(int(np.prod(outer, dtype=np.int64)), n // block * size), dtype=np.uint8)
    # Make the f16 scales (d, and m/dmin where the type has one) finite and modest, so
    # dequantized values are ordinary numbers.
    blocks = raw.reshape(-1, size)
    offsets = F16_FIELD_OFFSETS.get(type_name, (0,))  # IQ types start with d too
    for offset in offsets:
        scales = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if std is not None:
        factor = std / float(quants.dequantize(raw, qtype).std())
        for offset in offsets:  # values are linear in d (and m/dmin)
            scales = blocks[:, offset:offset + 2].copy().view(np.float16)
            blocks[:, offset:offset + 2] = (scales * factor).astype(np.float16).view(np.uint8)
    return raw.reshape(*outer, -1) if outer else raw.reshape(-1)


def random_tensor(type_name: str, shape: tuple[int, ...], rng: np.random.Generator,
                  std: float = 1.0) -> np.ndarray:
    """Data of any type as GGUFWriter takes it: random values for F32/F16, BF16 bits, or raw
    blocks (their dequantized values spread about `std`)."""
    if type_name in ("F32", "F16", "BF16"):
        values = (rng.standard_normal(shape) * std).astype(np.float32)
        if type_name == "BF16":
            return quants.quantize(values, gguf.GGMLQuantizationType.BF16)
        return values.astype(np.float16) if type_name == "F16" else values
    return random_blocks(type_name, shape, rng, std=None if std == 1.0 else std)


def write_gguf(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]],
               metadata: dict | None = None, arch: str = "llama") -> Path:
    """tensors: name → (ggml type, numpy shape, values or raw bytes)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    for name, (type_name, shape, data) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        if type_name in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            # Raw bytes [rows, bytes per row]: the writer derives the logical shape itself.
            assert gguf.quant_shape_from_byte_shape(data.shape, qtype) == tuple(shape)
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
