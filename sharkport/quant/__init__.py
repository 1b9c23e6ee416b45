"""ggml block types: how each packs values, split into planes and turned back into floats.

A quantized tensor of numpy shape [..., N] is stored as one plane per field of its ggml block
struct, in struct order: for Q4_1 (`{f16 d; f16 m; u8 qs[16]}` per 32 values) the planes are
`d [..., N/32]`, `m [..., N/32]` and `qs [..., N/32, 16]`. `unpack` splits raw GGUF bytes into
those planes (numpy, at import); `dequant` turns planes back into float32 values (torch, so it
runs eagerly and inside the traced program alike; see dequant.py). This module needs no torch,
so tools that only inspect files start quickly.

Matrices of the types in ROW_INTERLEAVED_TYPES whose row count is a multiple of 8 are held with
their rows interleaved eight at a time (`interleave_planes`), as the CPU kernels read them: the
archive stores them so, and a module maps them as stored rather than copying them as it loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from ..errors import SharkportError

# Plain (unquantized) ggml types: numpy dtype of their bytes, and torch dtype name. BF16 has no
# numpy dtype; it is carried as raw uint16 bits in numpy and viewed as torch.bfloat16.
PLAIN_TYPES: dict[str, tuple[np.dtype, str]] = {
    "F32": (np.dtype(np.float32), "float32"),
    "F16": (np.dtype(np.float16), "float16"),
    "BF16": (np.dtype(np.uint16), "bfloat16"),
}


@dataclass(frozen=True)
class BlockType:
    """One ggml block-quantized type: its block struct as (field, numpy dtype, count) planes."""

    name: str
    fields: tuple[tuple[str, str, int], ...]

    @property
    def block_size(self) -> int:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.name]][0]

    @property
    def type_size(self) -> int:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.name]][1]

    @property
    def struct(self) -> np.dtype:
        return np.dtype([(f, dt, (n,)) if n > 1 else (f, dt) for f, dt, n in self.fields])

    def plane_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shape and dtype of every plane of a tensor of numpy `shape`."""
        *outer, n = shape
        blocks = n // self.block_size
        return {
            f: ((*outer, blocks, count) if count > 1 else (*outer, blocks), np.dtype(dt))
            for f, dt, count in self.fields
        }

    def unpack(self, raw: np.ndarray, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        """Raw block bytes (any uint8 view holding the tensor) → contiguous planes."""
        *outer, n = shape
        if n % self.block_size:
            raise SharkportError(
                f"{self.name} needs rows that are a multiple of {self.block_size} values, got {n}"
            )
        blocks = np.ascontiguousarray(raw).reshape(-1).view(self.struct)
        blocks = blocks.reshape(*outer, n // self.block_size)
        return {f: np.ascontiguousarray(blocks[f]) for f, _, _ in self.fields}

    def pack(self, planes: dict[str, np.ndarray]) -> np.ndarray:
        """The inverse of unpack: planes (numpy) → raw block bytes [..., bytes per row]."""
        first = planes[self.fields[0][0]]
        outer = first.shape if self.fields[0][2] == 1 else first.shape[:-1]  # [..., blocks]
        blocks = np.empty(outer, self.struct)
        for field, _, _ in self.fields:
            blocks[field] = planes[field]
        return blocks.view(np.uint8).reshape(*outer[:-1], -1)

    def dequant(self, planes: dict):
        """Planes (torch tensors) → float32 values of shape [..., N]. Q8_0, Q4_0 and Q4_1 weights
        trace as one node (dequant_op)."""
        from . import dequant_op
        from .dequant import DEQUANT

        if dequant_op.applies(self.name, planes):
            return dequant_op.dequant(self.name, planes).flatten(-2)
        return DEQUANT[self.name](planes).flatten(-2)  # [..., blocks, block_size] → [..., N]


BLOCK_TYPES: dict[str, BlockType] = {
    t.name: t
    for t in [
        BlockType("Q8_0", (("d", "<f2", 1), ("qs", "i1", 32))),
        BlockType("Q4_0", (("d", "<f2", 1), ("qs", "u1", 16))),
        BlockType("Q4_1", (("d", "<f2", 1), ("m", "<f2", 1), ("qs", "u1", 16))),
        BlockType("Q5_0", (("d", "<f2", 1), ("qh", "u1", 4), ("qs", "u1", 16))),
        BlockType("Q5_1", (("d", "<f2", 1), ("m", "<f2", 1), ("qh", "u1", 4), ("qs", "u1", 16))),
        # K-quants: 256-value super-blocks (ggml's block_q*_K structs, fields in struct order).
        BlockType("Q2_K", (("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2", 1), ("dmin", "<f2", 1))),
        BlockType("Q3_K", (("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "<f2", 1))),
        BlockType("Q4_K", (("d", "<f2", 1), ("dmin", "<f2", 1), ("scales", "u1", 12), ("qs", "u1", 128))),
        BlockType("Q5_K", (("d", "<f2", 1), ("dmin", "<f2", 1), ("scales", "u1", 12), ("qh", "u1", 32),
                           ("qs", "u1", 128))),
        BlockType("Q6_K", (("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2", 1))),
        # 4-bit indices into a non-linear table (ggml's block_iq4_nl, block_iq4_xs)
        BlockType("IQ4_NL", (("d", "<f2", 1), ("qs", "u1", 16))),
        # (IQ4_XS's u16 scales_h as int16: its bits are read, never its value)
        BlockType("IQ4_XS", (("d", "<f2", 1), ("scales_h", "<i2", 1), ("scales_l", "u1", 4), ("qs", "u1", 128))),
    ]
}

SUPPORTED_TYPES = tuple(PLAIN_TYPES) + tuple(BLOCK_TYPES)

ROW_INTERLEAVED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                         "IQ4_XS")
INTERLEAVED_ROWS = 8


def interleaves(type_name: str, shape) -> bool:
    """Whether a tensor of `type_name` and `shape` is held with its rows interleaved: a matrix of
    a type in ROW_INTERLEAVED_TYPES whose row count is a multiple of INTERLEAVED_ROWS."""
    return type_name in ROW_INTERLEAVED_TYPES and len(shape) == 2 and shape[0] % INTERLEAVED_ROWS == 0


# Interleaved Q5_0 and Q5_1 hold each row's 32 fifth bits (bit v: value v's) with the bit of value
# 16 h + 4 j + t at bit 8 t + 2 j + h: byte t of a row's four then holds the fifth bits of the
# values 4j + t (at bit 2j) and 16 + 4j + t (at bit 2j + 1), whose nibbles lie in byte t of the
# row's chunk j of qs, so that one shift and one mask put each beside its nibble (the CPU kernels).
FIFTH_BIT_TYPES = ("Q5_0", "Q5_1")


def plane_key(name: str, plane: str, interleaved: bool = False, type_name: str = "") -> str:
    """The archive entry of plane `plane` of tensor `name` of `type_name`: `name:plane`, or
    `name:plane:x8` with its rows interleaved, `name:qh:x8p` for the fifth bits of interleaved
    Q5_0 and Q5_1 (placed by value: FIFTH_BIT_TYPES), so that a module made for one layout cannot
    load another's bytes."""
    if not interleaved:
        return f"{name}:{plane}"
    placed = "p" if type_name in FIFTH_BIT_TYPES and plane == "qh" else ""
    return f"{name}:{plane}:x{INTERLEAVED_ROWS}{placed}"


def interleave_planes(type_name: str, planes: dict, inverse: bool = False) -> dict:
    """The planes of a `type_name` matrix [N, K] (N a multiple of 8; numpy arrays or torch tensors)
    with its rows interleaved eight at a time, or with `inverse` put back. Per group of eight rows
    and block b: a plane of bytes a block (`qs`, Q5_0's `qh`, the K-quants' `scales`) holds 4 of
    each row's bytes at a time (chunk j: bytes 4j .. 4j + 3 of rows 0..7), a plane of a value a
    block (`d`, `m`, `dmin`, IQ4_XS's `scales_h`) the eight rows' values side by side. Q5_0's and
    Q5_1's fifth bits are also placed by value (FIFTH_BIT_TYPES). Every plane keeps its shape."""
    out = {}
    for name, p in planes.items():
        if type_name in FIFTH_BIT_TYPES and name == "qh":  # row by row, so before either way
            p = _place_fifth_bits(p, inverse)
        n, b = p.shape[0], p.shape[1]
        if p.ndim == 3:
            size = p.shape[2]
            grouped = (n // 8, b, size // 4, 8, 4) if inverse else (n // 8, 8, b, size // 4, 4)
            order = (0, 3, 1, 2, 4) if inverse else (0, 2, 3, 1, 4)
        else:
            grouped = (n // 8, b, 8) if inverse else (n // 8, 8, b)
            order = (0, 2, 1)
        g = p.reshape(grouped)
        out[name] = (g.permute(*order) if hasattr(g, "permute") else g.transpose(order)).reshape(p.shape)
    return out


def interleaved_rows(type_name: str, planes: dict, ids):
    """Rows `ids` (an int64 torch tensor) of a `type_name` matrix whose planes (torch tensors) are
    interleaved, in row order: each plane [*ids.shape, *plane.shape[1:]]. Each plane is one gather
    of those rows' elements at their offsets in interleave_planes' layout, so that a traced program
    (an embedding lookup) reads and dequantizes only them, not their groups of eight."""
    import torch

    group, lane = ids // INTERLEAVED_ROWS, ids % INTERLEAVED_ROWS
    out = {}
    for name, p in planes.items():
        b = p.shape[1]
        if p.ndim == 3:  # element (block, 4 c + t) of row r at (block, c, r, t) of its group
            size = p.shape[2]
            offsets = (np.arange(b).reshape(b, 1, 1) * (size * INTERLEAVED_ROWS)
                       + np.arange(size // 4).reshape(1, -1, 1) * (4 * INTERLEAVED_ROWS)
                       + np.arange(4).reshape(1, 1, 4)).reshape(-1)
            row_step = 4
        else:  # element block of row r at (block, r)
            offsets, row_step = np.arange(b) * INTERLEAVED_ROWS, 1
        # a table, not an arange: IREE 3.9's GPU code generation fails on a gather whose offsets
        # are computed in the dispatch ('vector.gather' op operand #2 must be vector)
        offsets = torch.from_numpy(offsets.astype(np.int64))
        start = group * p[:INTERLEAVED_ROWS].numel() + lane * row_step
        rows = p.reshape(-1)[start[..., None] + offsets].reshape(*ids.shape, *p.shape[1:])
        out[name] = _place_fifth_bits(rows, inverse=True) if type_name in FIFTH_BIT_TYPES and name == "qh" else rows
    return out


def _place_fifth_bits(qh, inverse: bool):
    """Q5's qh plane [..., 4] (a numpy array or torch tensor of uint8) with each row's fifth bits
    placed by value (FIFTH_BIT_TYPES), or with `inverse` put back in value order: the 32 bits'
    index (h, j, t) becomes (t, j, h). In torch, its bits by dequant._bits and packed by a
    multiply and a sum, which the traced program lowers and IREE fuses."""
    lead = tuple(qh.shape[:-1])
    n = len(lead)
    order = (*range(n), n + 2, n + 1, n)
    groups = (4, 4, 2) if inverse else (2, 4, 4)
    if hasattr(qh, "permute"):
        import torch

        from .dequant import _bits

        bits = _bits(qh, 0, 1, 1).transpose(-1, -2)  # [..., 4 bytes, 8 bits]
        bits = bits.reshape(*lead, *groups).permute(*order).reshape(*lead, 4, 8)
        return (bits * torch.tensor([1 << k for k in range(8)], dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    bits = np.stack([(qh >> k) & 1 for k in range(8)], axis=-1).reshape(*lead, *groups).transpose(order)
    bits = bits.reshape(*lead, 4, 8)
    packed = bits[..., 0]
    for k in range(1, 8):
        packed = packed | (bits[..., k] << k)
    return packed


def check_supported(type_name: str, where: str) -> None:
    if type_name not in PLAIN_TYPES and type_name not in BLOCK_TYPES:
        raise SharkportError(
            f"{where} has ggml type {type_name}, which sharkport cannot import yet "
            f"(supported: {', '.join(SUPPORTED_TYPES)}); requantize the file to a supported type "
            "with llama.cpp, e.g. `llama-quantize --allow-requantize IN.gguf OUT.gguf Q4_K_M`"
        )
