"""The kernels as turbine custom ops: under tracing, a `flow.dispatch` of a `stream.executable`
linking matvec.c's object; eagerly, the same product in torch."""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import torch
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, def_library

from ..archive.tensors import QuantizedTensor
from ..mlir_ops import call_mlir_function
from . import MAX_ROWS_PER_WORKGROUP, PLANES, ROW_QUANTUM, SIZES, WORKGROUPS, object_path, quantized_x


_LIBRARY = def_library("sharkport_kernels")


# Products one kernel dispatch computes: one matrix; three concatenated (attention's q, k, v of
# one x); two combined as silu(x g^T) * (x u^T) (a SwiGLU's gate and up). form -> matrices.
FORMS = {"matvec": 1, "qkv": 3, "swiglu": 2}


def _dequantized(kind: str, planes, k: int) -> torch.Tensor:
    if kind == "F16":
        return planes[0].to(torch.float32)
    return QuantizedTensor(kind, (planes[0].shape[0], k), dict(zip(PLANES[kind], planes))).dequant().to(torch.float32)


def _eager(kind: str, form: str, x: torch.Tensor, *planes: torch.Tensor) -> torch.Tensor:
    """The kernel's result in torch: x (Q8_0-quantized for quantized weights) times each matrix."""
    x = x if kind == "F16" else quantized_x(x)
    per = len(PLANES[kind])
    ys = [torch.mm(x, _dequantized(kind, planes[i:i + per], x.shape[1]).t()) for i in range(0, len(planes), per)]
    if form == "swiglu":
        return torch.nn.functional.silu(ys[0]) * ys[1]
    return torch.cat([y.flatten() for y in ys]).view(x.shape[0], -1)  # [M, N0] [M, N1] ... in a row


def _tensor_type(rank: int, element: str) -> str:
    return f"tensor<{'?x' * rank}{element}>"


def _memref(element: str) -> str:
    """The flat buffer the C function receives. Its offset is part of the type: IREE 3.9 drops a
    binding's offset (the planes of one weight share a buffer) from identity-layout memrefs."""
    return f"memref<?x{'i8' if element == 'ui8' else element}, strided<[1], offset: ?>>"


def _objects() -> str:
    """The executable attribute naming matvec.c's object, found through compile_mlir's search path
    (IREE 3.9 links object bytes embedded in the MLIR as undefined symbols)."""
    return ('hal.executable.objects = #hal.executable.objects<{#hal.executable.target<"llvm-cpu", '
            f'"embedded-elf-x86_64"> = [#hal.executable.object<{{path = "{object_path().name}"}}>]}}>')


def _c_name(kind: str, form: str) -> str:
    return f"sharkport_matvec_{'' if form == 'matvec' else form + '_'}{kind.lower()}"


def _function_name(kind: str, form: str) -> str:
    return f"{_c_name(kind, form)}_dispatch"


def _module(kind: str, form: str, arg_types: list[tuple[int, str]]) -> str:
    """MLIR module text of the kernel for `kind` and `form`: util.func `_function_name` taking x
    and the matrices' planes (all dims dynamic), which dispatches the C function over
    ceil(N / rows) workgroups of `rows` outputs each (see kernels.ROW_QUANTUM)."""
    c_name, name = _c_name(kind, form), _function_name(kind, form)
    count, per = FORMS[form], len(PLANES[kind])
    types = [_tensor_type(r, e) for r, e in arg_types]
    elements = [e for _, e in arg_types] + ["f32"]
    n_args = len(arg_types) + 1
    # the C function's sizes: M, each matrix's rows (swiglu: one N, the gate's), K
    ns = [f"%n{i}" for i in range(1 if form == "swiglu" else count)]
    bindings = ", ".join(f"%b{i}: !stream.binding" for i in range(n_args))
    subspans = "\n".join(
        f"        %s{i} = stream.binding.subspan %b{i}[%c0] : !stream.binding -> {_memref(e)}{{%size{i}}}"
        for i, e in enumerate(elements))
    x_spec, *plane_specs, y_spec = SIZES[kind]
    specs = [(x_spec, None)] + [(spec, f"%n{i if form != 'swiglu' else 0}") for i in range(count)
                                for spec in plane_specs] + [(y_spec, "%ntotal")]
    sizes = "\n".join(_size(i, spec, n) for i, (spec, n) in enumerate(specs))
    memrefs = ", ".join(_memref(e) for e in elements)
    args = ", ".join(f"%a{i}" for i in range(len(arg_types)))
    dims = ["{" + ", ".join(f"%a{i}d{j}" for j in range(rank)) + "}" for i, (rank, _) in enumerate(arg_types)]
    dim_ops = "\n".join(f"    %a{i}d{j} = tensor.dim %a{i}, %c{j} : {types[i]}"
                        for i, (rank, _) in enumerate(arg_types) for j in range(rank))
    operand_types = ", ".join(f"{t}{d}" for t, d in zip(types, dims))
    n_values = "\n".join(f"    %n{i} = tensor.dim %a{1 + i * per}, %c0 : {types[1 + i * per]}" for i in range(len(ns)))
    sums = _total_rows(len(ns), "    ", "%total")
    entry_ns = ", ".join(f"{n}: index" for n in ns)
    return f"""
module {{
  stream.executable private @{c_name}_executable attributes {{{_objects()}}} {{
    stream.executable.export public @{c_name}_entry workgroups(%n: index, %rows: index) -> (index, index, index) {{
      %x = arith.ceildivui %n, %rows : index
      %c1 = arith.constant 1 : index
      stream.return %x, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @{c_name}({memrefs}, index, {"index, " * len(ns)}index, index, index) attributes {{hal.import.static}}
      func.func @{c_name}_entry({bindings}, %m: index, {entry_ns}, %k: index, %rows: index) {{
        %c0 = arith.constant 0 : index
        %wg = hal.interface.workgroup.id[0] : index
{_total_rows(len(ns), "        ", "%ntotal")}
{sizes}
{subspans}
        func.call @{c_name}({", ".join(f"%s{i}" for i in range(n_args))}, %m, {", ".join(ns)}, %k, %rows, %wg) : ({memrefs}, index, {"index, " * len(ns)}index, index, index) -> ()
        return
      }}
    }}
  }}
  util.func private @{name}({", ".join(f"%a{i}: {t}" for i, t in enumerate(types))}) -> tensor<?x?xf32> {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %c2 = arith.constant 2 : index
{dim_ops}
{n_values}
{sums}
    %rows = affine.min affine_map<()[s0] -> ((s0 ceildiv {ROW_QUANTUM * WORKGROUPS}) * {ROW_QUANTUM}, {MAX_ROWS_PER_WORKGROUP})>()[%total]
    %y = flow.dispatch @{c_name}_executable::@{c_name}_entry[%total, %rows]({args}, %a0d0, {", ".join(ns)}, %a0d1, %rows) : ({operand_types}, index, {"index, " * len(ns)}index, index) -> tensor<?x?xf32>{{%a0d0, %total}}
    util.return %y : tensor<?x?xf32>
  }}
}}"""


def _total_rows(count: int, indent: str, result: str) -> str:
    """MLIR computing `result`, the outputs of a product whose matrices have %n0.. rows: %n0, or
    for q, k, v their sum."""
    if count == 1:
        return f"{indent}{result} = arith.addi %n0, %c0 : index"
    return (f"{indent}{result}_01 = arith.addi %n0, %n1 : index\n"
            f"{indent}{result} = arith.addi {result}_01, %n2 : index")


def _size(i: int, spec, n: str | None) -> str:
    """MLIR computing binding i's element count %size{i} from %m, the row count `n` and %k (see
    SIZES: "mk" is M*K, ("nk", 2) N*K/2, "mn" M*N)."""
    (a, b), divisor = (spec, 1) if isinstance(spec, str) else spec
    value = {"m": "%m", "k": "%k", "n": n}
    return (f"        %d{i} = arith.constant {divisor} : index\n"
            f"        %p{i} = arith.muli {value[a]}, {value[b]} : index\n"
            f"        %size{i} = arith.divui %p{i}, %d{i} : index")


def _register(kind: str, form: str):
    planes = [f"{p}{i}" for i in range(FORMS[form]) for p in PLANES[kind]]
    per = len(PLANES[kind])

    class Op(CustomOp):
        signature = f"{_c_name(kind, form)[len('sharkport_'):]}(Tensor x, {', '.join(f'Tensor {p}' for p in planes)}) -> (Tensor)"

        def select(self, ksel: KernelSelection):
            x = ksel.arg_tensor(0)
            rows = [ksel.arg_tensor(1 + i).t.shape[0] for i in range(len(planes))]
            n = rows[0] if form == "swiglu" else sum(rows[i] for i in range(0, len(planes), per))
            ksel.return_new_tensor([x.t.shape[0], n], torch.float32)

        def eager_execute(self, x, *planes_):
            return _eager(kind, form, x, *planes_)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder):
            from iree.turbine.support.ir_imports import RankedTensorType

            types = [RankedTensorType(value.type) for value in kb.arg_bindings]
            arg_types = [(t.rank, str(t.element_type)) for t in types]
            call_mlir_function(kb, _function_name(kind, form), lambda: _module(kind, form, arg_types))

    Op.__name__ = _c_name(kind, form)
    return CustomOp.register(library=_LIBRARY)(Op)


OPS = {(kind, form): _register(kind, form) for kind in PLANES for form in FORMS}


# ---- decode attention over the paged cache (matvec.c's sharkport_decode_attention) ----

@dataclass(frozen=True)
class AttentionShape:
    """What a decode attention op is specialised for (baked into its MLIR as constants)."""
    heads: int
    kv_heads: int
    head_dim: int
    layers: int  # of the cache
    stride: int  # positions per page
    scale: float

    @property
    def scale_bits(self) -> int:
        """The scale as float32 bits (as the C function receives it)."""
        return struct.unpack("<I", struct.pack("<f", self.scale))[0]

    @property
    def name(self) -> str:
        return (f"sharkport_decode_attention_h{self.heads}_kv{self.kv_heads}_d{self.head_dim}"
                f"_l{self.layers}_s{self.stride}_x{self.scale_bits:08x}")


def _attention_module(shape: AttentionShape) -> str:
    """util.func `shape.name`(q [B, H*D], cache [P, page_elems], pages [B, blocks], lens [B],
    layer [2]: the cache layer, then the layer count) -> [B, H*D], dispatching the C function
    over B * kv_heads workgroups."""
    name, c_name = shape.name, "sharkport_decode_attention"
    f32, i64 = _memref("f32"), _memref("i64")
    memrefs = ", ".join([f32, f32, i64, i64, i64, f32])
    bindings = ", ".join(f"%b{i}: !stream.binding" for i in range(6))
    sizes = ["%nq", "%ncache", "%npages", "%nb", "%c1", "%nq"]
    subspans = "\n".join(
        f"        %s{i} = stream.binding.subspan %b{i}[%c0] : !stream.binding -> {t}{{{n}}}"
        for i, (t, n) in enumerate(zip([f32, f32, i64, i64, i64, f32], sizes)))
    return f"""
module {{
  stream.executable private @{name}_executable attributes {{{_objects()}}} {{
    stream.executable.export public @{name}_entry workgroups(%w: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %w, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @{c_name}({memrefs}, index, index, index, index, index, index, f32, index) attributes {{hal.import.static}}
      func.func @{name}_entry({bindings}, %nq: index, %ncache: index, %npages: index, %nb: index, %blocks: index) {{
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
        %wg = hal.interface.workgroup.id[0] : index
{subspans}
        %h = arith.constant {shape.heads} : index
        %hkv = arith.constant {shape.kv_heads} : index
        %d = arith.constant {shape.head_dim} : index
        %l = arith.constant {shape.layers} : index
        %stride = arith.constant {shape.stride} : index
        %scale = arith.constant 0x{shape.scale_bits:08X} : f32
        func.call @{c_name}(%s0, %s1, %s2, %s3, %s4, %s5, %blocks, %h, %hkv, %d, %l, %stride, %scale, %wg) : ({memrefs}, index, index, index, index, index, index, f32, index) -> ()
        return
      }}
    }}
  }}
  util.func private @{name}(%q: tensor<?x?xf32>, %cache: tensor<?x?xf32>, %pages: tensor<?x?xi64>, %lens: tensor<?xi64>, %layer: tensor<?xi64>) -> tensor<?x?xf32> {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %qd0 = tensor.dim %q, %c0 : tensor<?x?xf32>
    %qd1 = tensor.dim %q, %c1 : tensor<?x?xf32>
    %cd0 = tensor.dim %cache, %c0 : tensor<?x?xf32>
    %cd1 = tensor.dim %cache, %c1 : tensor<?x?xf32>
    %pd0 = tensor.dim %pages, %c0 : tensor<?x?xi64>
    %pd1 = tensor.dim %pages, %c1 : tensor<?x?xi64>
    %ld0 = tensor.dim %lens, %c0 : tensor<?xi64>
    %yd0 = tensor.dim %layer, %c0 : tensor<?xi64>
    %nq = arith.muli %qd0, %qd1 : index
    %ncache = arith.muli %cd0, %cd1 : index
    %npages = arith.muli %pd0, %pd1 : index
    %hkv = arith.constant {shape.kv_heads} : index
    %wgs = arith.muli %qd0, %hkv : index
    %y = flow.dispatch @{name}_executable::@{name}_entry[%wgs](%q, %cache, %pages, %lens, %layer, %nq, %ncache, %npages, %ld0, %pd1) : (tensor<?x?xf32>{{%qd0, %qd1}}, tensor<?x?xf32>{{%cd0, %cd1}}, tensor<?x?xi64>{{%pd0, %pd1}}, tensor<?xi64>{{%ld0}}, tensor<?xi64>{{%yd0}}, index, index, index, index, index) -> tensor<?x?xf32>{{%qd0, %qd1}}
    util.return %y : tensor<?x?xf32>
  }}
}}"""


def _attention_eager(shape: AttentionShape, q, cache, pages, lens, layer) -> torch.Tensor:
    """The same attention in torch: the pages read as sharkport.layers.PagedCache lays them out,
    then ops.attention under a length mask."""
    from ..layers.paged_cache import PagedCache
    from ..ops import attention, length_mask

    B, H, D = q.shape[0], shape.heads, shape.head_dim
    k, v = PagedCache(shape.layers, shape.kv_heads, D, shape.stride).read(cache, int(layer[0]), pages, q.dtype)
    out = attention(q.view(B, 1, H, D), k, v, length_mask(lens, k.shape[1], q.dtype), shape.scale)
    return out.reshape(B, H * D)


@functools.cache
def attention_op(shape: AttentionShape):
    """The turbine op for decode attention of `shape` (one op per shape: its constants are in its
    name): op(q [B, H*D], cache_state [P, page_elems], pages [B, blocks], seq_lens [B],
    layer [2]) -> [B, H*D]."""

    class Op(CustomOp):
        signature = f"{shape.name}(Tensor q, Tensor cache, Tensor pages, Tensor lens, Tensor layer) -> (Tensor)"

        def select(self, ksel: KernelSelection):
            q = ksel.arg_tensor(0)
            for i in range(1, 5):
                ksel.arg_tensor(i)
            ksel.return_new_tensor(list(q.t.shape), torch.float32)

        def eager_execute(self, q, cache, pages, lens, layer):
            return _attention_eager(shape, q, cache, pages, lens, layer)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder):
            call_mlir_function(kb, shape.name, lambda: _attention_module(shape))

    Op.__name__ = shape.name
    return CustomOp.register(library=_LIBRARY)(Op)
