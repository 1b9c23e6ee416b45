"""Feed-forward blocks: gated (SwiGLU, GeGLU), a mixture of gated experts, and GPT-2's MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..archive.tensors import Theta, Weight
from ..ops import expert, gelu_tanh, silu_gate
from .linear import Linear


class SwiGLU(torch.nn.Module):
    """down(act(gate(x)) * up(x)) over `ffn_gate`, `ffn_up`, `ffn_down`; act is SiLU (llama) or
    tanh-GELU (Gemma's GeGLU)."""

    def __init__(self, theta: Theta, activation=F.silu):
        super().__init__()
        self.activation = activation
        self.gate, self.up, self.down = (Linear(theta[f"ffn_{p}.weight"]) for p in ("gate", "up", "down"))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x), the down projection's input."""
        if self.activation is F.silu:
            return silu_gate(x, self.gate, self.up)
        return self.activation(self.gate(x)) * self.up(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gated(x))


def GeGLU(theta: Theta) -> SwiGLU:
    return SwiGLU(theta, gelu_tanh)


class MixtureOfExperts(torch.nn.Module):
    """Mixtral's sparse MoE: the router `ffn_gate_inp` [X, E] scores X experts per token, the
    `used` best are kept with softmax weights renormalized over them, and the output is their
    weighted sum of SwiGLU experts from the stacked `ffn_{gate,up,down}_exps` [X, ...].

    Every expert runs on every token and unrouted ones get weight 0: a static graph that traces
    and compiles as is, at X/used times the work of a gather of routed experts."""

    def __init__(self, theta: Theta, experts: int, used: int):
        super().__init__()
        self.used = used
        self.router = Linear(theta["ffn_gate_inp.weight"])
        self.gate, self.up, self.down = (torch.nn.ModuleList(
            ExpertLinear(theta[f"ffn_{p}_exps.weight"], i) for i in range(experts)) for p in ("gate", "up", "down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x).to(torch.float32), dim=-1)  # [..., X]
        # The `used` best experts, found by rank (how many experts score higher) rather than by
        # topk + scatter, which iree-compile 3.9 crashes on.
        rank = (probs.unsqueeze(-2) > probs.unsqueeze(-1)).sum(-1)  # [..., X]
        chosen = torch.where(rank < self.used, probs, torch.zeros_like(probs))
        weights = (chosen / chosen.sum(dim=-1, keepdim=True)).to(x.dtype)  # [..., X], 0 if unrouted
        out = torch.zeros_like(x)
        for i, (gate, up, down) in enumerate(zip(self.gate, self.up, self.down)):
            g, u = gate(x), up(x)
            out = out + weights[..., i:i + 1] * down(F.silu(g) * u)
        return out


class ExpertLinear(Linear):
    """The product by expert `index` of a stacked weight [X, out, in], sliced where it is used: a
    slice taken when the model is built would be a tensor of its own, not the archive's parameter."""

    def __init__(self, stacked: Weight, index: int):
        torch.nn.Module.__init__(self)
        self.stacked, self.index, self.bias = stacked, index, None

    @property
    def weight(self) -> Weight:
        return expert(self.stacked, self.index)


class GeluMLP(torch.nn.Module):
    """GPT-2: down(gelu_tanh(up(x))) over `ffn_up`, `ffn_down`, each with its bias."""

    def __init__(self, theta: Theta):
        super().__init__()
        self.up = Linear(theta["ffn_up.weight"], theta.get("ffn_up.bias"))
        self.down = Linear(theta["ffn_down.weight"], theta.get("ffn_down.bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gelu_tanh(self.up(x)))
