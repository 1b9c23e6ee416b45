"""The kernels as turbine custom ops: under tracing, a `flow.dispatch` of a `stream.executable`
linking matvec.c's object; eagerly, the same product in torch."""

from __future__ import annotations

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
