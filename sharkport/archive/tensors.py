"""Weights as the model code sees them: plain torch tensors, or quantized planes kept packed.
torch loads only when a weight is made, so the archive's metadata readers run without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

from ..quant import BLOCK_TYPES, PLAIN_TYPES, interleave_planes, interleaved_rows, interleaves

if TYPE_CHECKING:
    import torch


@dataclass
class QuantizedTensor:
    """A block-quantized tensor of logical `shape`, held as its planes (see sharkport.quant),
    `interleaved`: with its rows interleaved eight at a time (quant.interleave_planes)."""

    type_name: str
    shape: tuple[int, ...]
    planes: dict[str, torch.Tensor]
    interleaved: bool = False

    @classmethod
    def held(cls, type_name: str, shape: tuple[int, ...], planes: dict) -> "QuantizedTensor":
        """A tensor of planes in row order, held as an archive holds it: interleaved where
        quant.interleaves says so."""
        if interleaves(type_name, shape):
            return cls(type_name, tuple(shape), interleave_planes(type_name, planes), interleaved=True)
        return cls(type_name, tuple(shape), planes)

    def row_order(self) -> "QuantizedTensor":
        """This tensor with its planes in row order."""
        if not self.interleaved:
            return self
        return QuantizedTensor(self.type_name, self.shape, interleave_planes(self.type_name, self.planes, inverse=True))

    def dequant(self) -> torch.Tensor:
        """float32 values of `shape`."""
        return BLOCK_TYPES[self.type_name].dequant(self.row_order().planes)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantizes only the rows `ids` of a 2-D tensor: [*ids.shape, shape[-1]] float32."""
        if not self.interleaved:
            return BLOCK_TYPES[self.type_name].dequant({k: p[ids] for k, p in self.planes.items()})
        return BLOCK_TYPES[self.type_name].dequant(interleaved_rows(self.type_name, self.planes, ids))


# For annotations only; "torch.Tensor" stays a name so that importing this needs no torch.
Weight = Union["torch.Tensor", QuantizedTensor]


def weight_from_raw(type_name: str, shape: tuple[int, ...], raw: np.ndarray) -> Weight:
    """One tensor's bytes as ggml stores them (any contiguous array) → a plain torch tensor of
    `shape`, or a QuantizedTensor holding its planes as an archive holds them (QuantizedTensor.held).
    Plain values are copied; planes are split."""
    import torch

    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if type_name in PLAIN_TYPES:
        np_dtype, torch_dtype = PLAIN_TYPES[type_name]
        values = torch.from_numpy(raw.copy().view(np_dtype))
        return values.view(getattr(torch, torch_dtype)).reshape(shape)
    planes = BLOCK_TYPES[type_name].unpack(raw, shape)
    return QuantizedTensor.held(type_name, tuple(shape), {k: torch.from_numpy(v) for k, v in planes.items()})


class Theta:
    """Named weights under GGUF names, with prefix views: `theta("blk", 3)["attn_q.weight"]`."""

    def __init__(self, tensors: dict[str, Weight], prefix: str = ""):
        self._tensors = tensors
        self._prefix = prefix

    def __call__(self, *parts: str | int) -> "Theta":
        return Theta(self._tensors, self._prefix + "".join(f"{p}." for p in parts))

    def __getitem__(self, name: str) -> Weight:
        return self._tensors[self._prefix + name]

    def get(self, name: str) -> Weight | None:
        return self._tensors.get(self._prefix + name)

    def __contains__(self, name: str) -> bool:
        return self._prefix + name in self._tensors

    def names(self) -> list[str]:
        return [n[len(self._prefix):] for n in self._tensors if n.startswith(self._prefix)]

    def items(self):
        return ((n, t) for n, t in self._tensors.items() if n.startswith(self._prefix))
