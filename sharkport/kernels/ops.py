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


def _eager(kind: str, x: torch.Tensor, *planes: torch.Tensor) -> torch.Tensor:
    if kind == "F16":
        return torch.mm(x, planes[0].to(torch.float32).t())
    w = QuantizedTensor(kind, (planes[0].shape[0], x.shape[1]), dict(zip(PLANES[kind], planes))).dequant()
    return torch.mm(quantized_x(x), w.to(torch.float32).t())


def _tensor_type(rank: int, element: str) -> str:
    return f"tensor<{'?x' * rank}{element}>"


def _memref(element: str) -> str:
    """The flat buffer the C function receives. Its offset is part of the type: IREE 3.9 drops a
    binding's offset (the planes of one weight share a buffer) from identity-layout memrefs."""
    return f"memref<?x{'i8' if element == 'ui8' else element}, strided<[1], offset: ?>>"


def _c_name(kind: str) -> str:
    return f"sharkport_matvec_{kind.lower()}"


def _function_name(kind: str) -> str:
    return f"{_c_name(kind)}_dispatch"


def _module(kind: str, arg_types: list[tuple[int, str]]) -> str:
    """MLIR module text of the kernel for `kind`: util.func `_function_name(kind)` taking x and the
    planes (all dims dynamic), which dispatches the C function over ceil(N / rows) workgroups of
    `rows` outputs each (see kernels.ROW_QUANTUM)."""
    c_name, name = _c_name(kind), _function_name(kind)
    types = [_tensor_type(r, e) for r, e in arg_types]
    elements = [e for _, e in arg_types] + ["f32"]
    n_args = len(arg_types) + 1
    bindings = ", ".join(f"%b{i}: !stream.binding" for i in range(n_args))
    subspans = "\n".join(
        f"        %s{i} = stream.binding.subspan %b{i}[%c0] : !stream.binding -> {_memref(e)}{{%size{i}}}"
        for i, e in enumerate(elements))
    sizes = "\n".join(_size(i, spec) for i, spec in enumerate(SIZES[kind]))
    memrefs = ", ".join(_memref(e) for e in elements)
    args = ", ".join(f"%a{i}" for i in range(len(arg_types)))
    dims = ["{" + ", ".join(f"%a{i}d{j}" for j in range(rank)) + "}" for i, (rank, _) in enumerate(arg_types)]
    dim_ops = "\n".join(f"    %a{i}d{j} = tensor.dim %a{i}, %c{j} : {types[i]}"
                        for i, (rank, _) in enumerate(arg_types) for j in range(rank))
    operand_types = ", ".join(f"{t}{d}" for t, d in zip(types, dims))
    return f"""
module {{
  stream.executable private @{c_name}_executable attributes {{
    hal.executable.objects = #hal.executable.objects<{{
      #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [
        #hal.executable.object<{{path = "{object_path().name}"}}>
      ]
    }}>
  }} {{
    stream.executable.export public @{c_name}_entry workgroups(%n: index, %rows: index) -> (index, index, index) {{
      %x = arith.ceildivui %n, %rows : index
      %c1 = arith.constant 1 : index
      stream.return %x, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @{c_name}({memrefs}, index, index, index, index, index) attributes {{hal.import.static}}
      func.func @{c_name}_entry({bindings}, %m: index, %n: index, %k: index, %rows: index) {{
        %c0 = arith.constant 0 : index
        %wg = hal.interface.workgroup.id[0] : index
{sizes}
{subspans}
        func.call @{c_name}({", ".join(f"%s{i}" for i in range(n_args))}, %m, %n, %k, %rows, %wg) : ({memrefs}, index, index, index, index, index) -> ()
        return
      }}
    }}
  }}
  util.func private @{name}({", ".join(f"%a{i}: {t}" for i, t in enumerate(types))}) -> tensor<?x?xf32> {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %c2 = arith.constant 2 : index
{dim_ops}
    %rows = affine.min affine_map<()[s0] -> ((s0 ceildiv {ROW_QUANTUM * WORKGROUPS}) * {ROW_QUANTUM}, {MAX_ROWS_PER_WORKGROUP})>()[%a1d0]
    %y = flow.dispatch @{c_name}_executable::@{c_name}_entry[%a1d0, %rows]({args}, %a0d0, %a1d0, %a0d1, %rows) : ({operand_types}, index, index, index, index) -> tensor<?x?xf32>{{%a0d0, %a1d0}}
    util.return %y : tensor<?x?xf32>
  }}
}}"""


def _size(i: int, spec) -> str:
    """MLIR computing binding i's element count %size{i} from %m, %n and %k (see SIZES)."""
    (a, b), divisor = (spec, 1) if isinstance(spec, str) else spec
    return (f"        %d{i} = arith.constant {divisor} : index\n"
            f"        %p{i} = arith.muli %{a}, %{b} : index\n"
            f"        %size{i} = arith.divui %p{i}, %d{i} : index")


def _register(kind: str):
    planes = PLANES[kind]

    class Op(CustomOp):
        signature = f"matvec_{kind.lower()}(Tensor x, {', '.join(f'Tensor {p}' for p in planes)}) -> (Tensor)"

        def select(self, ksel: KernelSelection):
            x = ksel.arg_tensor(0)
            first = ksel.arg_tensor(1)
            for i in range(2, len(planes) + 1):
                ksel.arg_tensor(i)
            ksel.return_new_tensor([x.t.shape[0], first.t.shape[0]], torch.float32)

        def eager_execute(self, x, *planes_):
            return _eager(kind, x, *planes_)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder):
            from iree.turbine.support.ir_imports import RankedTensorType

            types = [RankedTensorType(value.type) for value in kb.arg_bindings]
            arg_types = [(t.rank, str(t.element_type)) for t in types]
            call_mlir_function(kb, _function_name(kind), lambda: _module(kind, arg_types))

    Op.__name__ = f"matvec_{kind.lower()}"
    return CustomOp.register(library=_LIBRARY)(Op)


OPS = {kind: _register(kind) for kind in PLANES}


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
    layer [1]) -> [B, H*D], dispatching the C function over B * kv_heads workgroups."""
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
  stream.executable private @{name}_executable attributes {{
    hal.executable.objects = #hal.executable.objects<{{
      #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [
        #hal.executable.object<{{path = "{object_path().name}"}}>
      ]
    }}>
  }} {{
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
    """The same attention in torch, from the cache as laid out by sharkport.layers.PagedCache."""
    B, (H, Hkv, D, S) = q.shape[0], (shape.heads, shape.kv_heads, shape.head_dim, shape.stride)
    rows = cache.view(-1, shape.layers, 2, S, Hkv, D)[pages.flatten(), int(layer[0])]  # [B*blocks, 2, S, Hkv, D]
    rows = rows.view(B, -1, 2, S, Hkv, D).transpose(1, 2).reshape(B, 2, -1, Hkv, D)
    k, v = rows[:, 0].float(), rows[:, 1].float()  # [B, T, Hkv, D]
    qh = q.view(B, Hkv, H // Hkv, D)
    scores = torch.einsum("bhgd,bthd->bhgt", qh, k) * shape.scale
    hidden = torch.arange(k.shape[1])[None, :] >= lens[:, None]
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    return torch.einsum("bhgt,bthd->bhgd", torch.softmax(scores, -1), v).reshape(B, H * D)


@functools.cache
def attention_op(shape: AttentionShape):
    """The turbine op for decode attention of `shape` (one op per shape: its constants are in its
    name): op(q [B, H*D], cache_state [P, page_elems], pages [B, blocks], seq_lens [B],
    layer [1]) -> [B, H*D]."""

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
