"""Elementwise ops traced as a dispatch region of their own: a turbine custom op whose MLIR body
is one `linalg.generic` inside a `flow.dispatch.region` (eagerly, the same torch code).

`silu_mul(g, u)` is SwiGLU's silu(g) * u over a dynamic number of rows (prefill). Traced as
torch ops, IREE fuses it with its producer's unpack and its consumer's pack (the down
projection's packed left-hand side, in 8-row x 1-column tiles) into one dispatch that it
vectorizes 8 rows by 1 column with masked stores: 10% of SmolLM2's prefill of 128 tokens.
In a region of its own it runs along rows, and the unpacks and the pack are dispatches of their
own (5% together; prefill 1.075x, docs/performance.md "Where a prefill goes").
"""

from __future__ import annotations

import torch
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, def_library

from ..mlir_ops import call_mlir_function

_LIBRARY = def_library("sharkport_regions")


def _silu_mul_body(name: str, n: int) -> str:
    """util.func `name`: g, u [?, n] f32 → silu(g) * u, computed as torch's decomposition does
    (1 / (1 + exp(-g)), times g, times u), so results match the traced form bit for bit."""
    t = f"tensor<?x{n}xf32>"
    identity = "affine_map<(i, j) -> (i, j)>"
    return f"""
module {{
  util.func private @{name}(%g: {t}, %u: {t}) -> {t} {{
    %c0 = arith.constant 0 : index
    %m = tensor.dim %g, %c0 : {t}
    %r = flow.dispatch.region -> ({t}{{%m}}) {{
      %e = tensor.empty(%m) : {t}
      %y = linalg.generic {{indexing_maps = [{identity}, {identity}, {identity}],
                           iterator_types = ["parallel", "parallel"]}}
          ins(%g, %u : {t}, {t}) outs(%e : {t}) {{
      ^bb0(%a: f32, %b: f32, %out: f32):
        %one = arith.constant 1.0 : f32
        %neg = arith.negf %a : f32
        %exp = math.exp %neg : f32
        %den = arith.addf %exp, %one : f32
        %sig = arith.divf %one, %den : f32
        %silu = arith.mulf %sig, %a : f32
        %v = arith.mulf %silu, %b : f32
        linalg.yield %v : f32
      }} -> {t}
      flow.return %y : {t}
    }}
    util.return %r : {t}
  }}
}}"""


class _SiluMul(CustomOp):
    signature = "silu_mul(Tensor g, Tensor u) -> (Tensor)"

    def select(self, ksel: KernelSelection):
        g, u = ksel.arg_tensor(0), ksel.arg_tensor(1)  # [M, N] each, M dynamic
        g.specialize_dims(1)
        u.specialize_dims(1)
        ksel.return_new_tensor(list(g.t.shape), torch.float32)

    def eager_execute(self, g, u):
        return torch.nn.functional.silu(g) * u

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        from iree.turbine.support.ir_imports import RankedTensorType

        n = RankedTensorType(kb.arg_bindings[0].type).shape[1]
        name = f"sharkport_silu_mul_{n}"
        call_mlir_function(kb, name, lambda: _silu_mul_body(name, n))


_SILU_MUL = CustomOp.register(library=_LIBRARY)(_SiluMul)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for g, u [M, N]: in a dispatch region of its own for float32 with a static N,
    else as torch ops."""
    if g.dtype == u.dtype == torch.float32 and g.dim() == u.dim() == 2 and isinstance(g.shape[1], int):
        return _SILU_MUL(g, u)
    return torch.nn.functional.silu(g) * u
