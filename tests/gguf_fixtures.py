"""Small GGUF files written with gguf.GGUFWriter: random but valid blocks of any ggml type."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def random_blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Raw bytes [rows, bytes per row] of a tensor of numpy `shape`, with finite f16 scales."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    *outer, n = shape
    raw = rng.integers(0, 256, size=(int(np.prod(outer, dtype=np.int64)), n // block * size), dtype=np.uint8)
    # Every block here starts with an f16 scale d (and Q*_1 a second one, m): make them finite
    # and modest so dequantized values are ordinary numbers.
    blocks = raw.reshape(-1, size)
    n_scales = 2 if type_name in ("Q4_1", "Q5_1") else 1
    scales = (rng.standard_normal((blocks.shape[0], n_scales)) * 0.05).astype(np.float16)
    blocks[:, : 2 * n_scales] = scales.view(np.uint8)
    return raw.reshape(*outer, -1) if outer else raw.reshape(-1)


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
