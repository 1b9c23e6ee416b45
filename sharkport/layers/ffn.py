"""Feed-forward blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..archive.tensors import Theta
from ..ops import linear


class SwiGLU(torch.nn.Module):
    """down(silu(gate(x)) * up(x)) over `ffn_gate`, `ffn_up`, `ffn_down`."""

    def __init__(self, theta: Theta):
        super().__init__()
        self.theta = theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.theta
        return linear(F.silu(linear(x, t["ffn_gate.weight"])) * linear(x, t["ffn_up.weight"]),
                      t["ffn_down.weight"])
