"""The MLIR text of the kernels' custom dispatches (kernels.ops calls these under tracing).

Every kernel's module has one shape, SKELETON: a `stream.executable` whose entry function takes
the op's buffers as flat memrefs and calls one of matvec.c's C functions once per workgroup, and
a util.func that dispatches it over the op's tensors. A Dispatch holds what a kernel fills in:
its buffers and their element counts, the C function's other arguments, its workload and the
dispatch's results. One function per kind builds it: product_module (FORMS over each kernel
type), attention_module (decode), prefill_module and block_module. All dims are dynamic; a
kernel's sizes and constants are values in its text, named in its symbols (kernels.shapes)."""

from __future__ import annotations

import string
from dataclasses import dataclass, field

from .build import object_path
from .layout import (MAX_K, MAX_ROWS, MAX_ROWS_PER_WORKGROUP, PASS_BYTES, PLANES, ROW_QUANTUM, SIZES,
                     block_counters, workgroups)
from .shapes import (FORMS, PREFILL_ROWS, AttentionShape, BlockShape, PrefillShape, float_bits, product_c_name,
                     product_stem)

# ${...} are Dispatch's pieces; the bodies are lines indented to their place.
SKELETON = string.Template("""
module {
${globals}  stream.executable private @${executable} attributes {${objects}} {
    stream.executable.export public @${entry} workgroups(${workgroup_args}) -> (index, index, index) {
${workgroup_body}
      stream.return ${workgroups}, %c1, %c1 : index, index, index
    }
    builtin.module {
      func.func private @${c_name}(${c_types}) attributes {hal.import.static}
      func.func @${entry}(${entry_args}) {
${entry_body}
        func.call @${c_name}(${c_args}) : (${c_types}) -> ()
        return
      }
    }
  }
  util.func private @${func}(${func_args}) -> ${func_results} {
${func_body}
  }
}""")


@dataclass
class Dispatch:
    """What one kernel's module fills into SKELETON (lines unindented)."""
    executable: str  # symbols: the stream.executable's, its export's and entry function's, the util.func's
    entry: str
    func: str
    c_name: str  # matvec.c's function
    workgroup_args: list[str]  # the export's index operands (the dispatch's workload)
    workgroup_body: list[str]  # lines computing the workgroup count from them, and %c1
    workgroups: str  # that count
    # the entry's buffers: (memref value, binding, element type, element count); the C function
    # takes the memrefs first, in this order, then `call`
    subspans: list[tuple[str, str, str, str]]
    entry_sizes: list[str]  # the entry's index operands after its bindings
    call: list[tuple[str, str]]  # (value, type)
    func_args: list[tuple[str, str]]  # the util.func's tensors: (value, type)
    func_body: list[str]  # lines from the tensors' dims up to the dispatch
    workload: list[str]
    operands: list[tuple[str, str]]  # the dispatch's: (value, type with its dynamic dims)
    results: list[str]  # the dispatch's result types, with their dims
    returned: list[str]  # the util.func's result types: those of the dispatch's first results
    entry_setup: list[str] = field(default_factory=list)  # lines before the subspans
    entry_constants: list[str] = field(default_factory=list)  # lines after them
    entry_indices: int = 1  # the index constants %c0, %c1, .. the entry's lines use
    func_indices: int = 3  # and the util.func's
    globals: list[str] = field(default_factory=list)
    epilogue: list[str] = field(default_factory=list)  # lines between the dispatch and the util.return

    def text(self) -> str:
        call = [(value, memref(element)) for value, _, element, _ in self.subspans] + self.call
        subspans = [f"{value} = stream.binding.subspan {binding}[%c0] : !stream.binding -> {memref(element)}{{{n}}}"
                    for value, binding, element, n in self.subspans]
        # every C function takes its workgroup's id
        entry = [*_index_constants(self.entry_indices), "%wg = hal.interface.workgroup.id[0] : index",
                 *self.entry_setup, *subspans, *self.entry_constants]
        # several results: `%y:N`, read as %y#i, their types in parentheses
        many = len(self.results) > 1
        results, returned = ", ".join(self.results), ", ".join(self.returned)
        dispatch = (f"%y{f':{len(self.results)}' if many else ''} = flow.dispatch @{self.executable}::@{self.entry}"
                    f"[{', '.join(self.workload)}]({_values(self.operands)}) : ({_types(self.operands)}) -> "
                    f"{f'({results})' if many else results}")
        values = [f"%y#{i}" for i in range(len(self.returned))] if many else ["%y"]
        func = [*_index_constants(self.func_indices), *self.func_body, dispatch, *self.epilogue,
                f"util.return {', '.join(values)} : {returned}"]
        return SKELETON.substitute(
            globals="".join(f"  {line}\n" for line in self.globals), objects=objects(),
            executable=self.executable, entry=self.entry, func=self.func, c_name=self.c_name,
            workgroup_args=", ".join(f"{a}: index" for a in self.workgroup_args),
            workgroup_body=_indent(6, self.workgroup_body), workgroups=self.workgroups,
            c_types=_types(call), c_args=_values(call),
            entry_args=", ".join([f"{binding}: !stream.binding" for _, binding, _, _ in self.subspans]
                                 + [f"{n}: index" for n in self.entry_sizes]),
            entry_body=_indent(8, entry), func_args=", ".join(f"{v}: {t}" for v, t in self.func_args),
            func_results=f"({returned})" if many else returned, func_body=_indent(4, func))


def _indent(spaces: int, lines: list[str]) -> str:
    """The lines as one text at their place's indent (an empty line stays empty)."""
    return "\n".join(" " * spaces + line if line else line for line in lines)


def _values(pairs) -> str:
    return ", ".join(v for v, _ in pairs)


def _types(pairs) -> str:
    return ", ".join(t for _, t in pairs)


def _index_constants(count: int) -> list[str]:
    return [constant(f"%c{i}", i, "index") for i in range(count)]


def constant(name: str, value, type_: str) -> str:
    return f"{name} = arith.constant {value} : {type_}"


def tensor_type(rank: int, element: str) -> str:
    return f"tensor<{'?x' * rank}{element}>"


def shaped(type_: str, dims: list[str]) -> str:
    """A tensor type with its dynamic dims, as a dispatch's operands and results name them."""
    return f"{type_}{{{', '.join(dims)}}}"


def memref(element: str) -> str:
    """The flat buffer the C function receives. Its offset is part of the type: IREE 3.9 drops a
    binding's offset (the planes of one weight share a buffer) from identity-layout memrefs."""
    return f"memref<?x{'i8' if element == 'ui8' else element}, strided<[1], offset: ?>>"


def objects() -> str:
    """The executable attribute naming matvec.c's object, found through compile_mlir's search path
    (IREE 3.9 links object bytes embedded in the MLIR as undefined symbols)."""
    return ('hal.executable.objects = #hal.executable.objects<{#hal.executable.target<"llvm-cpu", '
            f'"embedded-elf-x86_64"> = [#hal.executable.object<{{path = "{object_path().name}"}}>]}}>')


def _tensor_dims(types: list[str], ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    """Each tensor argument %a<i>'s dims %a<i>d<j>, and the lines reading them."""
    dims = [[f"%a{i}d{j}" for j in range(rank)] for i, rank in enumerate(ranks)]
    return dims, [f"{d} = tensor.dim %a{i}, %c{j} : {types[i]}" for i, ds in enumerate(dims) for j, d in enumerate(ds)]


def _tensors(types: list[str], dims: list[list[str]]) -> list[tuple[str, str]]:
    """The tensor arguments %a<i> as a dispatch's operands: (value, type with its dims)."""
    return [(f"%a{i}", shaped(t, ds)) for i, (t, ds) in enumerate(zip(types, dims))]


# ---- products: one dispatch of a Form's products over ceil(N / rows) workgroups ----

def product_module(kind: str, form_name: str, arg_types: list[tuple[int, str]], eps: float | None,
                   scratch: bool = False) -> str:
    """The module of util.func <product_stem>_dispatch taking the op's tensors (x, the norm's
    weight, the matrices' planes, the residual; `arg_types` their rank and element type), which
    dispatches the C function over ceil(N / rows) workgroups of `rows` outputs each (see
    kernels.ROW_QUANTUM). With `scratch`, the C function's _scratch twin, and the dispatch has a
    second result it does not return: the workgroups' scratch for x's quantized rows (_scratch)."""
    form = FORMS[form_name]
    c_name, stem = product_c_name(kind, form_name, scratch), product_stem(kind, form_name, eps, scratch)
    per, first_plane = len(PLANES[kind]), 2 if form.norm else 1
    types = [tensor_type(r, e) for r, e in arg_types]
    elements = [e for _, e in arg_types] + ["f32"]  # and the result's
    # the C function's sizes: M, each matrix's rows (swiglu: one N, the gate's), K
    ns = [f"%n{i}" for i in range(1 if form.swiglu else form.matrices)]
    x_spec, *plane_specs, y_spec = SIZES[kind]
    specs = ([(x_spec, None)] + ([("k1", None)] if form.norm else [])
             + [(spec, f"%n{0 if form.swiglu else i}") for i in range(form.matrices) for spec in plane_specs]
             + ([(y_spec, "%ntotal")] if form.residual else []) + [(y_spec, "%ntotal")])
    dims, dim_ops = _tensor_dims(types, [r for r, _ in arg_types])
    eps_op = [constant("%eps", f"0x{float_bits(eps):08X}", "f32")] if form.norm else []
    passes = ["%passrows", "%tsize"] if scratch else []
    return Dispatch(
        executable=f"{stem}_executable", entry=f"{c_name}_entry", func=f"{stem}_dispatch", c_name=c_name,
        workgroup_args=["%n", "%rows"], workgroups="%x",
        workgroup_body=["%x = arith.ceildivui %n, %rows : index", constant("%c1", 1, "index")],
        subspans=([(f"%s{i}", f"%b{i}", e, f"%size{i}") for i, e in enumerate(elements)]
                  + ([("%st", "%bt", "i8", "%tsize")] if scratch else [])),
        entry_sizes=["%m", *ns, "%k", "%rows", *passes], entry_indices=2,
        entry_setup=[*eps_op, *_total_rows(len(ns), "%ntotal"),
                     *(line for i, (spec, n) in enumerate(specs) for line in _size(i, spec, n))],
        call=([(v, "index") for v in ["%m", *ns, "%k", "%rows", "%wg", *passes[:1]]]
              + ([("%eps", "f32")] if form.norm else [])),
        func_args=[(f"%a{i}", t) for i, t in enumerate(types)],
        func_body=[*dim_ops,
                   *(f"%n{i} = tensor.dim %a{first_plane + i * per}, %c0 : {types[first_plane + i * per]}"
                     for i in range(len(ns))),
                   *_total_rows(len(ns), "%total"),
                   # outputs a workgroup: whole quanta aiming at workgroups() workgroups, at most the maximum
                   f"%rows = affine.min affine_map<()[s0] -> ((s0 ceildiv {ROW_QUANTUM * workgroups()}) * "
                   f"{ROW_QUANTUM}, {MAX_ROWS_PER_WORKGROUP})>()[%total]",
                   *(_scratch_size("%a0d0", "%a0d1") if scratch else [])],
        workload=["%total", "%rows"],
        operands=_tensors(types, dims) + [(v, "index") for v in ["%a0d0", *ns, "%a0d1", "%rows", *passes]],
        results=["tensor<?x?xf32>{%a0d0, %total}", *(["tensor<?xi8>{%tsize}"] if scratch else [])],
        returned=["tensor<?x?xf32>"]).text()


def _scratch_size(m: str, k: str) -> list[str]:
    """Lines computing %passrows, the rows of x [m, k] a pass over the weights takes (0 where
    x_on_stack: the workgroups keep x on their stacks; else PASS_BYTES / k rounded down to a
    multiple of 8, at least 8, at most m), and %tsize, the scratch's bytes: matvec.c's
    scratch_bytes(k, %passrows) for each of ceil(%total / %rows) workgroups."""
    return [*(constant(f"%t_{v}", v, "index") for v in (8, 11, 64)), constant("%t_xq", MAX_K, "index"),
            constant("%t_most", MAX_ROWS, "index"), constant("%t_pass", PASS_BYTES, "index"),
            f"%t_mk = arith.muli {m}, {k} : index", f"%t_few = arith.cmpi ule, {m}, %t_most : index",
            "%t_small = arith.cmpi ule, %t_mk, %t_xq : index", "%t_stack = arith.andi %t_few, %t_small : i1",
            f"%t_fit = arith.divui %t_pass, {k} : index", "%t_fit8 = arith.divui %t_fit, %t_8 : index",
            "%t_whole = arith.muli %t_fit8, %t_8 : index", "%t_least = arith.maxui %t_whole, %t_8 : index",
            f"%t_r = arith.minui %t_least, {m} : index", "%passrows = arith.select %t_stack, %c0, %t_r : index",
            "%t_r11 = arith.muli %passrows, %t_11 : index", "%t_r11p8 = arith.addi %t_r11, %t_8 : index",
            f"%t_k11 = arith.muli %t_r11p8, {k} : index", "%t_bytes = arith.divui %t_k11, %t_8 : index",
            "%t_lines = arith.ceildivui %t_bytes, %t_64 : index", "%t_own = arith.muli %t_lines, %t_64 : index",
            "%t_per = arith.select %t_stack, %c0, %t_own : index", "%t_wgs = arith.ceildivui %total, %rows : index",
            "%tsize = arith.muli %t_wgs, %t_per : index"]


def _total_rows(count: int, result: str) -> list[str]:
    """Lines computing `result`, the outputs of a product whose matrices have %n0.. rows: %n0, or
    for q, k, v their sum."""
    if count == 1:
        return [f"{result} = arith.addi %n0, %c0 : index"]
    return [f"{result}_01 = arith.addi %n0, %n1 : index", f"{result} = arith.addi {result}_01, %n2 : index"]


def _size(i: int, spec, n: str | None) -> list[str]:
    """Lines computing binding i's element count %size{i} from %m, the row count `n` and %k (see
    SIZES: "mk" is M*K, ("nk", 2) N*K/2, ("nk", 64, 3) N*K*3/64, "mn" M*N; "k1" is K)."""
    (a, b), divisor, *factor = (spec, 1) if isinstance(spec, str) else spec
    value = {"m": "%m", "k": "%k", "n": n, "1": "%c1"}
    product = [f"%p{i} = arith.muli {value[a]}, {value[b]} : index"]
    if factor:
        product = [f"%q{i} = arith.muli {value[a]}, {value[b]} : index", constant(f"%f{i}", factor[0], "index"),
                   f"%p{i} = arith.muli %q{i}, %f{i} : index"]
    return [constant(f"%d{i}", divisor, "index"), *product, f"%size{i} = arith.divui %p{i}, %d{i} : index"]


# ---- decode attention: B * (kv heads / kv heads a workgroup) workgroups ----

def attention_module(shape: AttentionShape) -> str:
    """The module of util.func `shape.name` over AttentionShape.operands. The C function takes
    each operand's memref and the output's, then the pages' columns (blocks), the shape's
    constants and the workgroup id. Its results are the output [B, H*D] (q's shape) and the cache
    updated in place."""
    name, args = shape.name, shape.operands
    n, names = len(args), [a for a, _, _ in args]
    types = [tensor_type(rank, e) for _, e, rank in args]
    elements = [e for _, e, _ in args] + ["f32"]  # and the output's
    constants = [(f"%k{i}", value, t) for i, (value, t) in enumerate(shape.constants())]
    dims, dim_ops = _tensor_dims(types, [rank for _, _, rank in args])
    pages, cache = names.index("pages"), names.index("cache")
    # The updated cache's rows are computed anew (elements / columns) rather than being the
    # operand's dim: with the same SSA dims, IREE 3.9 merges the import of the cache argument with
    # the one the exported function's final in-place write-back makes, and then copies the whole
    # cache in and out of every call (copy-on-write of a value used twice).
    return Dispatch(
        executable=f"{name}_executable", entry=f"{name}_entry", func=name,
        c_name=f"sharkport_decode_attention{shape.c_suffix}",
        workgroup_args=["%w"], workgroup_body=[constant("%c1", 1, "index")], workgroups="%w",
        # each operand's element count %n<i>; the output's is q's
        subspans=[(f"%s{i}", f"%b{i}", e, f"%n{i if i < n else 0}") for i, e in enumerate(elements)],
        entry_sizes=[f"%n{i}" for i in range(n)] + ["%blocks"],
        entry_constants=[constant(*c) for c in constants],
        call=[("%blocks", "index"), *((v, t) for v, _, t in constants), ("%wg", "index")],
        func_args=[(f"%a{i}", t) for i, t in enumerate(types)], func_indices=2,
        func_body=[*dim_ops,
                   *(f"%n{i} = arith.muli {ds[0]}, {ds[1]} : index" if len(ds) == 2 else
                     f"%n{i} = arith.addi {ds[0]}, %c0 : index" for i, ds in enumerate(dims)),
                   constant("%per_sequence", shape.kv_heads // shape.kv_heads_per_workgroup, "index"),
                   "%wgs = arith.muli %a0d0, %per_sequence : index",
                   f"%rows = arith.divui %n{cache}, {dims[cache][1]} : index"],
        workload=["%wgs"],
        operands=_tensors(types, dims) + [(f"%n{i}", "index") for i in range(n)] + [(f"%a{pages}d1", "index")],
        results=[shaped(types[0], dims[0]), shaped(f"%a{cache}", ["%rows", dims[cache][1]])],
        returned=[types[0], types[cache]]).text()


# ---- prefill attention: B * Hkv * ceil(S / PREFILL_ROWS) workgroups ----

def prefill_module(shape: PrefillShape) -> str:
    """The module of util.func `shape.name`: q [B, S, H*D], k and v [B, S, Hkv*D] -> out
    [B, S, H*D]."""
    name, t = shape.name, "tensor<?x?x?xf32>"
    q_dims, kv_dims = ["%b", "%s", "%hd"], ["%b", "%s", "%kvd"]
    constants = [("%h", shape.heads, "index"), ("%hkv", shape.kv_heads, "index"), ("%d", shape.head_dim, "index"),
                 ("%scale", f"0x{shape.scale_bits:08X}", "f32"), ("%window", shape.window, "index")]
    return Dispatch(
        executable=f"{name}_executable", entry=f"{name}_entry", func=name, c_name="sharkport_prefill_attention",
        workgroup_args=["%b", "%s"], workgroups="%x",
        workgroup_body=[constant("%c1", 1, "index"), constant("%rows", PREFILL_ROWS, "index"),
                        constant("%hkv", shape.kv_heads, "index"), "%blocks = arith.ceildivui %s, %rows : index",
                        "%per_row = arith.muli %blocks, %hkv : index", "%x = arith.muli %b, %per_row : index"],
        subspans=[("%q", "%bq", "f32", "%nq"), ("%k", "%bk", "f32", "%nkv"), ("%v", "%bv", "f32", "%nkv"),
                  ("%o", "%bo", "f32", "%nq")],
        entry_sizes=["%nq", "%nkv", "%s"], entry_constants=[constant(*c) for c in constants],
        call=[("%s", "index"), *((v, t) for v, _, t in constants), ("%wg", "index")],
        func_args=[("%q", t), ("%k", t), ("%v", t)],
        func_body=[f"%b = tensor.dim %q, %c0 : {t}", f"%s = tensor.dim %q, %c1 : {t}",
                   f"%hd = tensor.dim %q, %c2 : {t}", f"%kvd = tensor.dim %k, %c2 : {t}",
                   "%bs = arith.muli %b, %s : index", "%nq = arith.muli %bs, %hd : index",
                   "%nkv = arith.muli %bs, %kvd : index"],
        workload=["%b", "%s"],
        operands=[("%q", shaped(t, q_dims)), ("%k", shaped(t, kv_dims)), ("%v", shaped(t, kv_dims)),
                  ("%nq", "index"), ("%nkv", "index"), ("%s", "index")],
        results=[shaped(t, q_dims)], returned=[t]).text()


# ---- blocks: workgroups() workgroups sharing out each phase ----

def block_module(shape: BlockShape, arg_types: list[tuple[int, str]], sizes: list[int | None]) -> str:
    """The module of util.func `shape.name` over the op's tensors (`arg_types`: rank and element
    type; `sizes`: each one's element count where static, else None). Its results are a new flat
    float32 tensor (the block's output, then its intermediates) and the tied operands (the cache),
    updated in place. The phase counters (block_counters(shape.phases) int32) are a global of the
    module's own, zero at first, which the dispatch updates in place and leaves zeroed (matvec.c's
    `leave`): no fill before each call. The C function takes each operand's memref, the counters'
    and the result's, then the attention's page columns, the shape's constants and the workgroup
    id. The dynamic element counts and the page columns are the dispatch's only operands besides
    the tensors."""
    name, n, names = shape.name, len(arg_types), shape.operands
    types = [tensor_type(r, e) for r, e in arg_types]
    elements = [e for _, e in arg_types] + ["i32", "f32"]  # the counters, the result
    total = shape.rows * sum(shape.widths)
    counters = f"tensor<{block_counters(shape.phases)}xi32>"
    dynamic = [i for i, s in enumerate(sizes) if s is None]
    paged = shape.form != "ffn"
    static = [(i, s) for i, s in enumerate(sizes) if s is not None]
    static += [(n, block_counters(shape.phases)), (n + 1, total)]
    constants = [(f"%k{i}", value, t) for i, (value, t) in enumerate(shape.constants())]
    dims, dim_ops = _tensor_dims(types, [r for r, _ in arg_types])
    count_ops = []  # %n<i>: the element count of dynamic operand i
    for i in dynamic:
        count_ops.append(f"%n{i}_0 = arith.addi {dims[i][0]}, %c0 : index")
        count_ops += [f"%n{i}_{j} = arith.muli %n{i}_{j - 1}, {d} : index" for j, d in enumerate(dims[i][1:], 1)]
        count_ops.append(f"%n{i} = arith.addi %n{i}_{len(dims[i]) - 1}, %c0 : index")
    # A tied result's first dim is computed anew (its elements over its other dims), not taken
    # from the operand: see attention_module (the cache would be copied in and out of every call).
    tied = [names.index(t) for t in shape.tied]
    tied_ops, tied_results = [], []
    for i in tied:
        rest = dims[i][1:]
        tied_ops.append(f"%t{i}_rest_0 = arith.addi %c1, %c0 : index")
        tied_ops += [f"%t{i}_rest_{j} = arith.muli %t{i}_rest_{j - 1}, {d} : index" for j, d in enumerate(rest, 1)]
        tied_ops.append(f"%t{i}_rows = arith.divui %n{i}, %t{i}_rest_{len(rest)} : index")
        tied_results.append(shaped(f"%a{i}", [f"%t{i}_rows", *rest]))
    extra = [f"%n{i}" for i in dynamic] + ([dims[names.index("pages")][1]] if paged else [])
    return Dispatch(
        executable=f"{name}_executable", entry=f"{name}_entry", func=name, c_name=shape.c_name,
        globals=[f"util.global private mutable @{name}_counters = dense<0> : {counters}"],
        workgroup_args=["%w"], workgroup_body=[constant("%c1", 1, "index")], workgroups="%w",
        subspans=[(f"%s{i}", f"%b{i}", e, f"%n{i}") for i, e in enumerate(elements)],
        entry_sizes=[f"%n{i}" for i in dynamic] + (["%blocks"] if paged else []),
        entry_setup=[constant(f"%n{i}", s, "index") for i, s in static],
        entry_constants=[constant(*c) for c in constants],
        call=[*([("%blocks", "index")] if paged else []), *((v, t) for v, _, t in constants), ("%wg", "index")],
        func_args=[(f"%a{i}", t) for i, t in enumerate(types)],
        # (an empty line where there are no counts, and where no tied results)
        func_body=[*dim_ops, *(count_ops or [""]), *(tied_ops or [""]), constant("%total", total, "index"),
                   constant("%wgs", workgroups(), "index"),
                   f"%counters = util.global.load @{name}_counters : {counters}"],
        workload=["%wgs"],
        operands=_tensors(types, dims) + [("%counters", counters)] + [(e, "index") for e in extra],
        results=["tensor<?xf32>{%total}", *tied_results, "%counters"],
        returned=["tensor<?xf32>", *(types[i] for i in tied)],
        epilogue=[f"util.global.store %y#{1 + len(tied)}, @{name}_counters : {counters}"]).text()
