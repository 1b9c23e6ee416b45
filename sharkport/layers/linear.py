"""The modules a block is built from that export may swap for kernels: a product by a weight and
the norms."""

from __future__ import annotations

import torch

from ..archive.tensors import Weight
from ..ops import layer_norm, linear, rms_norm


class Linear(torch.nn.Module):
    """x @ weight.T (+ bias): `weight` plain or quantized, as the archive stores it."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.bias, self.eps = weight, bias, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
