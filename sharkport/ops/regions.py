"""Ops traced as a dispatch region of their own: turbine custom ops whose MLIR bodies are
`linalg.generic`s inside one `flow.dispatch.region` (eagerly, the same torch code).

* `silu_mul(g, u)`: SwiGLU's silu(g) * u over a dynamic number of rows (prefill). Traced as torch
  ops, IREE fuses it with its producer's unpack and its consumer's pack (the down projection's
  packed left-hand side, in 8-row x 1-column tiles) into one dispatch that it vectorizes 8 rows
  by 1 column with masked stores, a slow loop. In a region of its own it runs along rows, and the
  unpacks and the pack are cheaper dispatches of their own.
* `rms_norm(x, w, eps)` over decode's few static rows: IREE makes a norm two dispatches (the sum
  of squares, then the scaling); one region takes one. The export takes it with the matvec
  kernels (export.kernels.KernelRMSNorm), where most of decode's norms go inside the products
  after them and need no dispatch at all.
* `add_rms_norm(r, x, w, eps)`: a post-norm and the residual add after it (Gemma's), r +
  rms_norm(x, w), over decode's rows in one region, not two.

`tools/profile_step.py` measures where a prefill or a decode step goes.
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


def _rms_norm_body(name: str, m: int, e: int, eps: float, residual: bool = False) -> str:
    """util.func `name`: h [m, e], w [e] → rms_norm(h, w), as torch's decomposition computes it
    (h * rsqrt(sum(h * h) / e + eps) * w), in one dispatch region; with `residual`, r [m, e] first
    and r + rms_norm(h, w)."""
    t, row, vec = f"tensor<{m}x{e}xf32>", f"tensor<{m}xf32>", f"tensor<{e}xf32>"
    ij, i, j = "affine_map<(i, j) -> (i, j)>", "affine_map<(i, j) -> (i)>", "affine_map<(i, j) -> (j)>"
    # with `residual`: r's argument, its map, operand, block argument and type, and the add
    r_arg, r_map, r_in, r_val, r_type = ((f"%res: {t}, ", f", {ij}", "%res, ", "%b: f32, ", f"{t}, ") if residual
                                         else ("",) * 5)
    out, add = ("%o2", "\n        %o2 = arith.addf %b, %o : f32") if residual else ("%o", "")
    return f"""
module {{
  util.func private @{name}({r_arg}%h: {t}, %w: {vec}) -> {t} {{
    %r = flow.dispatch.region -> ({t}) {{
      %zero = arith.constant 0.0 : f32
      %er = tensor.empty() : {row}
      %z = linalg.fill ins(%zero : f32) outs(%er : {row}) -> {row}
      %ss = linalg.generic {{indexing_maps = [{ij}, {i}], iterator_types = ["parallel", "reduction"]}}
          ins(%h : {t}) outs(%z : {row}) {{
      ^bb0(%a: f32, %acc: f32):
        %sq = arith.mulf %a, %a : f32
        %s = arith.addf %sq, %acc : f32
        linalg.yield %s : f32
      }} -> {row}
      %ey = tensor.empty() : {t}
      %y = linalg.generic {{indexing_maps = [{ij}{r_map}, {i}, {j}, {ij}], iterator_types = ["parallel", "parallel"]}}
          ins(%h, {r_in}%ss, %w : {t}, {r_type}{row}, {vec}) outs(%ey : {t}) {{
      ^bb0(%a: f32, {r_val}%q: f32, %g: f32, %out: f32):
        %n = arith.constant {float(e):.1f} : f32
        %eps = arith.constant {eps:.9e} : f32
        %mean = arith.divf %q, %n : f32
        %v = arith.addf %mean, %eps : f32
        %r = math.rsqrt %v : f32
        %xr = arith.mulf %a, %r : f32
        %o = arith.mulf %xr, %g : f32{add}
        linalg.yield {out} : f32
      }} -> {t}
      flow.return %y : {t}
    }}
    util.return %r : {t}
  }}
}}"""


def _rms_norm_eager(h, w, eps):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w


def _generate_norm(ksel: KernelSelection, kb: KernelBuilder, op: str, residual: bool) -> None:
    """A norm op's call of its region function, one per shape and eps (h follows r where `residual`)."""
    from iree.turbine.support.ir_imports import RankedTensorType

    m, e = RankedTensorType(kb.arg_bindings[int(residual)].type).shape
    eps = ksel.arg_descs[2 + int(residual)].v
    name = f"sharkport_{op}_{m}x{e}_{eps!r}".replace(".", "p").replace("-", "m")
    call_mlir_function(kb, name, lambda: _rms_norm_body(name, m, e, eps, residual))


class _RmsNorm(CustomOp):
    signature = "rms_norm(Tensor h, Tensor w, float eps) -> (Tensor)"

    def select(self, ksel: KernelSelection):
        h, w = ksel.arg_tensor(0), ksel.arg_tensor(1)
        h.specialize_all_dims()
        w.specialize_all_dims()
        ksel.attr_float(2)
        ksel.return_new_tensor(list(h.t.shape), torch.float32)

    def eager_execute(self, h, w, eps):
        return _rms_norm_eager(h, w, eps)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        _generate_norm(ksel, kb, "rms_norm", residual=False)


class _AddRmsNorm(CustomOp):
    signature = "add_rms_norm(Tensor r, Tensor h, Tensor w, float eps) -> (Tensor)"

    def select(self, ksel: KernelSelection):
        r, h, w = (ksel.arg_tensor(k) for k in range(3))
        for t in (r, h, w):
            t.specialize_all_dims()
        ksel.attr_float(3)
        ksel.return_new_tensor(list(h.t.shape), torch.float32)

    def eager_execute(self, r, h, w, eps):
        return r + _rms_norm_eager(h, w, eps)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        _generate_norm(ksel, kb, "add_rms_norm", residual=True)


_RMS_NORM = CustomOp.register(library=_LIBRARY)(_RmsNorm)
_ADD_RMS_NORM = CustomOp.register(library=_LIBRARY)(_AddRmsNorm)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm of x [M, E] float32 by w [E] float32 in one dispatch region."""
    return _RMS_NORM(x, w, float(eps))


def add_rms_norm(r: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """r + rms_norm(x, w) for r, x [M, E] and w [E], float32, in one dispatch region: a
    post-norm and its residual add (Gemma's)."""
    return _ADD_RMS_NORM(r, x, w, float(eps))
