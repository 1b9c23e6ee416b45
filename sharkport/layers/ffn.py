"""Feed-forward blocks: gated (SwiGLU, GeGLU), a mixture of gated experts, and GPT-2's MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..archive.tensors import Theta
from ..ops import Normed, expert, gelu_tanh, linear, materialized, silu_gate


class SwiGLU(torch.nn.Module):
    """down(act(gate(x)) * up(x)) (+ residual) over `ffn_gate`, `ffn_up`, `ffn_down`; act is SiLU
    (llama) or tanh-GELU (Gemma's GeGLU). x may be ops.normed."""

    def __init__(self, theta: Theta, activation=F.silu):
        super().__init__()
        self.theta, self.activation = theta, activation

    def forward(self, x: torch.Tensor | Normed, residual: torch.Tensor | None = None) -> torch.Tensor:
        t = self.theta
        if self.activation is F.silu and isinstance(x, Normed) and residual is x.x:
            y = kernels.ffn_block(x.x, (x.w, x.eps), t["ffn_gate.weight"], t["ffn_up.weight"], t["ffn_down.weight"])
            if y is not None:  # export --matvec-kernels, decode: the norm, products and residual add in one dispatch
                return y
        if self.activation is F.silu:
            h = silu_gate(x, t["ffn_gate.weight"], t["ffn_up.weight"])
        else:
            x = materialized(x)
            h = self.activation(linear(x, t["ffn_gate.weight"])) * linear(x, t["ffn_up.weight"])
        return linear(h, t["ffn_down.weight"], residual=residual)


def GeGLU(theta: Theta) -> SwiGLU:
    return SwiGLU(theta, gelu_tanh)


class MixtureOfExperts(torch.nn.Module):
    """Mixtral's sparse MoE: the router `ffn_gate_inp` [X, E] scores X experts per token, the
    `used` best are kept with softmax weights renormalized over them, and the output is their
    weighted sum of SwiGLU experts from the stacked `ffn_{gate,up,down}_exps` [X, ...] (+ residual).

    Every expert runs on every token and unrouted ones get weight 0: a static graph that traces
    and compiles as is, at X/used times the work of a gather of routed experts."""

    def __init__(self, theta: Theta, experts: int, used: int):
        super().__init__()
        self.theta, self.experts, self.used = theta, experts, used

    def forward(self, x: torch.Tensor | Normed, residual: torch.Tensor | None = None) -> torch.Tensor:
        t, x = self.theta, materialized(x)
        probs = torch.softmax(linear(x, t["ffn_gate_inp.weight"]).to(torch.float32), dim=-1)  # [..., X]
        # The `used` best experts, found by rank (how many experts score higher) rather than by
        # topk + scatter, which iree-compile 3.9 crashes on.
        rank = (probs.unsqueeze(-2) > probs.unsqueeze(-1)).sum(-1)  # [..., X]
        chosen = torch.where(rank < self.used, probs, torch.zeros_like(probs))
        weights = (chosen / chosen.sum(dim=-1, keepdim=True)).to(x.dtype)  # [..., X], 0 if unrouted
        out = torch.zeros_like(x)
        for i in range(self.experts):
            gate = linear(x, expert(t["ffn_gate_exps.weight"], i))
            up = linear(x, expert(t["ffn_up_exps.weight"], i))
            out = out + weights[..., i:i + 1] * linear(F.silu(gate) * up, expert(t["ffn_down_exps.weight"], i))
        return out if residual is None else residual + out


class GeluMLP(torch.nn.Module):
    """GPT-2: down(gelu_tanh(up(x))) over `ffn_up`, `ffn_down`, each with its bias."""

    def __init__(self, theta: Theta):
        super().__init__()
        self.theta = theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.theta
        h = gelu_tanh(linear(x, t["ffn_up.weight"], t.get("ffn_up.bias")))
        return linear(h, t["ffn_down.weight"], t.get("ffn_down.bias"))
