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
from . import (BLOCK_CHUNK_ROWS, MAX_ROWS_PER_WORKGROUP, PLANES, ROW_QUANTUM, SIZES, STORED, block_counters,
               deinterleave_rows, object_path, quantized_x, workgroups)


_LIBRARY = def_library("sharkport_kernels")


@dataclass(frozen=True)
class Form:
    """What one kernel dispatch of a product computes (matvec.c's C functions)."""
    matrices: int  # products of one x: 1; 3 concatenated (attention's q, k, v); 2 as SwiGLU's
    swiglu: bool = False  # y = silu(x a^T) * (x b^T)
    norm: bool = False  # x RMS-normalized first by a weight [K] (the operand after x) and eps
    residual: bool = False  # y = r + x w^T (r [M, N], the operand after the planes)


FORMS = {"matvec": Form(1), "matvec_add": Form(1, residual=True), "matvec_norm": Form(1, norm=True),
         "qkv": Form(3), "qkv_norm": Form(3, norm=True),
         "swiglu": Form(2, swiglu=True), "swiglu_norm": Form(2, swiglu=True, norm=True)}


def _dequantized(kind: str, planes, k: int) -> torch.Tensor:
    if kind == "F16":
        return planes[0].to(torch.float32)
    if kind in STORED:
        kind, planes = STORED[kind], deinterleave_rows(planes)
    return QuantizedTensor(kind, (planes[0].shape[0], k), dict(zip(PLANES[kind], planes))).dequant().to(torch.float32)


def _eager(kind: str, form: Form, x: torch.Tensor, *args) -> torch.Tensor:
    """The kernel's result in torch: x (normalized as ops.rms_norm, then Q8_0-quantized for
    quantized weights) times each matrix."""
    from ..ops import rms_norm

    if form.norm:
        *args, eps = args
        g, *args = args
        x = rms_norm(x, g, eps)
    planes, residual = (args[:-1], args[-1]) if form.residual else (args, None)
    x = x if kind == "F16" else quantized_x(x)
    per = len(PLANES[kind])
    ys = [torch.mm(x, _dequantized(kind, planes[i:i + per], x.shape[1]).t()) for i in range(0, len(planes), per)]
    if form.swiglu:
        return torch.nn.functional.silu(ys[0]) * ys[1]
    y = torch.cat([y.flatten() for y in ys]).view(x.shape[0], -1)  # [M, N0] [M, N1] ... in a row
    return y if residual is None else residual + y


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
    """matvec.c's function: sharkport_matvec_<type>, and sharkport_matvec_<form>_<type> for the
    other forms (a form's own "matvec_" dropped: sharkport_matvec_add_<type>)."""
    name = form.removeprefix("matvec").lstrip("_")
    return "_".join(["sharkport_matvec", *([name] if name else []), kind.lower()])


def _stem(kind: str, form: str, eps: float | None) -> str:
    """The name of the util.func calling the kernel (<stem>_dispatch) and of its executable
    (<stem>_executable): the C function's, and a norm's eps, which is baked into both."""
    return f"{_c_name(kind, form)}{'' if eps is None else f'_e{_float_bits(eps):08x}'}"


def _module(kind: str, form_name: str, arg_types: list[tuple[int, str]], eps: float | None) -> str:
    """MLIR module text of the kernel for `kind` and `form_name`: util.func <_stem>_dispatch taking
    the op's tensors (x, the norm's weight, the matrices' planes, the residual; all dims dynamic),
    which dispatches the C function over ceil(N / rows) workgroups of `rows` outputs each (see
    kernels.ROW_QUANTUM)."""
    form = FORMS[form_name]
    c_name, stem = _c_name(kind, form_name), _stem(kind, form_name, eps)
    per, first_plane = len(PLANES[kind]), 2 if form.norm else 1
    types = [_tensor_type(r, e) for r, e in arg_types]
    elements = [e for _, e in arg_types] + ["f32"]
    n_args = len(arg_types) + 1
    # the C function's sizes: M, each matrix's rows (swiglu: one N, the gate's), K
    ns = [f"%n{i}" for i in range(1 if form.swiglu else form.matrices)]
    bindings = ", ".join(f"%b{i}: !stream.binding" for i in range(n_args))
    subspans = "\n".join(
        f"        %s{i} = stream.binding.subspan %b{i}[%c0] : !stream.binding -> {_memref(e)}{{%size{i}}}"
        for i, e in enumerate(elements))
    x_spec, *plane_specs, y_spec = SIZES[kind]
    specs = ([(x_spec, None)] + ([("k1", None)] if form.norm else [])
             + [(spec, f"%n{0 if form.swiglu else i}") for i in range(form.matrices) for spec in plane_specs]
             + ([(y_spec, "%ntotal")] if form.residual else []) + [(y_spec, "%ntotal")])
    sizes = "\n".join(_size(i, spec, n) for i, (spec, n) in enumerate(specs))
    memrefs = ", ".join(_memref(e) for e in elements)
    args = ", ".join(f"%a{i}" for i in range(len(arg_types)))
    dims = ["{" + ", ".join(f"%a{i}d{j}" for j in range(rank)) + "}" for i, (rank, _) in enumerate(arg_types)]
    dim_ops = "\n".join(f"    %a{i}d{j} = tensor.dim %a{i}, %c{j} : {types[i]}"
                        for i, (rank, _) in enumerate(arg_types) for j in range(rank))
    operand_types = ", ".join(f"{t}{d}" for t, d in zip(types, dims))
    n_values = "\n".join(f"    %n{i} = tensor.dim %a{first_plane + i * per}, %c0 : {types[first_plane + i * per]}"
                         for i in range(len(ns)))
    sums = _total_rows(len(ns), "    ", "%total")
    entry_ns = ", ".join(f"{n}: index" for n in ns)
    eps_type, eps_arg = (", f32", ", %eps") if form.norm else ("", "")
    eps_op = f"\n        %eps = arith.constant 0x{_float_bits(eps):08X} : f32" if form.norm else ""
    call_types = f"({memrefs}, index, {'index, ' * len(ns)}index, index, index{eps_type})"
    return f"""
module {{
  stream.executable private @{stem}_executable attributes {{{_objects()}}} {{
    stream.executable.export public @{c_name}_entry workgroups(%n: index, %rows: index) -> (index, index, index) {{
      %x = arith.ceildivui %n, %rows : index
      %c1 = arith.constant 1 : index
      stream.return %x, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @{c_name}{call_types} attributes {{hal.import.static}}
      func.func @{c_name}_entry({bindings}, %m: index, {entry_ns}, %k: index, %rows: index) {{
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
        %wg = hal.interface.workgroup.id[0] : index{eps_op}
{_total_rows(len(ns), "        ", "%ntotal")}
{sizes}
{subspans}
        func.call @{c_name}({", ".join(f"%s{i}" for i in range(n_args))}, %m, {", ".join(ns)}, %k, %rows, %wg{eps_arg}) : {call_types} -> ()
        return
      }}
    }}
  }}
  util.func private @{stem}_dispatch({", ".join(f"%a{i}: {t}" for i, t in enumerate(types))}) -> tensor<?x?xf32> {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %c2 = arith.constant 2 : index
{dim_ops}
{n_values}
{sums}
    %rows = affine.min affine_map<()[s0] -> ((s0 ceildiv {ROW_QUANTUM * workgroups()}) * {ROW_QUANTUM}, {MAX_ROWS_PER_WORKGROUP})>()[%total]
    %y = flow.dispatch @{stem}_executable::@{c_name}_entry[%total, %rows]({args}, %a0d0, {", ".join(ns)}, %a0d1, %rows) : ({operand_types}, index, {"index, " * len(ns)}index, index) -> tensor<?x?xf32>{{%a0d0, %total}}
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
    SIZES: "mk" is M*K, ("nk", 2) N*K/2, "mn" M*N; "k1" is K)."""
    (a, b), divisor = (spec, 1) if isinstance(spec, str) else spec
    value = {"m": "%m", "k": "%k", "n": n, "1": "%c1"}
    return (f"        %d{i} = arith.constant {divisor} : index\n"
            f"        %p{i} = arith.muli {value[a]}, {value[b]} : index\n"
            f"        %size{i} = arith.divui %p{i}, %d{i} : index")


def _register(kind: str, form_name: str):
    form = FORMS[form_name]
    planes = [f"{p}{i}" for i in range(form.matrices) for p in PLANES[kind]]
    per, first_plane = len(PLANES[kind]), 2 if form.norm else 1
    tensors = ["x"] + (["g"] if form.norm else []) + planes + (["r"] if form.residual else [])
    eps_arg = ", float eps" if form.norm else ""

    class Op(CustomOp):
        signature = (f"{_c_name(kind, form_name)[len('sharkport_'):]}({', '.join(f'Tensor {t}' for t in tensors)}"
                     f"{eps_arg}) -> (Tensor)")

        def select(self, ksel: KernelSelection):
            x, *args = [ksel.arg_tensor(i) for i in range(len(tensors))]
            if form.norm:
                ksel.attr_float(len(tensors))
            rows = [args[first_plane - 1 + i].t.shape[0] for i in range(len(planes))]
            n = rows[0] if form.swiglu else sum(rows[i] for i in range(0, len(planes), per))
            ksel.return_new_tensor([x.t.shape[0], n], torch.float32)

        def eager_execute(self, x, *args):
            return _eager(kind, form, x, *args)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder):
            from iree.turbine.support.ir_imports import RankedTensorType

            types = [RankedTensorType(value.type) for value in kb.arg_bindings if value is not None]
            arg_types = [(t.rank, str(t.element_type)) for t in types]
            eps = float(ksel.arg_descs[len(tensors)].v) if form.norm else None
            call_mlir_function(kb, f"{_stem(kind, form_name, eps)}_dispatch",
                               lambda: _module(kind, form_name, arg_types, eps))

    Op.__name__ = _c_name(kind, form_name)
    return CustomOp.register(library=_LIBRARY)(Op)


OPS = {(kind, form): _register(kind, form) for kind in PLANES for form in FORMS}


def _float_bits(value: float) -> int:
    """A float32's bits: how the kernels' float constants are written into MLIR and names."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


# ---- decode attention over the paged cache, with the new position's write (matvec.c's
#      sharkport_decode_attention) ----

@dataclass(frozen=True)
class AttentionShape:
    """What a decode attention op is specialised for (baked into its MLIR as constants)."""
    heads: int
    kv_heads: int
    head_dim: int
    layers: int  # of the cache
    stride: int  # positions per page
    scale: float
    rope_dim: int = 0  # dims each head rotates (0: no rotary)
    rope_layout: str = "interleaved"  # pairs (2i, 2i+1), or "half": (i, i + rope_dim/2)
    cache_dtype: str = "f32"  # of the cache's elements: "f32" or "f16"
    # the workgroups take a sequence and this many of its kv heads (a divisor of kv_heads): all of
    # them read each page whole, in address order; fewer share a sequence among more workgroups
    # (kernels.kv_heads_per_workgroup chooses)
    kv_heads_per_workgroup: int = 1

    @property
    def scale_bits(self) -> int:
        """The scale as float32 bits (as the C function receives it)."""
        return _float_bits(self.scale)

    @property
    def name(self) -> str:
        rope = f"_r{self.rope_dim}{'i' if self.rope_layout == 'interleaved' else 'h'}" if self.rope_dim else ""
        walk = f"_w{self.kv_heads_per_workgroup}" if self.kv_heads_per_workgroup > 1 else ""
        return (f"sharkport_decode_attention_h{self.heads}_kv{self.kv_heads}_d{self.head_dim}"
                f"_l{self.layers}_s{self.stride}_x{self.scale_bits:08x}{rope}{walk}{self.c_suffix}")

    @property
    def c_suffix(self) -> str:
        """The C functions' suffix for the cache's element type (matvec.c)."""
        return "" if self.cache_dtype == "f32" else f"_{self.cache_dtype}"


# The decode attention kernel's tensor operands: (name, element type, rank), the cache's element
# type that of the shape. The cache is updated in place (a result tied to it); the attention's
# output is a new [B, H*D].
def _attention_args(shape: AttentionShape):
    return (("q", "f32", 2), ("k", "f32", 2), ("v", "f32", 2), ("cache", shape.cache_dtype, 2), ("pages", "i64", 2),
            ("starts", "i64", 1), ("lens", "i64", 1), ("layer", "i64", 1), ("cos", "f32", 2), ("sin", "f32", 2))


def _paged_module(name: str, c_name: str, args, constants: list[tuple[str, str]], per_sequence: int) -> str:
    """MLIR module text of util.func `name` over tensor operands `args` (see _attention_args),
    dispatching C function `c_name` over B * per_sequence workgroups (B: the first operand's rows).
    The C function takes each operand's memref and the new result's, then the pages' columns
    (blocks), the `constants` (MLIR value, type) and the workgroup id. Its results are a new
    tensor shaped as the first operand, and the "cache" operand updated in place."""
    n = len(args)
    names = [a for a, _, _ in args]
    types = [f"tensor<{'?x' * rank}{e}>" for _, e, rank in args]
    elements = [e for _, e, _ in args] + ["f32"]
    memrefs = ", ".join(_memref(e) for e in elements)
    subspans = "\n".join(  # the new result has the first operand's size
        f"        %s{i} = stream.binding.subspan %b{i}[%c0] : !stream.binding -> {_memref(e)}{{%n{i if i < n else 0}}}"
        for i, e in enumerate(elements))
    dims = [[f"%a{i}d{j}" for j in range(rank)] for i, (_, _, rank) in enumerate(args)]
    dim_ops = "\n".join(f"    {d} = tensor.dim %a{i}, %c{j} : {types[i]}" for i, ds in enumerate(dims)
                        for j, d in enumerate(ds))
    counts = "\n".join(f"    %n{i} = arith.muli {ds[0]}, {ds[1]} : index" if len(ds) == 2 else
                       f"    %n{i} = arith.addi {ds[0]}, %c0 : index" for i, ds in enumerate(dims))
    operands = ", ".join(f"{types[i]}{{{', '.join(ds)}}}" for i, ds in enumerate(dims))
    constant_ops = "\n".join(f"        %k{i} = arith.constant {value} : {t}" for i, (value, t) in enumerate(constants))
    constant_types = ", ".join(t for _, t in constants)
    call_args = ", ".join([f"%s{i}" for i in range(len(elements))] + ["%blocks"]
                          + [f"%k{i}" for i in range(len(constants))] + ["%wg"])
    pages, cache = names.index("pages"), names.index("cache")
    # The updated cache's rows are computed anew (elements / columns) rather than being the
    # operand's dim: with the same SSA dims, IREE 3.9 merges the import of the cache argument with
    # the one the exported function's final in-place write-back makes, and then copies the whole
    # cache in and out of every call (copy-on-write of a value used twice).
    result_types = f"{types[0]}, {types[cache]}"
    results = f"{types[0]}{{{', '.join(dims[0])}}}, %a{cache}{{%rows, {dims[cache][1]}}}"
    return f"""
module {{
  stream.executable private @{name}_executable attributes {{{_objects()}}} {{
    stream.executable.export public @{name}_entry workgroups(%w: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %w, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @{c_name}({memrefs}, index, {constant_types}, index) attributes {{hal.import.static}}
      func.func @{name}_entry({", ".join(f"%b{i}: !stream.binding" for i in range(len(elements)))}, {", ".join(f"%n{i}: index" for i in range(n))}, %blocks: index) {{
        %c0 = arith.constant 0 : index
        %wg = hal.interface.workgroup.id[0] : index
{subspans}
{constant_ops}
        func.call @{c_name}({call_args}) : ({memrefs}, index, {constant_types}, index) -> ()
        return
      }}
    }}
  }}
  util.func private @{name}({", ".join(f"%a{i}: {t}" for i, t in enumerate(types))}) -> ({result_types}) {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
{dim_ops}
{counts}
    %per_sequence = arith.constant {per_sequence} : index
    %wgs = arith.muli %a0d0, %per_sequence : index
    %rows = arith.divui %n{cache}, {dims[cache][1]} : index
    %y:2 = flow.dispatch @{name}_executable::@{name}_entry[%wgs]({", ".join(f"%a{i}" for i in range(n))}, {", ".join(f"%n{i}" for i in range(n))}, %a{pages}d1) : ({operands}, {", ".join(["index"] * n)}, index) -> ({results})
    util.return %y#0, %y#1 : {result_types}
  }}
}}"""


def _constants(shape: AttentionShape, *names: str) -> list[tuple[str, str]]:
    """The C function's constant arguments `names` of `shape`, in order, as (MLIR value, type)."""
    sizes = {"H": shape.heads, "Hkv": shape.kv_heads, "D": shape.head_dim, "L": shape.layers,
             "stride": shape.stride, "R": shape.rope_dim, "interleaved": int(shape.rope_layout == "interleaved"),
             "hpw": shape.kv_heads_per_workgroup}
    return [(f"0x{shape.scale_bits:08X}", "f32") if n == "scale" else (str(sizes[n]), "index") for n in names]


def _rotated(shape: AttentionShape, x, cos, sin, heads: int):
    """x [B, heads * D] as [B, 1, heads, D], rotated as ops.apply_rope (unless shape has no rotary)."""
    from ..ops import apply_rope

    B = x.shape[0]
    x = x.view(B, 1, heads, shape.head_dim)
    return apply_rope(x, cos.view(B, 1, -1), sin.view(B, 1, -1), shape.rope_layout) if shape.rope_dim else x


def _attention_eager(shape: AttentionShape, q, k, v, cache, pages, starts, lens, layer, cos, sin) -> torch.Tensor:
    """The kernel in torch: k rotated as ops.apply_rope and written into cache as
    sharkport.layers.PagedCache does (in place), then q rotated, the pages read as PagedCache does
    and ops.attention under a length mask."""
    from ..layers.paged_cache import PagedCache
    from ..ops import attention, length_mask

    B, H, Hkv, D = q.shape[0], shape.heads, shape.kv_heads, shape.head_dim
    paged, l = PagedCache(shape.layers, Hkv, D, shape.stride), int(layer[0])
    paged.write_positions(cache, l, _rotated(shape, k, cos, sin, Hkv), v.view(B, 1, Hkv, D), pages, starts)
    q = _rotated(shape, q, cos, sin, H)
    k, v = paged.read(cache, l, pages, q.dtype)
    out = attention(q, k, v, length_mask(lens, k.shape[1], q.dtype), shape.scale)
    return out.reshape(B, H * D)


@functools.cache
def attention_op(shape: AttentionShape):
    """The turbine op for decode attention of `shape` (one op per shape: its constants are in its
    name), writing the new K/V (k rotated) into the cache in place first:
    op(q [B, H*D] before rotary, k [B, Hkv*D] before rotary, v [B, Hkv*D],
    cache_state [P, page_elems], pages [B, blocks], start_positions [B], seq_lens [B], layer [2],
    cos [B, R/2], sin [B, R/2]) -> [B, H*D]."""
    operands = _attention_args(shape)
    args = ", ".join(f"Tensor{'(a!)' if arg == 'cache' else ''} {arg}" for arg, _, _ in operands)

    class Op(CustomOp):
        signature = f"{shape.name}({args}) -> (Tensor)"

        def select(self, ksel: KernelSelection):
            q = ksel.arg_tensor(0)
            for i, (arg, _, _) in enumerate(operands[1:], 1):
                ksel.arg_tensor(i, inplace_tied=arg == "cache")
            ksel.return_new_tensor(list(q.t.shape), torch.float32)

        def eager_execute(self, *args):
            return _attention_eager(shape, *args)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder):
            constants = _constants(shape, "H", "Hkv", "D", "L", "stride", "R", "interleaved", "hpw", "scale")
            call_mlir_function(kb, shape.name, lambda: _paged_module(
                shape.name, f"sharkport_decode_attention{shape.c_suffix}", operands, constants,
                shape.kv_heads // shape.kv_heads_per_workgroup))

    Op.__name__ = shape.name
    return CustomOp.register(library=_LIBRARY)(Op)


# ---- prefill attention over the prompt's own K and V (matvec.c's sharkport_prefill_attention) ----

PREFILL_ROWS = 12  # query positions per workgroup: matvec.c's PREFILL_ROWS


@dataclass(frozen=True)
class PrefillShape:
    """What a prefill attention op is specialised for (baked into its MLIR as constants)."""
    heads: int
    kv_heads: int
    head_dim: int
    scale: float

    @property
    def scale_bits(self) -> int:
        """The scale as float32 bits (as the C function receives it)."""
        return _float_bits(self.scale)

    @property
    def name(self) -> str:
        return f"sharkport_prefill_attention_h{self.heads}_kv{self.kv_heads}_d{self.head_dim}_x{self.scale_bits:08x}"


def _prefill_module(shape: PrefillShape) -> str:
    """MLIR module text of util.func `shape.name`: q [B, S, H*D], k and v [B, S, Hkv*D] → out
    [B, S, H*D], dispatching the C function over B * Hkv * ceil(S / PREFILL_ROWS) workgroups."""
    name, t = shape.name, "tensor<?x?x?xf32>"
    memref = _memref("f32")
    scale = f"0x{shape.scale_bits:08X}"
    return f"""
module {{
  stream.executable private @{name}_executable attributes {{{_objects()}}} {{
    stream.executable.export public @{name}_entry workgroups(%b: index, %s: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      %rows = arith.constant {PREFILL_ROWS} : index
      %hkv = arith.constant {shape.kv_heads} : index
      %blocks = arith.ceildivui %s, %rows : index
      %per_row = arith.muli %blocks, %hkv : index
      %x = arith.muli %b, %per_row : index
      stream.return %x, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @sharkport_prefill_attention({memref}, {memref}, {memref}, {memref}, index, index, index, index, f32, index) attributes {{hal.import.static}}
      func.func @{name}_entry(%bq: !stream.binding, %bk: !stream.binding, %bv: !stream.binding, %bo: !stream.binding, %nq: index, %nkv: index, %s: index) {{
        %c0 = arith.constant 0 : index
        %wg = hal.interface.workgroup.id[0] : index
        %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {memref}{{%nq}}
        %k = stream.binding.subspan %bk[%c0] : !stream.binding -> {memref}{{%nkv}}
        %v = stream.binding.subspan %bv[%c0] : !stream.binding -> {memref}{{%nkv}}
        %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {memref}{{%nq}}
        %h = arith.constant {shape.heads} : index
        %hkv = arith.constant {shape.kv_heads} : index
        %d = arith.constant {shape.head_dim} : index
        %scale = arith.constant {scale} : f32
        func.call @sharkport_prefill_attention(%q, %k, %v, %o, %s, %h, %hkv, %d, %scale, %wg) : ({memref}, {memref}, {memref}, {memref}, index, index, index, index, f32, index) -> ()
        return
      }}
    }}
  }}
  util.func private @{name}(%q: {t}, %k: {t}, %v: {t}) -> {t} {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %c2 = arith.constant 2 : index
    %b = tensor.dim %q, %c0 : {t}
    %s = tensor.dim %q, %c1 : {t}
    %hd = tensor.dim %q, %c2 : {t}
    %kvd = tensor.dim %k, %c2 : {t}
    %bs = arith.muli %b, %s : index
    %nq = arith.muli %bs, %hd : index
    %nkv = arith.muli %bs, %kvd : index
    %y = flow.dispatch @{name}_executable::@{name}_entry[%b, %s](%q, %k, %v, %nq, %nkv, %s) : ({t}{{%b, %s, %hd}}, {t}{{%b, %s, %kvd}}, {t}{{%b, %s, %kvd}}, index, index, index) -> {t}{{%b, %s, %hd}}
    util.return %y : {t}
  }}
}}"""


def _prefill_eager(shape: PrefillShape, q, k, v) -> torch.Tensor:
    """The attention in torch: ops.attention under a causal mask."""
    from ..ops import attention, causal_mask

    B, S, D = q.shape[0], q.shape[1], shape.head_dim
    out = attention(q.view(B, S, shape.heads, D), k.view(B, S, shape.kv_heads, D), v.view(B, S, shape.kv_heads, D),
                    causal_mask(S, q.dtype, q.device), shape.scale)
    return out.reshape(B, S, shape.heads * D)


@functools.cache
def prefill_attention_op(shape: PrefillShape):
    """The turbine op for causal prefill attention of `shape`: op(q [B, S, H*D], k [B, S, Hkv*D],
    v [B, S, Hkv*D], all rotated) -> [B, S, H*D]."""

    class Op(CustomOp):
        signature = f"{shape.name}(Tensor q, Tensor k, Tensor v) -> (Tensor)"

        def select(self, ksel: KernelSelection):
            q = ksel.arg_tensor(0)
            ksel.arg_tensor(1)
            ksel.arg_tensor(2)
            ksel.return_new_tensor(list(q.t.shape), torch.float32)

        def eager_execute(self, q, k, v):
            return _prefill_eager(shape, q, k, v)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder):
            call_mlir_function(kb, shape.name, lambda: _prefill_module(shape))

    Op.__name__ = shape.name
    return CustomOp.register(library=_LIBRARY)(Op)


# ---- a decode layer in one dispatch (matvec.c's sharkport_layer_block_<type>), or two
#      (sharkport_attention_block_<type> and sharkport_ffn_block_<type>) ----

@dataclass(frozen=True)
class BlockShape:
    """What a block op is specialised for (baked into its MLIR as constants): the attention block
    (norm, q/k/v product, decode attention, output product, residual add), the FFN block (norm,
    SwiGLU's products, the down product, residual add) or the layer block (the one, then the other)
    of M rows of h [M, E]."""
    form: str  # "attention", "ffn" or "layer"
    kind: str  # the matrices' kernel type (a key of PLANES)
    rows: int  # M
    width: int  # E
    inner: int  # the FFN's gate rows I (0 for attention)
    eps: float  # of the norm (the layer's two norms)
    attention: AttentionShape | None = None

    @property
    def name(self) -> str:
        sizes = "" if self.form == "ffn" else self.attention.name.removeprefix("sharkport_decode_attention")
        sizes += f"_i{self.inner}" if self.inner else ""
        return (f"sharkport_{self.form}_block_{self.kind.lower()}_m{self.rows}_e{self.width}"
                f"_n{_float_bits(self.eps):08x}{sizes}_wg{workgroups()}")

    @property
    def c_name(self) -> str:
        return f"sharkport_{self.form}_block_{self.kind.lower()}{self.attention.c_suffix if self.attention else ''}"

    @property
    def phases(self) -> int:
        """The dispatch's phases (matvec.c's ATTENTION_PHASES, FFN_PHASES): its counters' size."""
        return {"attention": 3, "ffn": 2, "layer": 5}[self.form]

    @property
    def operands(self) -> list[str]:
        """The op's tensor operands in order (planes as <matrix>_<plane>)."""
        def planes(matrix):
            return [f"{matrix}_{p}" for p in PLANES[self.kind]]
        ffn = [*planes("gate"), *planes("up"), *planes("down")]
        if self.form == "ffn":
            return ["x", "g", *ffn]
        attention = ["x", "g", *planes("q"), *planes("k"), *planes("v"), "cache", "pages", "starts", "lens", "layer",
                     "cos", "sin", *planes("o")]
        return attention + (["g2", *ffn] if self.form == "layer" else [])

    @property
    def tied(self) -> list[str]:
        """Operands the dispatch updates in place, in the order of their results."""
        return [] if self.form == "ffn" else ["cache"]

    @property
    def widths(self) -> tuple[int, ...]:
        """The dispatch's result, per row of h: the output, then the intermediates (FFN: silu(g) *
        u; attention: q, k, v, then the attention's output; layer: the attention block's output,
        the attention's intermediates, the FFN's)."""
        if self.form == "ffn":
            return self.width, self.inner
        a = self.attention
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        if self.form == "layer":
            return self.width, self.width, q, kv, kv, q, self.inner
        return self.width, q, kv, kv, q

    def constants(self) -> list[tuple[str, str]]:
        """The C function's constant arguments after its memrefs (and the attention's page
        columns), as (MLIR value, type)."""
        def index(v):
            return str(v), "index"
        # outputs a chunk of a product takes, the norm's eps, the workgroups
        last = [index(BLOCK_CHUNK_ROWS), (f"0x{_float_bits(self.eps):08X}", "f32"), index(workgroups())]
        if self.form == "ffn":
            return [index(self.rows), index(self.width), index(self.inner), *last]
        return [index(self.rows), index(self.width),
                *_constants(self.attention, "H", "Hkv", "D", "L", "stride", "R", "interleaved", "hpw", "scale"),
                *([index(self.inner)] if self.form == "layer" else []), *last]


def _block_module(shape: BlockShape, arg_types: list[tuple[int, str]], sizes: list[int | None]) -> str:
    """MLIR module text of util.func `shape.name` over the op's tensors (`arg_types`: rank and
    element type; `sizes`: each one's element count where static, else None), dispatching the C
    function over workgroups() workgroups. Its results are a new flat float32 tensor (the block's
    output, then its intermediates) and the tied operands (the cache), updated in place. The
    dispatch's phase counters (kernels.block_counters(shape.phases) int32) are a global of the module's own,
    zero at first, which the dispatch updates in place and leaves zeroed (matvec.c's `leave`): no
    fill before each call. The C function takes each operand's memref, the counters' and the
    result's, then the attention's page columns, the shape's constants and the workgroup id; the
    dynamic element counts and the page columns are the dispatch's only operands besides the
    tensors (operands of rank 3 at most: the planes)."""
    name, n = shape.name, len(arg_types)
    names = shape.operands
    types = [_tensor_type(r, e) for r, e in arg_types]
    elements = [e for _, e in arg_types] + ["i32", "f32"]  # the counters, the result
    memrefs = ", ".join(_memref(e) for e in elements)
    total = shape.rows * sum(shape.widths)
    counters = f"tensor<{block_counters(shape.phases)}xi32>"
    dynamic = [i for i, s in enumerate(sizes) if s is None]
    paged = shape.form != "ffn"
    entry_args = [f"%n{i}: index" for i in dynamic] + (["%blocks: index"] if paged else [])
    static = [(i, s) for i, s in enumerate(sizes) if s is not None] + [(n, block_counters(shape.phases)), (n + 1, total)]
    size_ops = "\n".join(f"        %n{i} = arith.constant {s} : index" for i, s in static)
    subspans = "\n".join(f"        %s{i} = stream.binding.subspan %b{i}[%c0] : !stream.binding -> {_memref(e)}{{%n{i}}}"
                         for i, e in enumerate(elements))
    constants = shape.constants()
    constant_ops = "\n".join(f"        %k{i} = arith.constant {value} : {t}" for i, (value, t) in enumerate(constants))
    call_types = ", ".join([memrefs] + (["index"] if paged else []) + [t for _, t in constants] + ["index"])
    call_args = ", ".join([f"%s{i}" for i in range(len(elements))] + (["%blocks"] if paged else [])
                          + [f"%k{i}" for i in range(len(constants))] + ["%wg"])
    dims = [[f"%a{i}d{j}" for j in range(rank)] for i, (rank, _) in enumerate(arg_types)]
    dim_ops = "\n".join(f"    {d} = tensor.dim %a{i}, %c{j} : {types[i]}" for i, ds in enumerate(dims)
                        for j, d in enumerate(ds))
    count_ops = []  # %n<i>: the element count of dynamic operand i
    for i in dynamic:
        count_ops.append(f"    %n{i}_0 = arith.addi {dims[i][0]}, %c0 : index")
        count_ops += [f"    %n{i}_{j} = arith.muli %n{i}_{j - 1}, {d} : index" for j, d in enumerate(dims[i][1:], 1)]
        count_ops.append(f"    %n{i} = arith.addi %n{i}_{len(dims[i]) - 1}, %c0 : index")
    operands = ", ".join([f"{types[i]}{{{', '.join(ds)}}}" for i, ds in enumerate(dims)] + [counters])
    # A tied result's first dim is computed anew (its elements over its other dims), not taken
    # from the operand: see _paged_module (the cache would be copied in and out of every call).
    tied = [names.index(t) for t in shape.tied]
    tied_ops, tied_results = [], []
    for i in tied:
        rest = dims[i][1:]
        tied_ops.append(f"    %t{i}_rest_0 = arith.addi %c1, %c0 : index")
        tied_ops += [f"    %t{i}_rest_{j} = arith.muli %t{i}_rest_{j - 1}, {d} : index" for j, d in enumerate(rest, 1)]
        tied_ops.append(f"    %t{i}_rows = arith.divui %n{i}, %t{i}_rest_{len(rest)} : index")
        tied_results.append(f"%a{i}{{{', '.join([f'%t{i}_rows'] + rest)}}}")
    result_types = ", ".join(["tensor<?xf32>"] + [types[i] for i in tied])
    results = ", ".join(["tensor<?xf32>{%total}"] + tied_results + ["%counters"])
    extra = [f"%n{i}" for i in dynamic] + ([dims[names.index("pages")][1]] if paged else [])
    returned = ", ".join(f"%y#{i}" for i in range(1 + len(tied)))
    return f"""
module {{
  util.global private mutable @{name}_counters = dense<0> : {counters}
  stream.executable private @{name}_executable attributes {{{_objects()}}} {{
    stream.executable.export public @{name}_entry workgroups(%w: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %w, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @{shape.c_name}({call_types}) attributes {{hal.import.static}}
      func.func @{name}_entry({", ".join([f"%b{i}: !stream.binding" for i in range(len(elements))] + entry_args)}) {{
        %c0 = arith.constant 0 : index
        %wg = hal.interface.workgroup.id[0] : index
{size_ops}
{subspans}
{constant_ops}
        func.call @{shape.c_name}({call_args}) : ({call_types}) -> ()
        return
      }}
    }}
  }}
  util.func private @{name}({", ".join(f"%a{i}: {t}" for i, t in enumerate(types))}) -> ({result_types}) {{
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %c2 = arith.constant 2 : index
{dim_ops}
{chr(10).join(count_ops)}
{chr(10).join(tied_ops)}
    %total = arith.constant {total} : index
    %wgs = arith.constant {workgroups()} : index
    %counters = util.global.load @{name}_counters : {counters}
    %y:{2 + len(tied)} = flow.dispatch @{name}_executable::@{name}_entry[%wgs]({", ".join([f"%a{i}" for i in range(n)] + ["%counters"] + extra)}) : ({operands}{", index" * len(extra)}) -> ({results})
    util.global.store %y#{1 + len(tied)}, @{name}_counters : {counters}
    util.return {returned} : {result_types}
  }}
}}"""


def _block_eager(shape: BlockShape, *args) -> torch.Tensor:
    """The block in torch, as the kernels it fuses compute it: the products as _eager, the
    attention as _attention_eager (which writes the cache in place). Its result is the block's
    output, then its intermediates, flattened."""
    x, g, *rest = args
    per = len(PLANES[shape.kind])
    if shape.form == "ffn":
        return _ffn_eager(shape, x, g, *rest)
    qkv_planes, (cache, pages, starts, lens, layer, cos, sin), o = rest[:3 * per], rest[3 * per:3 * per + 7], \
        rest[3 * per + 7:4 * per + 7]
    qkv = _eager(shape.kind, FORMS["qkv_norm"], x, g, *qkv_planes, shape.eps).flatten()
    M, a = shape.rows, shape.attention
    nq, nkv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    q, k, v = (part.view(M, -1) for part in qkv.split([M * nq, M * nkv, M * nkv]))
    att = _attention_eager(shape.attention, q, k, v, cache, pages, starts, lens, layer, cos, sin)
    y = _eager(shape.kind, FORMS["matvec_add"], att, *o, x)
    if shape.form == "layer":
        ffn = _ffn_eager(shape, y, *rest[4 * per + 7:])
        return torch.cat([ffn[:y.numel()], y.flatten(), qkv, att.flatten(), ffn[y.numel():]])
    return torch.cat([y.flatten(), qkv, att.flatten()])


def _ffn_eager(shape: BlockShape, x, g, *planes) -> torch.Tensor:
    """The FFN block in torch: its output, then silu(gate) * up, flattened."""
    per = len(PLANES[shape.kind])
    act = _eager(shape.kind, FORMS["swiglu_norm"], x, g, *planes[:2 * per], shape.eps)
    y = _eager(shape.kind, FORMS["matvec_add"], act, *planes[2 * per:3 * per], x)
    return torch.cat([y.flatten(), act.flatten()])


@functools.cache
def block_op(shape: BlockShape):
    """The turbine op for a block of `shape`: op(*operands as BlockShape.operands) -> the flat
    result (BlockShape.widths per row of h), updating the cache (attention) and the counters (which
    it takes zeroed) in place."""
    operands = shape.operands
    args = ", ".join(f"Tensor{'(a!)' if n in shape.tied else ''} {n}" for n in operands)

    class Op(CustomOp):
        signature = f"{shape.name}({args}) -> (Tensor)"

        def select(self, ksel: KernelSelection):
            for i, n in enumerate(operands):
                ksel.arg_tensor(i, inplace_tied=n in shape.tied)
            ksel.return_new_tensor([shape.rows * sum(shape.widths)], torch.float32)

        def eager_execute(self, *args):
            return _block_eager(shape, *args)

        def generate(self, ksel: KernelSelection, kb: KernelBuilder):
            from iree.turbine.support.ir_imports import RankedTensorType

            types = [RankedTensorType(value.type) for value in kb.arg_bindings if value is not None]
            arg_types = [(t.rank, str(t.element_type)) for t in types]
            sizes = [_static_elements(ksel.arg_descs[i].t) for i in range(len(operands))]
            call_mlir_function(kb, shape.name, lambda: _block_module(shape, arg_types, sizes))

    Op.__name__ = shape.name
    return CustomOp.register(library=_LIBRARY)(Op)


def _static_elements(t: torch.Tensor) -> int | None:
    """t's element count where its shape is static, else None."""
    if not all(isinstance(d, int) for d in t.shape):
        return None
    return int(torch.Size(t.shape).numel())
