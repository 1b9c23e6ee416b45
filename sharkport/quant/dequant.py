"""Planes → float32 values in torch, as ggml's dequantize_row_* does, written so that the same
code runs eagerly and traces into the exported program.

Every function maps the planes of a tensor with `B` blocks per row to float32 values
`[..., B, block_size]`, with the same f32 operations in the same order as ggml's reference
code, so results are bit-identical to `gguf.quants.dequantize`."""

from __future__ import annotations

import torch

QK_K = 256  # values per K-quant super-block


def _scale(t: torch.Tensor) -> torch.Tensor:
    """Per-block f16 scale [..., blocks] → float32 [..., blocks, 1]."""
    return t.to(torch.float32).unsqueeze(-1)


def _bits(x: torch.Tensor, start: int, step: int, mask: int) -> torch.Tensor:
    """uint8 [..., n] → [..., k, n]: field j is `(x >> (start + j*step)) & mask`, for every
    shift below 8. torch-mlir lowers neither a uint8 `arange` nor a shift by a tensor, and a
    stack of the fields becomes a copy dispatch each in IREE; so field j is `x` times
    2^(8 - width - shift) (a left shift, mod 256) shifted right by 8 - width: one broadcast
    multiply by a constant and one scalar shift, which IREE fuses with what follows."""
    width = mask.bit_length()
    shifts = [1 << (8 - width - shift) for shift in range(start, 8, step)]
    return (x.unsqueeze(-2) * torch.tensor(shifts, dtype=torch.uint8).unsqueeze(-1)) >> (8 - width)


def _field(x: torch.Tensor, shift: int, mask: int) -> torch.Tensor:
    """`(x >> shift) & mask` without the no-op steps."""
    if shift:
        x = x >> shift
    full = x.dtype == torch.uint8 and mask >= 0xFF >> shift  # a logical shift cleared the rest
    return x if full else x & mask


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] packed bytes → [..., 32] uint8: low nibbles are elements 0..15, high 16..31."""
    return _bits(qs, 0, 4, 0xF).flatten(-2)


def _fifth_bit(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes holding 32 little-endian bits → [..., 32] uint8 values 0 or 16 (bit b of
    byte i is value 8*i + b)."""
    return (_bits(qh.unsqueeze(-1), 0, 1, 1) << 4).flatten(-3)


def _values(q: torch.Tensor, offset: int = 0) -> torch.Tensor:
    q = q.to(torch.float32)
    return q - offset if offset else q


def _regroup(x: torch.Tensor, dims: int, n: int) -> torch.Tensor:
    """Flattens the last `dims` dims (one super-block's values, in order) into sub-blocks of n:
    [..., B, *per_block] → [..., B, QK_K / n, n]."""
    return x.flatten(-dims).unflatten(-1, (QK_K // n, n))


# --- K-quants: 256-value super-blocks of 16 or 8 sub-blocks, each with its own scale ---------


def _q2_k(p):
    # scales[16]: low nibble scale, high nibble min of each 16-value sub-block. qs[64]: 2-bit
    # values, in two halves of 32 bytes; shift j of byte l is value 32*j + l of the half.
    sc = p["scales"]
    dl = _scale(p["d"]) * (sc & 0xF).to(torch.float32)
    ml = _scale(p["dmin"]) * (sc >> 4).to(torch.float32)
    q = _regroup(_bits(p["qs"].unflatten(-1, (2, 32)), 0, 2, 3), 3, 16)
    return (dl.unsqueeze(-1) * q.to(torch.float32) - ml.unsqueeze(-1)).flatten(-2)


def _q3_k(p):
    # scales[12]: sixteen 6-bit scales biased by 32; low 4 bits in bytes 0..7 (low nibbles are
    # scales 0..7, high nibbles 8..15), top 2 bits in bytes 8..11 (bits 2k..2k+1 of byte 8+j
    # belong to scale 4k+j). hmask[32]: bit b of byte l is the high bit of value 32*b + l, and
    # a clear bit subtracts 4.
    s = p["scales"]
    low = _bits(s[..., :8], 0, 4, 0xF).flatten(-2)
    high = _bits(s[..., 8:], 0, 2, 3).flatten(-2)
    dl = _scale(p["d"]) * ((low | (high << 4)).to(torch.float32) - 32)
    ql = _regroup(_bits(p["qs"].unflatten(-1, (2, 32)), 0, 2, 3), 3, 16)
    qh = _regroup(_bits(p["hmask"], 0, 1, 1), 2, 16)
    q = ql.to(torch.float32) - 4 * (1 - qh.to(torch.float32))  # (no uint8 rsub in torch-mlir)
    return (dl.unsqueeze(-1) * q).flatten(-2)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K scales[12] → eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4):
    bytes 0..3 hold scales 0..3 (low 6 bits), 4..7 mins 0..3, 8..11 the low 4 bits of scales
    (low nibble) and mins (high nibble) 4..7, whose top 2 bits sit in bits 6..7 of bytes 0..7."""
    s = scales.unflatten(-1, (3, 4))
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q45_k(p, fifth_bit: bool):
    # qs[128]: four chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles and 2c+1
    # in its high nibbles. Q5_K's qh[32]: bit s of byte l is the fifth bit of sub-block s.
    sc, mn = _scale_min_k4(p["scales"])
    d = _scale(p["d"]) * sc.to(torch.float32)
    dm = _scale(p["dmin"]) * mn.to(torch.float32)
    q = _regroup(_bits(p["qs"].unflatten(-1, (4, 32)), 0, 4, 0xF), 3, 32)
    if fifth_bit:
        q = q | (_bits(p["qh"], 0, 1, 1) << 4)
    return (d.unsqueeze(-1) * q.to(torch.float32) - dm.unsqueeze(-1)).flatten(-2)


def _q6_k(p):
    # Two halves of 128 values. ql[128]: per half 64 bytes, low nibbles give values 0..63 and
    # high nibbles 64..127. qh[64]: per half 32 bytes, bits 2k..2k+1 of byte l are the top bits
    # of value 32*k + l. Values are biased by 32; scales[16] are int8, one per 16 values.
    ql = _bits(p["ql"].unflatten(-1, (2, 64)), 0, 4, 0xF).unflatten(-1, (2, 32))  # [.., 2, 2, 2, 32]
    qh = _bits(p["qh"].unflatten(-1, (2, 32)), 0, 2, 3)  # [..., 2, 4, 32]
    q = _regroup(ql.flatten(-3, -2) | (qh << 4), 3, 16).to(torch.float32) - 32
    d = _scale(p["d"]) * p["scales"].to(torch.float32)
    return (d.unsqueeze(-1) * q).flatten(-2)


# --- IQ4: 4-bit indices into a fixed non-linear table of int8 values -----------------------

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def _iq4_values(q: torch.Tensor) -> torch.Tensor:
    """uint8 indices 0..15 → their float32 table values."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32)[q.to(torch.int64)]


def _iq4_xs(p):
    # Eight sub-blocks of 32 values, each with a 6-bit scale biased by 32: its low 4 bits are
    # nibble ib % 2 of scales_l[ib / 2], its top 2 bits bits 2ib..2ib+1 of the u16 scales_h.
    # qs[128]: 16 bytes a sub-block, low nibbles values 0..15, high 16..31.
    low = _bits(p["scales_l"], 0, 4, 0xF).transpose(-1, -2).flatten(-2)  # [..., 8]
    h = p["scales_h"].unsqueeze(-1)
    high = torch.cat([_field(h, 2 * i, 3) for i in range(8)], dim=-1)  # (int16: & 3 clears the sign)
    dl = _scale(p["d"]) * ((low | (high << 4)).to(torch.float32) - 32)
    q = _bits(p["qs"].unflatten(-1, (8, 16)), 0, 4, 0xF).flatten(-2)  # [..., 8, 32]
    return (dl.unsqueeze(-1) * _iq4_values(q)).flatten(-2)


DEQUANT = {
    "Q8_0": lambda p: _scale(p["d"]) * _values(p["qs"]),
    "Q4_0": lambda p: _scale(p["d"]) * _values(_nibbles(p["qs"]), 8),
    "Q4_1": lambda p: _scale(p["d"]) * _values(_nibbles(p["qs"])) + _scale(p["m"]),
    "Q5_0": lambda p: _scale(p["d"]) * _values(_nibbles(p["qs"]) | _fifth_bit(p["qh"]), 16),
    "Q5_1": lambda p: _scale(p["d"]) * _values(_nibbles(p["qs"]) | _fifth_bit(p["qh"])) + _scale(p["m"]),
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": lambda p: _q45_k(p, fifth_bit=False),
    "Q5_K": lambda p: _q45_k(p, fifth_bit=True),
    "Q6_K": _q6_k,
    "IQ4_NL": lambda p: _scale(p["d"]) * _iq4_values(_nibbles(p["qs"])),
    "IQ4_XS": _iq4_xs,
}
