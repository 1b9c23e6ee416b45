"""One traced transformer block per exported function, called for every layer.

torch.export takes time for every traced node (tracing, decomposition, turbine's import), and a
model's blocks differ mostly in their weights and cache layer. So before the exporter traces the
functions, `BlockTracer` swaps the model's blocks for calls (`BlockCall`), which emit each block
as one node: a turbine custom op `sharkport_block.call{N}(name, layer, h, *inputs, cache)` that
updates `cache` in place and returns the new h. Blocks of equal weight structure and
`CausalLM.block_key` share a block function. Once the functions are traced, each block function
is traced alone (`export_block`): the recipe's block (`CausalLM.make_block`, then the export's
transformation, such as the kernels') over its weights and cache layer as arguments. When turbine expands the custom
ops into MLIR, the first call of a block imports its program as the private function `name`
(turbine's importer, then its custom-op expansion: the dequantization and kernel ops inside the
block), and every call becomes a `func.call` of it on the layer's parameters (`util.global`s of
the archive names that `externalize` gave the weights, as turbine would make them), the layer
index and the call's tensors.

iree-compile inlines the calls, so the compiled module is the one the unrolled trace gives: the
cache is threaded through the calls as a value (auto_functionalized) and written in place.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import sympy
import torch
from iree.turbine.aot import DeviceTensorTrait, ExternalTensorTrait
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, def_library

from ..archive import QuantizedTensor, Theta
from ..errors import SharkportError

_LIBRARY = def_library("sharkport_block")

# While turbine imports a module (`programs`): the traced blocks by function name, and each
# layer's parameters (archive scope, name, shape, dtype) in block argument order.
_PROGRAMS: dict[str, torch.export.ExportedProgram] = {}
_PARAMS: dict[int, list[tuple[str, str, tuple, torch.dtype]]] = {}


@dataclass(frozen=True)
class TensorMeta:
    """A traced tensor's dtype and shape: ints, or sympy expressions of the trace's symbols."""

    dtype: torch.dtype
    shape: tuple

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(t.dtype, tuple(d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in t.shape))


@dataclass
class Block:
    """What `export_block` needs to trace one block function: how to build the block over a
    layer's weights (`make(theta, layer)`), which of its functions (`kind`), the weights' layout
    (`structure`) and a layer's weights as examples, and the traced args it was called with."""

    make: Callable
    kind: str
    structure: tuple
    weights: list[torch.Tensor]
    h: TensorMeta
    inputs: list[TensorMeta]
    cache: TensorMeta
    shape_env: object  # the outer trace's ShapeEnv (symbol ranges and example values)


def _flatten(theta: Theta) -> tuple[tuple, list[torch.Tensor]]:
    """A block's weights as a flat tensor list, and the structure that rebuilds them
    (`_unflatten`): names, quantization types and row layouts, plane names, shapes and dtypes. Layers of equal
    structure share a block function."""
    structure, flat = [], []
    for name in sorted(theta.names()):
        w = theta[name]
        if isinstance(w, QuantizedTensor):
            planes = sorted(w.planes)
            structure.append((name, (w.type_name, w.interleaved), w.shape,
                              tuple((p, tuple(w.planes[p].shape), w.planes[p].dtype) for p in planes)))
            flat.extend(w.planes[p] for p in planes)
        else:
            structure.append((name, None, tuple(w.shape), w.dtype))
            flat.append(w)
    return tuple(structure), flat


def _unflatten(structure: tuple, flat) -> Theta:
    tensors, it = {}, iter(flat)
    for name, quantized, shape, planes in structure:
        if quantized is None:
            tensors[name] = next(it)
        else:
            type_name, interleaved = quantized
            tensors[name] = QuantizedTensor(type_name, shape, {p: next(it) for p, _, _ in planes}, interleaved)
    return Theta(tensors)


class BlockTracer:
    """Swaps `model.blocks` for `BlockCall`s, unless its weights would be inlined into the module
    or placed on devices (then every block is traced as it is). While the exporter traces function
    `program`, records the block functions to trace (`blocks`, by function name) and each layer's
    parameters (`params`, by layer). `transform` is what the export does to a built block."""

    def __init__(self, model, transform: Callable):
        self.model, self.transform = model, transform
        self.blocks: dict[str, Block] = {}
        self.params: dict[int, list[tuple[str, str, tuple, torch.dtype]]] = {}
        self.program = ""
        self._count: dict[str, int] = {}  # block functions of each program so far
        self._names: dict[tuple[str, tuple], str] = {}  # (program, structure and key) -> block function
        theta = getattr(model, "theta", None)
        if not isinstance(theta, Theta):
            return
        self._layers = [_flatten(theta("blk", i)) for i in range(len(model.blocks))]
        if all(ExternalTensorTrait.get(w) and not DeviceTensorTrait.get(w) for _, ws in self._layers for w in ws):
            model.blocks = torch.nn.ModuleList(BlockCall(self, i) for i in range(len(model.blocks)))

    def call(self, kind: str, i: int, h, inputs, cache_state):
        """Block i's `kind` on h as a call of its block function."""
        structure, weights = self._layers[i]
        key = (self.program, structure, self.model.block_key(i))
        name = self._names.get(key)
        if name is None:
            count = self._count[self.program] = self._count.get(self.program, -1) + 1
            name = self._names[key] = f"sharkport_block_{self.program}_{count}"
            make = lambda theta, layer, i=i: self.transform(self.model.make_block(theta, i, layer))  # noqa: E731
            self.blocks[name] = Block(make, kind, structure, weights, TensorMeta.of(h),
                                      [TensorMeta.of(t) for t in inputs], TensorMeta.of(cache_state),
                                      _shape_env(h, *inputs, cache_state))
        self.params[i] = [_param(w) for w in weights]
        return _call_op(1 + len(inputs))(name, i, h, *inputs, cache_state)


class BlockCall(torch.nn.Module):
    """Block i of a model as a call of its block function (see BlockTracer)."""

    def __init__(self, tracer: BlockTracer, i: int):
        super().__init__()
        self.tracer, self.i = tracer, i

    def prefill(self, h, *args):
        return self.tracer.call("prefill", self.i, h, args[:-1], args[-1])

    def decode(self, h, *args):
        return self.tracer.call("decode", self.i, h, args[:-1], args[-1])


def _param(w: torch.Tensor) -> tuple[str, str, tuple, torch.dtype]:
    trait = ExternalTensorTrait.get(w)
    return trait.external_scope, trait.external_name, tuple(w.shape), w.dtype


def _shape_env(*tensors):
    for t in tensors:
        for d in t.shape:
            if isinstance(d, torch.SymInt):
                return d.node.shape_env
    return None


class _BlockModule(torch.nn.Module):
    """forward(h, *inputs, layer, *weights, cache): the block over the weights and cache layer,
    its `kind` on h, the inputs and the cache, which it updates in place."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, h, *args):
        b = self.block
        n = len(b.inputs)
        inputs, layer, weights, cache = args[:n], args[n], args[n + 1:-1], args[-1]
        return getattr(b.make(_unflatten(b.structure, weights), layer), b.kind)(h, *inputs, cache)


def _example_args(block: Block):
    """Example tensors of the traced sizes, and torch.export dims for the symbolic ones (one Dim
    per symbol of the outer trace, with its range; `32 * s0` becomes the derived dim `32 * d0`)."""
    env = block.shape_env
    dims: dict[sympy.Symbol, object] = {}

    def dim(expr):
        if isinstance(expr, (int, sympy.Integer)):
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            if expr not in dims:
                r = env.var_to_range[expr]
                kw = {"max": int(r.upper)} if isinstance(r.upper, sympy.Integer) else {}
                dims[expr] = torch.export.Dim(f"d{len(dims)}", min=int(r.lower), **kw)
            return dims[expr]
        if isinstance(expr, sympy.Mul):
            return functools.reduce(lambda a, b: a * b, (dim(a) for a in expr.args))
        if isinstance(expr, sympy.Add):
            return functools.reduce(lambda a, b: a + b, (dim(a) for a in expr.args))
        raise SharkportError(f"block export: unsupported symbolic size {expr}")

    def example(meta: TensorMeta):
        sizes = [int(s) if isinstance(s, int) else int(s.xreplace(env.backed_var_to_val)) for s in meta.shape]
        spec = {i: dim(s) for i, s in enumerate(meta.shape) if not isinstance(s, int)}
        return torch.zeros(sizes, dtype=meta.dtype), spec or None

    h, h_spec = example(block.h)
    inputs = [example(m) for m in block.inputs]
    cache, cache_spec = example(block.cache)
    args = (h, *(t for t, _ in inputs), torch.zeros((), dtype=torch.int64), *block.weights, cache)
    specs = (h_spec, (*(s for _, s in inputs), None, *([None] * len(block.weights)), cache_spec))
    return args, specs  # specs as forward(h, *args) takes them


def export_block(block: Block, decompose: Callable) -> torch.export.ExportedProgram:
    """Traces one block function alone; `decompose(program)` finishes it as the exporter does
    its functions."""
    args, specs = _example_args(block)
    program = torch.export.export(_BlockModule(block), args, dynamic_shapes=specs, strict=False)
    program = decompose(program)
    large = [n for n, c in program.constants.items() if isinstance(c, torch.Tensor) and c.numel() > 4096]
    if large:  # a weight read outside the block's theta would be inlined into the module
        raise SharkportError(f"block export: the traced block holds large constants {large}; a block "
                             "must read weights only through its theta")
    return program


@contextlib.contextmanager
def programs(blocks: dict[str, torch.export.ExportedProgram], params: dict[int, list]):
    """Within this block, turbine's expansion of block calls finds the traced blocks by name and
    the layers' parameters."""
    _PROGRAMS.clear()
    _PROGRAMS.update(blocks)
    _PARAMS.clear()
    _PARAMS.update(params)
    try:
        yield
    finally:
        _PROGRAMS.clear()
        _PARAMS.clear()


@functools.cache
def _call_op(n: int):
    """The custom op `call{n}(str name, int layer, Tensor a0..a{n-1}, Tensor(a!) cache) -> Tensor`:
    block function `name` of layer `layer` on h (a0), the other tensors and the cache, which it
    updates in place; returns the new h."""
    tensors = ", ".join(f"Tensor a{i}" for i in range(n))

    class Op(CustomOp):
        signature = f"call{n}(str name, int layer, {tensors}, Tensor(a!) cache) -> Tensor"

        def select(self, ksel: KernelSelection):
            ksel.attr_str(0)
            ksel.attr_int(1)
            h = ksel.arg_tensor(2)
            for i in range(3, n + 2):
                ksel.arg_tensor(i)
            ksel.arg_tensor(n + 2, inplace_tied=True)
            ksel.return_tensor(h.t)

        def eager_execute(self, *args):
            raise SharkportError("block calls run only in exported modules")

        def generate(self, ksel: KernelSelection, kb: KernelBuilder):
            _generate_call(ksel.arg_descs[0].v, ksel.arg_descs[1].v, ksel, kb)

    Op.__name__ = f"call{n}"
    return CustomOp.register(library=_LIBRARY)(Op)


def _generate_call(name: str, layer: int, ksel: KernelSelection, kb: KernelBuilder) -> None:
    from iree.compiler.ir import DenseElementsAttr, FunctionType, IntegerAttr, IntegerType, RankedTensorType, TypeAttr
    from iree.turbine.runtime.op_reg.impl_helper import call_function
    from iree.turbine.support.ir_imports import IrType, arith_d, tensor_d, util_d

    func = _block_function(kb, name)
    ftype = FunctionType(TypeAttr(func.attributes["function_type"]).value)

    def cast(value, to_type):
        return value if value.type == to_type else tensor_d.CastOp(to_type, value).result

    *tensors, cache = (b for b in kb.arg_bindings if b is not None)
    i64 = IntegerType.get_signless(64)
    index = arith_d.constant(RankedTensorType.get([], i64), DenseElementsAttr.get_splat(
        RankedTensorType.get([], i64), IntegerAttr.get(i64, layer)))
    weights = [util_d.GlobalLoadOp(t, g).result for g, t in _param_globals(kb, _PARAMS[layer])]
    operands = [*tensors, index, *weights, cache]
    results = call_function(func, *(cast(v, t) for v, t in zip(operands, ftype.inputs, strict=True)))
    new_cache, h = results  # a program's mutated inputs come before its outputs
    wanted = [IrType.parse(d.mlir_type_asm) for d in (*ksel.result_descs, *ksel.inplace_tied_arg_descs)]
    kb.yield_results(cast(h, wanted[0]), cast(new_cache, wanted[1]))


def _param_globals(kb: KernelBuilder, params) -> list[tuple[str, object]]:
    """The module's util.global of each parameter (made as turbine makes them for the weights a
    traced function reads: `__auto.<name>`, private, initialized from the archive): (symbol,
    type)."""
    from iree.compiler.ir import Attribute, InsertionPoint, Location, Operation, RankedTensorType, StringAttr, TypeAttr
    from iree.turbine.support.conversions import TORCH_DTYPE_TO_IREE_TYPE

    out = []
    for scope, name, shape, dtype in params:
        tensor_type = RankedTensorType.get(list(shape), TORCH_DTYPE_TO_IREE_TYPE[dtype]())
        symbol = f"__auto.{name}"
        try:
            existing = kb.symbol_table[symbol]
        except KeyError:
            initial = Attribute.parse(f"#flow.parameter.named<{StringAttr.get(scope)}::{StringAttr.get(name)}> "
                                      f": {tensor_type}")
            with InsertionPoint.at_block_begin(kb.module_body), Location.unknown():
                op = Operation.create("util.global", attributes={
                    "sym_name": StringAttr.get(symbol), "sym_visibility": StringAttr.get("private"),
                    "type": TypeAttr.get(tensor_type), "initial_value": initial})
            kb.symbol_table.insert(op)
        else:
            assert TypeAttr(existing.attributes["type"]).value == tensor_type, (symbol, tensor_type)
        out.append((symbol, tensor_type))
    return out


def _block_function(kb: KernelBuilder, name: str):
    """The private func `name` in the module being built, imported from the traced block on
    first use."""
    try:
        return kb.symbol_table[name]
    except KeyError:
        pass
    from iree.compiler.extras.fx_importer import FxImporter
    from iree.compiler.passmanager import PassManager
    from iree.turbine.transforms.general.custom_op_expansion import ExpandCustomOpsPass
    from iree.turbine.transforms.merger import Merger

    program = _PROGRAMS.get(name)
    if program is None:
        raise SharkportError(f"block function {name} was not traced (export with sharkport.export)")
    signature = program.graph_signature
    kinds = [s.kind.name for s in signature.output_specs]
    assert kinds == ["USER_INPUT_MUTATION", "USER_OUTPUT"], kinds
    importer = FxImporter(context=kb.context)
    importer.import_frozen_program(program, func_name=name, func_visibility="private")
    module_op = importer.module_op
    # Nested ops (a kernel's stream.executable) are verified on worker threads, which deadlock
    # on the GIL this Python-called code holds (as in sharkport.mlir_ops).
    kb.context.enable_multithreading(False)
    try:
        ExpandCustomOpsPass(module_op).run()
        PassManager.parse("builtin.module(torch-func-backend-type-conversion)", kb.context).run(module_op)
    finally:
        kb.context.enable_multithreading(True)
    _drop_defined(module_op.operation, kb)
    merger = Merger(module_op.operation, kb.module_body.owner, target_symbol_table=kb.symbol_table)
    merger.merge()
    return kb.symbol_table[merger.translate_symbol(name)]


def _drop_defined(source, kb: KernelBuilder) -> None:
    """Erases from `source` the top-level symbols (the dequantization functions and kernel
    executables of other blocks) the target module already defines identically, so that the
    merge neither duplicates nor collides with them. (The target is scanned: turbine's Merger
    moves executables without entering them in the builder's symbol table.)"""
    from iree.compiler.ir import StringAttr

    def symbols(module):
        ops = (op.operation for op in module.regions[0].blocks[0].operations)
        return {StringAttr(op.attributes["sym_name"]).value: op for op in ops if "sym_name" in op.attributes}

    def text(op) -> str:  # value names local to the op, not numbered across the module
        return op.get_asm(use_local_scope=True, assume_verified=True)

    defined = symbols(kb.module_body.owner)
    for sym, op in symbols(source).items():
        if sym in defined and text(defined[sym]) == text(op):
            op.erase()
