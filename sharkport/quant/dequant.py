"""Planes → float32 values in torch, as ggml's dequantize_row_* does, written so that the same
code runs eagerly and traces into the exported program."""

from __future__ import annotations

import torch


def _scale(t: torch.Tensor) -> torch.Tensor:
    """Per-block f16 scale [..., blocks] → float32 [..., blocks, 1]."""
    return t.to(torch.float32).unsqueeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] packed bytes → [..., 32] uint8: low nibbles are elements 0..15, high 16..31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _fifth_bit(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes holding 32 little-endian bits → [..., 32] uint8 values 0 or 16."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return (((qh.unsqueeze(-1) >> shifts) & 1) << 4).flatten(-2)


def _values(q: torch.Tensor, offset: int = 0) -> torch.Tensor:
    q = q.to(torch.float32)
    return q - offset if offset else q


# Each maps planes to float32 values [..., blocks, block_size], as ggml's dequantize_row_* does.
DEQUANT = {
    "Q8_0": lambda p: _scale(p["d"]) * _values(p["qs"]),
    "Q4_0": lambda p: _scale(p["d"]) * _values(_nibbles(p["qs"]), 8),
    "Q4_1": lambda p: _scale(p["d"]) * _values(_nibbles(p["qs"])) + _scale(p["m"]),
    "Q5_0": lambda p: _scale(p["d"]) * _values(_nibbles(p["qs"]) | _fifth_bit(p["qh"]), 16),
    "Q5_1": lambda p: _scale(p["d"]) * _values(_nibbles(p["qs"]) | _fifth_bit(p["qh"])) + _scale(p["m"]),
}
