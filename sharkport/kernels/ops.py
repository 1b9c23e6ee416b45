"""The kernels as turbine custom ops: under tracing, a `flow.dispatch` of a `stream.executable`
linking matvec.c's object (its MLIR text: kernels.mlir); eagerly, the same computation in torch,
as the reference the kernels are tested against."""

from __future__ import annotations

import functools
import weakref

import torch
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection, def_library

from ..archive.tensors import QuantizedTensor
from ..mlir_ops import call_mlir_function
from . import mlir
from .layout import FLOAT_KINDS, MIXED_SLOTS, PLANES, STORED, quantized_x, x_on_stack
from .shapes import (FORMS, PREFILL_ROWS, AttentionShape, BlockShape, Form, PrefillShape, product_c_name,
                     product_stem)

__all__ = ["FORMS", "OPS", "PREFILL_ROWS", "AttentionShape", "BlockShape", "Form", "PrefillShape", "attention_op",
           "block_op", "prefill_attention_op"]

_LIBRARY = def_library("sharkport_kernels")


# ---- products: one op per (kernel type, form) ----

# The eager ops dequantize each matrix at every call, once a decode step: the matrices dequantized
# first, up to this many bytes, are kept for as long as their planes live unchanged (a session's
# weights: all of a small model's, the first layers of a larger one, as a step walks the layers in
# order).
EAGER_CACHE_BYTES = 1 << 30
_eager_cache: dict[tuple, tuple[tuple[tuple[weakref.ref, int], ...], torch.Tensor]] = {}
_eager_cached_bytes = 0


def _forget(key: tuple) -> None:
    global _eager_cached_bytes
    entry = _eager_cache.pop(key, None)
    if entry is not None:
        _eager_cached_bytes -= entry[1].nbytes


def _dequantize(kind: str, planes, k: int) -> torch.Tensor:
    """The matrix of `planes` (PLANES[kind] order; interleaved rows put back) as float32 [N, k]."""
    if kind in FLOAT_KINDS:
        return planes[0].to(torch.float32)
    w = QuantizedTensor(STORED.get(kind, kind), (planes[0].shape[0], k), dict(zip(PLANES[kind], planes)),
                        interleaved=kind in STORED)
    return w.dequant().to(torch.float32)


def _dequantized(kind: str, planes, k: int) -> torch.Tensor:
    """_dequantize's matrix, kept while it fits EAGER_CACHE_BYTES and its planes are unchanged."""
    global _eager_cached_bytes
    key = (kind, k, *(id(p) for p in planes))
    entry = _eager_cache.get(key)
    if entry is not None:
        if all(ref() is p and version == p._version for (ref, version), p in zip(entry[0], planes)):
            return entry[1]
        _forget(key)  # a plane written in place since
    w = _dequantize(kind, planes, k)
    # a float32 plane is its own matrix: nothing to keep
    if w.data_ptr() != planes[0].data_ptr() and _eager_cached_bytes + w.nbytes <= EAGER_CACHE_BYTES:
        _eager_cache[key] = tuple((weakref.ref(p), p._version) for p in planes), w
        _eager_cached_bytes += w.nbytes
        for p in planes:  # a plane's id may be another tensor's once it is gone
            weakref.finalize(p, _forget, key)
    return w


def _eager(kind: str, form: Form, x: torch.Tensor, *args) -> torch.Tensor:
    """The kernel's result in torch: x (normalized as ops.rms_norm, then quantized as the kernel
    quantizes it for quantized weights: quantized_x) times each matrix."""
    from ..ops import rms_norm

    if form.norm:
        *args, eps = args
        g, *args = args
        x = rms_norm(x, g, eps)
    planes, residual = (args[:-1], args[-1]) if form.residual else (args, None)
    x = x if kind in FLOAT_KINDS else quantized_x(x, kind)
    per = len(PLANES[kind])
    ys = [torch.mm(x, _dequantized(kind, planes[i:i + per], x.shape[1]).t()) for i in range(0, len(planes), per)]
    if form.swiglu:
        return torch.nn.functional.silu(ys[0]) * ys[1]
    y = torch.cat([y.flatten() for y in ys]).view(x.shape[0], -1)  # [M, N0] [M, N1] ... in a row
    return y if residual is None else residual + y


def _register(kind: str, form_name: str):
    """The op multiplying by matrices of kernel type `kind` in form `form_name`:
    op(x, [g,] planes of each matrix, [r,] [eps]) -> [M, N]."""
    form = FORMS[form_name]
    planes = [f"{p}{i}" for i in range(form.matrices) for p in PLANES[kind]]
    per, first_plane = len(PLANES[kind]), 2 if form.norm else 1
    tensors = ["x"] + (["g"] if form.norm else []) + planes + (["r"] if form.residual else [])
    eps_arg = ", float eps" if form.norm else ""

    class Op(CustomOp):
        signature = (f"{product_c_name(kind, form_name).removeprefix('sharkport_')}"
                     f"({', '.join(f'Tensor {t}' for t in tensors)}{eps_arg}) -> (Tensor)")

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
            rows, k = ksel.arg_descs[0].t.shape
            scratch = kind not in FLOAT_KINDS and not x_on_stack(rows, k)
            call_mlir_function(kb, f"{product_stem(kind, form_name, eps, scratch)}_dispatch",
                               lambda: mlir.product_module(kind, form_name, arg_types, eps, scratch))

    Op.__name__ = product_c_name(kind, form_name)
    return CustomOp.register(library=_LIBRARY)(Op)


OPS = {(kind, form): _register(kind, form) for kind in PLANES for form in FORMS}


# ---- decode attention ----

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
    out = attention(q, k, v, length_mask(lens, k.shape[1], q.dtype, shape.window), shape.scale)
    return out.reshape(B, H * D)


@functools.cache
def attention_op(shape: AttentionShape):
    """The turbine op for decode attention of `shape` (one op per shape: its constants are in its
    name), writing the new K/V (k rotated) into the cache in place first:
    op(q [B, H*D] before rotary, k [B, Hkv*D] before rotary, v [B, Hkv*D],
    cache_state [P, page_elems], pages [B, blocks], start_positions [B], seq_lens [B], layer [2],
    cos [B, R/2], sin [B, R/2]) -> [B, H*D]."""
    operands = shape.operands
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
            call_mlir_function(kb, shape.name, lambda: mlir.attention_module(shape))

    Op.__name__ = shape.name
    return CustomOp.register(library=_LIBRARY)(Op)


# ---- prefill attention ----

def _prefill_eager(shape: PrefillShape, q, k, v) -> torch.Tensor:
    """The attention in torch: ops.attention under a causal mask (windowed with a window)."""
    from ..ops import attention, causal_mask

    B, S, D = q.shape[0], q.shape[1], shape.head_dim
    out = attention(q.view(B, S, shape.heads, D), k.view(B, S, shape.kv_heads, D), v.view(B, S, shape.kv_heads, D),
                    causal_mask(S, q.dtype, q.device, shape.window), shape.scale)
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
            call_mlir_function(kb, shape.name, lambda: mlir.prefill_module(shape))

    Op.__name__ = shape.name
    return CustomOp.register(library=_LIBRARY)(Op)


# ---- blocks ----

def _block_eager(shape: BlockShape, *args) -> torch.Tensor:
    """The block in torch, as the kernels it fuses compute it: the products as _eager, the
    attention as _attention_eager (which writes the cache in place). Its result is the block's
    output, then its intermediates, flattened."""
    x, g, *rest = args
    if shape.kinds:
        return _mixed_eager(shape, x, g, *rest)
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
        return _with_parts(shape, [ffn[:y.numel()], y.flatten(), qkv, att.flatten(), ffn[y.numel():]])
    return _with_parts(shape, [y.flatten(), qkv, att.flatten()])


def _with_parts(shape: BlockShape, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The block's result from its pieces, flattened, with zeros where the kernel keeps a split
    attention's parts (BlockShape.widths: scratch of the dispatch, not a result)."""
    flat = torch.cat(pieces)
    return torch.cat([flat, flat.new_zeros(shape.rows * sum(shape.widths) - flat.numel())])


def _mixed_eager(shape: BlockShape, x, g, *rest) -> torch.Tensor:
    """The layer block of mixed types in torch (see _block_eager): each product by its matrix's
    type, its planes the first of its MIXED_SLOTS operands; q, k and v plus their biases (laid out
    as the products) where the block has them."""
    S, kinds, b = MIXED_SLOTS, shape.kinds, int(shape.bias)
    starts = [0, S, 2 * S, 3 * S + b + 7, 4 * S + b + 8, 5 * S + b + 8, 6 * S + b + 8]  # of each matrix's slots
    planes = [rest[at:at + len(PLANES[kind])] for at, kind in zip(starts, kinds)]
    cache, pages, positions, lens, layer, cos, sin = rest[3 * S + b:3 * S + b + 7]
    g2 = rest[4 * S + b + 7]
    q, k, v = (_eager(kinds[i], FORMS["matvec_norm"], x, g, *planes[i], shape.eps) for i in range(3))
    if shape.bias:
        q, k, v = (y + bias.view(y.shape) for y, bias in zip(
            (q, k, v), rest[3 * S].split([q.numel(), k.numel(), v.numel()])))
    att = _attention_eager(shape.attention, q, k, v, cache, pages, positions, lens, layer, cos, sin)
    y = _eager(kinds[3], FORMS["matvec_add"], att, *planes[3], x)
    act = _eager(kinds[4], FORMS["swiglu_norm"], y, g2, *planes[4], *planes[5], shape.eps)
    out = _eager(kinds[6], FORMS["matvec_add"], act, *planes[6], y)
    return _with_parts(shape, [t.flatten() for t in (out, y, q, k, v, att, act)])


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
            call_mlir_function(kb, shape.name, lambda: mlir.block_module(shape, arg_types, sizes))

    Op.__name__ = shape.name
    return CustomOp.register(library=_LIBRARY)(Op)


def _static_elements(t: torch.Tensor) -> int | None:
    """t's element count where its shape is static, else None."""
    if not all(isinstance(d, int) for d in t.shape):
        return None
    return int(torch.Size(t.shape).numel())
