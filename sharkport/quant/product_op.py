"""One row of x times a Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 matrix held as stored (rows interleaved
eight at a time, Q5's fifth bits placed by value: quant.interleave_planes), as one traced node: a
turbine custom op whose MLIR body is the dequantization (dequant_op's f32 operations) feeding the
product directly, with no reshape between them, so that IREE puts both in one dispatch. For
targets that keep the weights as stored (llvm-cpu-lean, the GPU presets), where IREE otherwise
writes the whole matrix in float32 in a dispatch of its own and reads it back in the next
(docs/devices.md).

The dequantization is laid out as the archive holds the planes, [G groups of 8 rows, 8, B blocks,
(2 nibbles,) C chunks of 4 bytes, 4], so every operand is read through a permutation of its own
dims; x is viewed with the same block dims. A bit field's shift comes from a small table, not
from its index: IREE 3.9's SPIR-V code generation crashes on the index cast.
"""

from __future__ import annotations

import torch
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, def_library

from ..mlir_ops import call_mlir_function
from . import BLOCK_TYPES, INTERLEAVED_ROWS, interleave_planes
from .dequant_op import _ARITH

_LIBRARY = def_library("sharkport_product")
# each type's planes in operand order, and the MLIR computing %y (f32) from %q (the value's bits)
# and %d, %m (f16 scale and min): dequant_op's, Q5's as Q4's with 16 subtracted in place of 8
_PLANES = {"Q8_0": ("qs", "d"), "Q4_0": ("qs", "d"), "Q4_1": ("qs", "d", "m"),
           "Q5_0": ("qs", "qh", "d"), "Q5_1": ("qs", "qh", "d", "m")}
_ARITHMETIC = {t: _ARITH[t][2] for t in ("Q8_0", "Q4_0", "Q4_1")}
_ARITHMETIC |= {"Q5_0": _ARITH["Q4_0"][2].replace("8.0 : f32", "16.0 : f32"), "Q5_1": _ARITH["Q4_1"][2]}
TYPES = tuple(_PLANES)


def _body(type_name: str, name: str, m: int, g: int, b: int) -> str:
    """MLIR module text of util.func `name`: x [m, 32 b] f32 and the planes of a [8 g, 32 b]
    matrix as stored (qs [g, b, chunks, 8, 4] i8, Q5's qh [g, b, 8, 4] i8, d and m [g, b, 8] f16)
    → x @ w.T [m, 8 g]."""
    planes = _PLANES[type_name]
    nibbles = type_name != "Q8_0"
    chunks = 4 if nibbles else 8  # a block's bytes, four at a time
    rows, k = g * INTERLEAVED_ROWS, b * 32
    value_dims = ["b", "h", "c", "t"] if nibbles else ["b", "c", "t"]  # a row's value 16 h + 4 c + t of block b
    w_dims = ", ".join(["g", "r"] + value_dims)
    w_shape = "x".join(map(str, [g, INTERLEAVED_ROWS, b] + ([2] if nibbles else []) + [chunks, 4]))
    x_shape = [m, b] + ([2] if nibbles else []) + [chunks, 4]
    x_type = f"tensor<{'x'.join(map(str, x_shape))}xf32>"
    q_type, s_type = f"tensor<{g}x{b}x{chunks}x{INTERLEAVED_ROWS}x4xi8>", f"tensor<{g}x{b}x{INTERLEAVED_ROWS}xf16>"
    qh_type = f"tensor<{g}x{b}x{INTERLEAVED_ROWS}x4xi8>"
    scales = ["%d_in", "%m_in"][:len(planes) - planes.index("d")]

    def operand(name: str, type_: str, index: str) -> tuple[str, str, str]:
        return name, type_, f"affine_map<({w_dims}) -> ({index})>"

    operands = [operand("%qs", q_type, "g, b, c, r, t")]
    block_args, constants, field = ["%q: i8"], "", ""
    if nibbles:  # byte 4 c + t of a block holds value 4 c + t (low nibble) and 16 + 4 c + t (high)
        operands.append(operand("%shifts", "tensor<2xi8>", "h"))
        block_args = ["%x: i8", "%sh: i8"]
        constants = "    %shifts = arith.constant dense<[0, 4]> : tensor<2xi8>\n"
        nibble = "%lo" if "qh" in planes else "%q"  # Q5's value is its nibble and fifth bit
        field = f"""
      %s = arith.shrui %x, %sh : i8
      %c15 = arith.constant 15 : i8
      {nibble} = arith.andi %s, %c15 : i8"""
    if "qh" in planes:  # value 16 h + 4 c + t's fifth bit is bit 2 c + h of byte t (FIFTH_BIT_TYPES)
        operands += [operand("%qh", qh_type, "g, b, r, t"), operand("%bits", "tensor<2x4xi8>", "h, c")]
        block_args += ["%hx: i8", "%bit: i8"]
        constants += "    %bits = arith.constant dense<[[0, 2, 4, 6], [1, 3, 5, 7]]> : tensor<2x4xi8>\n"
        field += """
      %hs = arith.shrui %hx, %bit : i8
      %c1 = arith.constant 1 : i8
      %h1 = arith.andi %hs, %c1 : i8
      %c4 = arith.constant 4 : i8
      %h16 = arith.shli %h1, %c4 : i8
      %q = arith.ori %lo, %h16 : i8"""
    operands += [operand(sc, s_type, "g, b, r") for sc in scales]
    block_args += [f"%{p}: f16" for p in "dm"[:len(scales)]] + ["%out: f32"]
    inputs, types, w_maps = (list(column) for column in zip(*operands))
    w_maps.append(f"affine_map<({w_dims}) -> ({w_dims})>")
    arith = _ARITHMETIC[type_name]
    p_dims = f"(i, {w_dims})"
    reduction = ", ".join(value_dims)
    args = ", ".join([f"%x_in: tensor<{m}x{k}xf32>", f"%qs: {q_type}"] + ([f"%qh: {qh_type}"] if "qh" in planes else [])
                     + [f"{sc}: {s_type}" for sc in scales])
    n_w = 2 + len(value_dims)
    return f"""
module {{
  util.func private @{name}({args}) -> tensor<{m}x{rows}xf32> {{
{constants}    %e = tensor.empty() : tensor<{w_shape}xf32>
    %w = linalg.generic {{indexing_maps = [{", ".join(w_maps)}],
                         iterator_types = [{", ".join(['"parallel"'] * n_w)}]}}
        ins({", ".join(inputs)} : {", ".join(types)}) outs(%e : tensor<{w_shape}xf32>) {{
    ^bb0({", ".join(block_args)}):{field}{arith}
      linalg.yield %y : f32
    }} -> tensor<{w_shape}xf32>
    %xb = tensor.expand_shape %x_in [[0], [{", ".join(str(i) for i in range(1, len(x_shape)))}]] output_shape {x_shape}
        : tensor<{m}x{k}xf32> into {x_type}
    %zero = arith.constant 0.0 : f32
    %o = tensor.empty() : tensor<{m}x{g}x{INTERLEAVED_ROWS}xf32>
    %acc = linalg.fill ins(%zero : f32) outs(%o : tensor<{m}x{g}x{INTERLEAVED_ROWS}xf32>) -> tensor<{m}x{g}x{INTERLEAVED_ROWS}xf32>
    %prod = linalg.generic {{indexing_maps = [affine_map<{p_dims} -> (i, {reduction})>, affine_map<{p_dims} -> ({w_dims})>,
                                          affine_map<{p_dims} -> (i, g, r)>],
                         iterator_types = ["parallel", "parallel", "parallel"{', "reduction"' * len(value_dims)}]}}
        ins(%xb, %w : {x_type}, tensor<{w_shape}xf32>) outs(%acc : tensor<{m}x{g}x{INTERLEAVED_ROWS}xf32>) {{
    ^bb0(%xv: f32, %wv: f32, %sum: f32):
      %xw = arith.mulf %xv, %wv : f32
      %s2 = arith.addf %sum, %xw : f32
      linalg.yield %s2 : f32
    }} -> tensor<{m}x{g}x{INTERLEAVED_ROWS}xf32>
    %result = tensor.collapse_shape %prod [[0], [1, 2]] : tensor<{m}x{g}x{INTERLEAVED_ROWS}xf32> into tensor<{m}x{rows}xf32>
    util.return %result : tensor<{m}x{rows}xf32>
  }}
}}"""


def _register(type_name: str):
    planes = _PLANES[type_name]

    class Op(CustomOp):
        signature = f"product_{type_name.lower()}(Tensor x, {', '.join(f'Tensor {p}' for p in planes)}) -> (Tensor)"

        def select(self, ksel: KernelSelection):
            args = [ksel.arg_tensor(i) for i in range(len(planes) + 1)]
            for a in args:
                a.specialize_all_dims()
            x, qs = args[0].t, args[1].t
            ksel.return_new_tensor([x.shape[0], qs.shape[0] * INTERLEAVED_ROWS], torch.float32)

        def eager_execute(self, x, *stored):
            g, b = stored[0].shape[:2]
            held = {p: v.reshape(g * INTERLEAVED_ROWS, b, *([-1] if v.dim() > 3 else [])) for p, v in zip(planes, stored)}
            w = BLOCK_TYPES[type_name].dequant(interleave_planes(type_name, held, inverse=True))
            return x @ w.transpose(0, 1)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder):
            from iree.turbine.support.ir_imports import RankedTensorType

            m = RankedTensorType(kb.arg_bindings[0].type).shape[0]
            g, b = RankedTensorType(kb.arg_bindings[1].type).shape[:2]
            name = f"sharkport_product_{type_name.lower()}_{m}x{g}x{b}"
            call_mlir_function(kb, name, lambda: _body(type_name, name, m, g, b))

    Op.__name__ = f"product_{type_name.lower()}"
    return CustomOp.register(library=_LIBRARY)(Op)


_OPS = {t: _register(t) for t in TYPES}


def applies(rows: torch.Tensor, w) -> bool:
    """Whether the op takes this product: one float32 row of x (a static shape) by a matrix of one
    of TYPES held with its rows interleaved (an archive's QuantizedTensor of a row count that is a
    multiple of 8), its planes of static shapes. At more rows IREE's CPU code dequantizes the
    weights again for each row."""
    return (getattr(w, "type_name", None) in _OPS and getattr(w, "interleaved", False) and rows.dim() == 2
            and rows.shape[0] == 1 and isinstance(rows.shape[1], int) and rows.dtype == torch.float32
            and all(isinstance(s, int) for p in w.planes.values() for s in p.shape))


def product(rows: torch.Tensor, w) -> torch.Tensor:
    """rows [1, K] @ w.T → [1, N] float32 (see `applies`), as one traced node."""
    qs = w.planes["qs"]
    g, b = qs.shape[0] // INTERLEAVED_ROWS, qs.shape[1]
    stored = {"qs": qs.reshape(g, b, qs.shape[2] // 4, INTERLEAVED_ROWS, 4)}
    if "qh" in w.planes:
        stored["qh"] = w.planes["qh"].reshape(g, b, INTERLEAVED_ROWS, 4)
    stored |= {p: w.planes[p].reshape(g, b, INTERLEAVED_ROWS) for p in ("d", "m") if p in w.planes}
    return _OPS[w.type_name](rows, *(stored[p] for p in _PLANES[w.type_name]))
