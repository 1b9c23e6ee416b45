"""Q8_0, Q4_0 and Q4_1 dequantization as one traced node each: a turbine custom op whose MLIR
body is a single `linalg.generic` with the same f32 operations, in the same order, as the torch
code of sharkport.quant.dequant (which it runs eagerly).

Traced op by op, Q4_1 costs 12 nodes per weight, and every node costs torch.export time in
each exported function (docs/performance.md, export and compile); as one node, an export holds
far fewer ops. IREE compiles the body to the same results, bit for bit, at the same speed
(and compiles the module faster); the planes are the only operands, so the `llvm-cpu` preset
still hoists the dequantization of weights into the module's initializer.

Only planes of static shape [N, B, block bytes] (a weight matrix, or rows gathered by a static
index) take the op; others (rows gathered by a dynamic index: embeddings) stay traced as torch.
"""

from __future__ import annotations

import torch
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, def_library

from ..mlir_ops import call_mlir_function

_LIBRARY = def_library("sharkport_dequant")

# block type → (plane names in operand order, values per block, MLIR computing %y (f32) from
# %q (the block's i8 byte or nibble, already shifted and masked), %d and %m (f16 scale and min))
_ARITH = {
    "Q8_0": (("qs", "d"), 32, """
      %qf = arith.sitofp %q : i8 to f32
      %df = arith.extf %d : f16 to f32
      %y = arith.mulf %df, %qf : f32"""),
    "Q4_0": (("qs", "d"), 32, """
      %qf = arith.uitofp %q : i8 to f32
      %c8 = arith.constant 8.0 : f32
      %qo = arith.subf %qf, %c8 : f32
      %df = arith.extf %d : f16 to f32
      %y = arith.mulf %df, %qo : f32"""),
    "Q4_1": (("qs", "d", "m"), 32, """
      %qf = arith.uitofp %q : i8 to f32
      %df = arith.extf %d : f16 to f32
      %mf = arith.extf %m : f16 to f32
      %p = arith.mulf %df, %qf : f32
      %y = arith.addf %p, %mf : f32"""),
}


def _body(type_name: str, name: str, n: int, b: int) -> str:
    """MLIR module text of util.func `name`: planes qs [n, b, bytes] i8, d (and m) [n, b] f16 →
    [n, b, 32] f32. Nibble types are computed as [n, b, 2, 16] (low nibbles, then high: the
    order of dequant._nibbles) and collapsed."""
    planes, per_block, arith = _ARITH[type_name]
    nibbles = type_name != "Q8_0"
    qbytes = per_block // 2 if nibbles else per_block
    q_type = f"tensor<{n}x{b}x{qbytes}xi8>"
    s_type = f"tensor<{n}x{b}xf16>"
    out_shape = f"{n}x{b}x2x16" if nibbles else f"{n}x{b}x{per_block}"
    dims = "(n, b, h, i)" if nibbles else "(n, b, i)"
    q_map = f"affine_map<{dims} -> (n, b, i)>"
    s_map = f"affine_map<{dims} -> (n, b)>"
    o_map = f"affine_map<{dims} -> {dims}>"
    scales = ["%d_in", "%m_in"][:len(planes) - 1]
    block_args = ", ".join([f"%{'x' if nibbles else 'q'}: i8"] + [f"%{p}: f16" for p in "dm"[:len(scales)]] + ["%out: f32"])
    field = """
      %h = linalg.index 2 : index
      %hi = arith.index_cast %h : index to i8
      %c4 = arith.constant 4 : i8
      %sh = arith.muli %hi, %c4 : i8
      %s = arith.shrui %x, %sh : i8
      %c15 = arith.constant 15 : i8
      %q = arith.andi %s, %c15 : i8""" if nibbles else ""
    result = f"tensor<{out_shape}xf32>"
    collapse = (f"    %c = tensor.collapse_shape %r [[0], [1], [2, 3]] : {result} into tensor<{n}x{b}x32xf32>\n"
                if nibbles else "")
    ret = "%c" if nibbles else "%r"
    args = ", ".join([f"%qs: {q_type}"] + [f"{s}: {s_type}" for s in scales])
    return f"""
module {{
  util.func private @{name}({args}) -> tensor<{n}x{b}x32xf32> {{
    %e = tensor.empty() : {result}
    %r = linalg.generic {{indexing_maps = [{", ".join([q_map] + [s_map] * len(scales) + [o_map])}],
                         iterator_types = [{", ".join(['"parallel"'] * (4 if nibbles else 3))}]}}
        ins(%qs, {", ".join(scales)} : {q_type}, {", ".join([s_type] * len(scales))}) outs(%e : {result}) {{
    ^bb0({block_args}):{field}{arith}
      linalg.yield %y : f32
    }} -> {result}
{collapse}    util.return {ret} : tensor<{n}x{b}x32xf32>
  }}
}}"""


def _register(type_name: str):
    from .dequant import DEQUANT  # the torch code, run eagerly

    planes = _ARITH[type_name][0]

    class Op(CustomOp):
        signature = f"dequant_{type_name.lower()}({', '.join(f'Tensor {p}' for p in planes)}) -> (Tensor)"

        def select(self, ksel: KernelSelection):
            args = [ksel.arg_tensor(i) for i in range(len(planes))]
            for a in args:
                a.specialize_all_dims()
            qs = args[0].t
            ksel.return_new_tensor([qs.shape[0], qs.shape[1], 32], torch.float32)

        def eager_execute(self, *values):
            return DEQUANT[type_name](dict(zip(planes, values)))

        def generate(self, ksel: KernelSelection, kb: KernelBuilder):
            from iree.turbine.support.ir_imports import RankedTensorType

            n, b = RankedTensorType(kb.arg_bindings[0].type).shape[:2]
            name = f"sharkport_dequant_{type_name.lower()}_{n}x{b}"
            call_mlir_function(kb, name, lambda: _body(type_name, name, n, b))

    Op.__name__ = f"dequant_{type_name.lower()}"
    return CustomOp.register(library=_LIBRARY)(Op)


_OPS = {t: _register(t) for t in _ARITH}


def applies(type_name: str, planes: dict) -> bool:
    """Whether the op dequantizes these planes: a type it knows, planes [N, B, bytes] of static
    shape."""
    if type_name not in _ARITH:
        return False
    qs = planes["qs"]
    return qs.dim() == 3 and all(isinstance(s, int) for p in planes.values() for s in p.shape)


def dequant(type_name: str, planes: dict) -> torch.Tensor:
    """[N, B, 32] float32 values of the planes (see `applies`), as one traced node."""
    return _OPS[type_name](*(planes[p] for p in _ARITH[type_name][0]))
