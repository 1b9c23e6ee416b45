"""Hand-written CPU kernels linked into exported modules (IREE custom dispatches): decode's
products and attention, prefill's attention.

`matvec.c` computes x [M, K] @ w[N, K].T for a few rows M reading w as stored: Q8_0, Q4_0 and
Q4_1 planes or float16 (quantized matrices of a row count that is a multiple of 8 through a copy
with their rows interleaved eight at a time, which the module makes once as it loads: see
interleave_rows); also q, k, v of one x in one dispatch (`matvec_qkv`), SwiGLU's
silu(x gate^T) * (x up^T) (`swiglu`), each product optionally of x RMS-normalized first (`norm`)
or, for one matrix, plus a residual (`residual`), so that a llama layer's norms and residual adds
take no dispatch of their own; decode attention over the paged cache with rotary and the
new position's cache write (`decode_attention`), and prefill's causal attention of the prompt to
its own K and V (`prefill_attention`; as IREE 3.9 compiles it, about 11% of SmolLM2's prefill).
A llama decode layer takes one dispatch (`layer_block`), or two where only one half applies
(`attention_block`: norm, q/k/v, attention, output product and residual; `ffn_block`: norm,
SwiGLU, down product and residual), whose workgroups share out each phase's work and wait for
each other inside the dispatch (matvec.c).
With quantized weights it multiplies 8-bit integers, as llama.cpp does on CPUs: x is quantized
per block of 32 values as gguf's Q8_0 quantizer does, so the product is that of the dequantized
weights with the Q8_0-dequantized x (`quantized_x`), about 1e-3 relative from the float32
product. IREE 3.9 generates no code that multiplies by quantized weights at memory speed
(docs/performance.md), so with `ExportConfig.matvec_kernels` the exporter routes decode (and
prefill's attention) through these kernels: the C file is compiled by the system C compiler
(`$CC`, else `cc`) for x86-64 with AVX2, FMA and F16C, plus AVX-512 with VNNI where the
exporting machine has it (`isa`; $SHARKPORT_KERNEL_ISA=avx2 builds for any AVX2 CPU), into
`cache_dir()`, the MLIR names the object (`matvec-<hash of the C file and flags>.o`, so an MLIR
compiles with the kernels it was exported with), and iree-compile links it into the .vmfb
(`compile_mlir` adds the search path), so iree-run-module, the runner and shortfin need nothing
more. Products over a dynamic number of rows (prefill) keep the traced form: IREE's data-tiled
matmuls are fast there. As IREE's `--iree-llvmcpu-target-cpu=host` compiles for the exporting
machine's CPU, so are the kernels built for its instruction set and their work split into
workgroups for its CPUs (`workgroups`, `kv_heads_per_workgroup`).

Under tracing each kernel is a turbine custom op whose body is a `flow.dispatch` of a
`stream.executable` that calls the C function once per workgroup (`kernels.ops`, loaded on use:
compiling needs only this module). Eagerly the ops compute the same in torch."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

from ..errors import SharkportError

SOURCE = Path(__file__).with_name("matvec.c")
MAX_ROWS = 8  # products over more rows of x keep the traced form (prefill, large batches)
MAX_K = 32 * 512  # longest rows of w: a workgroup keeps x quantized (MAX_K bytes a row) on its stack
# products that RMS-normalize x first (matvec.c's XN_FLOATS): each workgroup keeps the normalized
# x [M, K] on its stack, M * K of at most MAX_NORMED values (32 KiB); larger x is normalized by a
# dispatch of its own (SmolLM2: M up to 8 of K = 576; a 4096-wide model's decode at batch 1 and 2)
MAX_NORMED = 8192
# decode attention: query heads per kv head times head_dim, and positions per page, it takes
MAX_GD, MAX_STRIDE = 2048, 256
# outputs a chunk of a block's product takes (the block kernels' `chunk` argument): a multiple
# of the interleaved rows' 8
BLOCK_CHUNK_ROWS = 32
# prefill attention: the longest head, and query heads per kv head times head_dim, it takes
PREFILL_MAX_D, PREFILL_MAX_GD = 256, 1024  # matvec.c's PA_MAX_D, PA_MAX_GD
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffreestanding", "-fPIC", "-fno-stack-protector",
          "-fno-asynchronous-unwind-tables", "-fno-plt", "-fvisibility=hidden", "-std=c11",
          f"-DMAX_BLOCKS={MAX_K // 32}", f"-DXQ_BYTES={MAX_K}",
          f"-DXN_FLOATS={MAX_NORMED}", f"-DMAX_GD={MAX_GD}", f"-DMAX_STRIDE={MAX_STRIDE}"]
# Instruction sets the object is built for (isa()): "avx2" runs on any x86-64 CPU of the last
# decade; "avx512" adds AVX-512 with VNNI, for which matvec.c's interleaved products run 64-byte
# vectors and `vpdpbusd` (q4_x8_zmm, q8_x8_zmm). /proc/cpuinfo's names of the features it needs.
ISA_FLAGS = {"avx2": [], "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]}
AVX512_FEATURES = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
ISA_ENV = "SHARKPORT_KERNEL_ISA"
# A measuring aid (tools/bench_bounds.py): $SHARKPORT_KERNEL_PRODUCTS=loads builds kernels whose
# products only read their weights, =none kernels whose products read nothing; both give zeros.
PRODUCTS_ENV = "SHARKPORT_KERNEL_PRODUCTS"
PRODUCTS = {"full": 0, "loads": 1, "none": 2}  # matvec.c's SHARKPORT_PRODUCTS
# Outputs per workgroup for a product with N outputs: min(4096, 32 * ceil(N / (32 * W))), a
# multiple of 32 aiming at W = workgroups(), one for each CPU: fewer, larger workgroups quantize
# (and normalize) x fewer times, as each does all of it. SmolLM2 on 2 CPUs: 96 rows for 192
# outputs, 4096 for the 49152 of the output projection (12 workgroups). Side by side, 10 to 16
# rounds: 8 -> 4 workgroups a product, Q4_1 bs1 2.727 -> 2.676 ms, bs4 4.865 -> 4.750; the output
# projection in 12 workgroups instead of 192 (at most 256 rows each; at bs4 their x's quantizing
# and norms were 10% of a step's samples in tools/profile_step.py), Q4_1 bs4 3.406 -> 3.313 and
# 3.536 -> 3.372, bs1 1.873 -> 1.828 and 1.927 -> 1.975; 4 -> 2 workgroups, Q4_1 bs1 1.998 -> 1.936
# and 1.976 -> 1.860, bs4 3.059 -> 2.915 and 3.097 -> 2.897; Q8_0 bs1 2.398 -> 2.282, bs4 3.366 ->
# 3.132; F16 bs1 4.015 -> 3.862, bs4 6.829 -> 6.547.
ROW_QUANTUM, WORKGROUPS_PER_CPU, MAX_ROWS_PER_WORKGROUP = 32, 1, 4096
# plane order of each kernel's arguments after x (sharkport.quant's plane names). Q8_0X8, Q4_0X8
# and Q4_1X8 are Q8_0, Q4_0 and Q4_1 with their rows interleaved eight at a time (interleave_rows).
PLANES = {"Q8_0": ("qs", "d"), "Q4_0": ("qs", "d"), "Q4_1": ("qs", "d", "m"), "F16": ("w",),
          "Q8_0X8": ("qs", "d"), "Q4_0X8": ("qs", "d"), "Q4_1X8": ("qs", "d", "m")}
INTERLEAVED = {"Q8_0": "Q8_0X8", "Q4_0": "Q4_0X8", "Q4_1": "Q4_1X8"}  # a weight type -> its kernel's
STORED = {x8: kind for kind, x8 in INTERLEAVED.items()}  # and back
# elements of each buffer the C function receives (x, the planes, y), as (factor, divisor) of
# products of M, N and K: x is M*K floats, Q8_0's qs N*K bytes, a block scale plane N*K/32, ...
SIZES = {"Q8_0": ("mk", ("nk", 1), ("nk", 32), "mn"), "Q4_0": ("mk", ("nk", 2), ("nk", 32), "mn"),
         "Q4_1": ("mk", ("nk", 2), ("nk", 32), ("nk", 32), "mn"), "F16": ("mk", ("nk", 1), "mn")}
SIZES.update({x8: SIZES[kind] for kind, x8 in INTERLEAVED.items()})

_enabled = False


@contextlib.contextmanager
def enabled(on: bool = True):
    """Within this block (the exporter's tracing), `linear` uses the kernels where they apply."""
    global _enabled
    before, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = before


def decode_indices(seq_lens, start_positions, seq_block_ids):
    """decode's index arguments as the kernels should read them: inside `enabled()`, each made by
    a dispatch of its own (clamped at 0, as valid ones are) rather than read from the call's
    arguments. IREE 3.9 copies an argument of a batch-1 call into a transient buffer before each
    kernel dispatch that reads it: 117 copy commands in a SmolLM2 decode step (the page ids twice
    a layer, the positions and the lengths once), against 3 small dispatches in one stage here.
    SmolLM2 decode bs1, side by side: Q4_1 6.20 -> 5.94 ms, Q8_0 7.41 -> 7.10, F16 the same
    (docs/performance.md)."""
    indices = seq_lens, start_positions, seq_block_ids
    return tuple(t.clamp(min=0) for t in indices) if _enabled else indices


def kernel_type(w) -> str | None:
    """The kernel that multiplies by weight `w` (a key of PLANES), or None."""
    import torch

    from ..archive.tensors import QuantizedTensor

    if isinstance(w, QuantizedTensor):
        return w.type_name if w.type_name in PLANES and len(w.shape) == 2 else None
    return "F16" if w.dtype == torch.float16 and w.dim() == 2 and w.shape[1] % 8 == 0 else None


def decode_rows(x) -> bool:
    """Whether x [M, ...] is decode's: inside `enabled()`, float32, a static M of at most MAX_ROWS.
    Such products take the kernels, and such RMSNorms one dispatch region (ops.regions)."""
    import torch

    rows = x.shape[0]
    return _enabled and isinstance(rows, int) and rows <= MAX_ROWS and x.dtype == torch.float32


def _product(form: str, x, weights, norm=None, residual=None):
    """x [M, K] float32 times `weights` through the kernel of `form` (see kernels.ops.FORMS), or
    None where none applies: outside `enabled()`, for a dynamic or large M, other dtypes and weight
    types, matrices of different types. `norm` (its weight [K] float32, eps): x RMS-normalized
    first, where M * K <= MAX_NORMED; `residual` [M, N] float32: added to the product."""
    import torch

    if not (decode_rows(x) and x.shape[1] <= MAX_K):
        return None
    if norm is not None and not (x.shape[0] * x.shape[1] <= MAX_NORMED and norm[0].dtype == torch.float32
                                 and tuple(norm[0].shape) == (x.shape[1],)):
        return None
    if residual is not None and residual.dtype != torch.float32:
        return None
    found = _kernel_planes(weights)
    if found is None:
        return None
    kind, planes = found
    from .ops import OPS

    norm_weight, eps = ([norm[0]], [float(norm[1])]) if norm is not None else ([], [])
    return OPS[kind, form](x, *norm_weight, *(p for each in planes for p in each),
                           *([] if residual is None else [residual]), *eps)


def _kernel_planes(weights):
    """(the kernel type, each weight's planes in PLANES order) of weights one kernel multiplies
    by, or None where their types differ or have no kernel: interleaved (INTERLEAVED) where every
    matrix's row count is a multiple of 8."""
    kinds = {kernel_type(w) for w in weights}
    if len(kinds) != 1 or None in kinds:
        return None
    kind = kinds.pop()
    planes = [[w] if kind == "F16" else [w.planes[n] for n in PLANES[kind]] for w in weights]  # per weight
    if kind in INTERLEAVED and all(w.shape[0] % 8 == 0 for w in weights):
        kind, planes = INTERLEAVED[kind], [interleave_rows(p) for p in planes]
    return kind, planes


def interleave_rows(planes):
    """Q8_0 or Q4 planes (qs [N, B, 32 or 16], then d and m [N, B]; N a multiple of 8) with their
    rows interleaved eight at a time, as matvec.c's q8_x8 and q4_x8 read them: per group of eight
    rows and block b, 4 bytes of each row's block at a time (chunk j: bytes 4j .. 4j + 3 of rows
    0..7), then the eight rows' scales (offsets) of block b together. The planes keep their
    shapes. Under tracing this is a transpose of a parameter, which IREE hoists into the module's
    initializer: it runs once, as the module loads, into a copy that decode's products read (one
    for all functions)."""
    qs, *scales = planes
    N, B, size = qs.shape
    return [qs.reshape(N // 8, 8, B, size // 4, 4).permute(0, 2, 3, 1, 4).reshape(N, B, size),
            *(p.reshape(N // 8, 8, B).permute(0, 2, 1).reshape(N, B) for p in scales)]


def deinterleave_rows(planes):
    """The inverse of interleave_rows."""
    qs, *scales = planes
    N, B, size = qs.shape
    return [qs.reshape(N // 8, B, size // 4, 8, 4).permute(0, 3, 1, 2, 4).reshape(N, B, size),
            *(p.reshape(N // 8, B, 8).permute(0, 2, 1).reshape(N, B) for p in scales)]


def matvec(x, w, norm=None, residual=None):
    """x [M, K] float32 @ w[N, K].T → [M, N] through a kernel, or None where none applies. With
    `norm` (weight [K], eps) x is RMS-normalized first as ops.rms_norm does (the output projection
    after the final norm); with `residual` [M, N] the result is residual + x @ w.T (attention's
    output projection and the FFN's down projection with their residual adds); not both."""
    if norm is not None and residual is not None:
        return None
    form = "matvec_norm" if norm is not None else "matvec_add" if residual is not None else "matvec"
    return _product(form, x, [w], norm, residual)


def matvec_qkv(x, wq, wk, wv, norm=None):
    """(x @ wq.T, x @ wk.T, x @ wv.T) by one kernel dispatch, or None; with `norm` (weight [K],
    eps), of x RMS-normalized. The dispatch writes the three products one after the other, so each
    is a contiguous slice of its result (a strided one would be copied before its use: 3 copies per
    layer at batch 4)."""
    y = _product("qkv" if norm is None else "qkv_norm", x, [wq, wk, wv], norm)
    if y is None:
        return None
    flat, rows = y.flatten(), x.shape[0]
    sizes = [rows * w.shape[0] for w in (wq, wk, wv)]
    return tuple(part.view(rows, -1) for part in flat.split(sizes))


def swiglu(x, gate, up, norm=None):
    """silu(x @ gate.T) * (x @ up.T) → [M, N] by one kernel dispatch, or None; with `norm`
    (weight [K], eps), of x RMS-normalized."""
    return _product("swiglu" if norm is None else "swiglu_norm", x, [gate, up], norm)


def decode_attention(q, k, v, cache_state, cache, layer, page_ids, start_positions, seq_lens, rope=None,
                     rope_layout: str = "interleaved", scale: float | None = None, window: int = 0,
                     logit_cap: float = 0.0):
    """Decode attention in one kernel dispatch: rotates q [B, 1, H, D] and k [B, 1, Hkv, D] by
    `rope` (cos, sin [B, 1, R/2], or None) in `rope_layout` (as ops.apply_rope), writes k and v
    at start_positions into cache_state (as `cache`, a layers.PagedCache, lays it out; in place;
    a float16 cache stores them rounded to nearest, as `.half()`), and attends to the positions
    < seq_lens → [B, 1, H, D]. Returns None, having written nothing, where the kernel does not
    apply: outside `enabled()`, a sliding window, soft-capping, q not in float32, a cache in
    neither float32 nor float16, shapes beyond MAX_GD / MAX_STRIDE."""
    B, S, H, D = q.shape
    shape = _attention_shape(B, S, H, D, q.dtype, cache_state, cache, rope, rope_layout, scale, window, logit_cap)
    if shape is None:
        return None
    from .ops import attention_op

    out = attention_op(shape)(q.reshape(B, H * D), k.reshape(B, -1), v.reshape(B, -1), cache_state, page_ids,
                              start_positions, seq_lens, _layer_operand(layer, cache), *_rope_operands(rope, q))
    return out.view(B, 1, H, D)


def _attention_shape(B, S, H, D, dtype, cache_state, cache, rope, rope_layout, scale, window, logit_cap):
    """The kernels.ops.AttentionShape of decode attention of B sequences' S query positions of H
    heads of D, or None where the kernel does not apply (see decode_attention)."""
    import torch

    element = {torch.float32: "f32", torch.float16: "f16"}.get(cache_state.dtype)  # of the kernels' cache
    G, rope_dim = H // cache.kv_heads, 2 * rope[0].shape[-1] if rope is not None else 0
    if not (_enabled and isinstance(S, int) and S == 1 and dtype == torch.float32
            and element and not window and not logit_cap
            and D % 8 == 0 and G * D <= MAX_GD and cache.stride <= MAX_STRIDE and rope_dim <= D):
        return None
    from .ops import AttentionShape

    return AttentionShape(H, cache.kv_heads, D, cache.block_count, cache.stride,
                          D ** -0.5 if scale is None else float(scale), rope_dim, rope_layout, element,
                          kv_heads_per_workgroup(B, cache.kv_heads, G * D))


def _layer_operand(layer, cache):
    """The cache layer as the attention kernels take it: a tensor operand (one traced block may
    serve every layer) [2] of the layer and the layer count. A constant layer is given with the
    layer count after it: IREE fills a one-value constant by a dispatch on every call (a splat),
    and keeps a two-value one in the module's constants."""
    import torch

    if isinstance(layer, torch.Tensor):
        return torch.stack([layer.reshape(()), torch.tensor(cache.block_count)])
    return torch.tensor([layer, cache.block_count])


def _rope_operands(rope, like):
    """cos and sin [B, R/2] as the attention kernels take them (`like`'s rows, unread, without rotary)."""
    B = like.shape[0]
    return tuple(t.reshape(B, -1) for t in rope) if rope is not None else (like.reshape(B, -1),) * 2


# ---- a decode layer in one or two dispatches (matvec.c's block kernels) ----

def _block_rows(h, norm):
    """h [..., E] as the rows [M, E] a block kernel takes, with `norm` (weight [E], eps) inside
    it; None where none applies (see decode_rows, MAX_K, MAX_NORMED)."""
    import torch

    rows = h.reshape(-1, h.shape[-1])
    M, E = rows.shape
    if not (decode_rows(rows) and isinstance(E, int) and E <= MAX_K and M * E <= MAX_NORMED
            and norm[0].dtype == torch.float32 and tuple(norm[0].shape) == (E,)):
        return None
    return rows


def ffn_block(h, norm, gate, up, down):
    """h + down(silu(n(h) gate^T) * (n(h) up^T)) → h's shape, n(h) being h RMS-normalized by `norm`
    (weight [E], eps): llama's feed-forward with its norm and residual add in one kernel dispatch
    (matvec.c's sharkport_ffn_block_<type>, its products' work shared out by the workgroups in two
    phases), or None where it does not apply: outside `enabled()`, matrices of differing or other
    types, shapes beyond the products' (MAX_K, MAX_NORMED)."""
    rows = _block_rows(h, norm)
    if rows is None:
        return None
    (M, E), I = rows.shape, gate.shape[0]
    found = _kernel_planes([gate, up, down])
    if not found or tuple(up.shape) != (I, E) or tuple(down.shape) != (E, I) or I > MAX_K:
        return None
    kind, planes = found
    from .ops import BlockShape, block_op

    shape = BlockShape("ffn", kind, M, E, I, float(norm[1]))
    y = block_op(shape)(rows, norm[0], *(p for each in planes for p in each))
    return y[:M * E].view(h.shape)


def attention_block(h, norm, wq, wk, wv, wo, cache_state, cache, layer, page_ids, start_positions, seq_lens,
                    heads: int, head_dim: int, rope=None, rope_layout: str = "interleaved",
                    scale: float | None = None, window: int = 0, logit_cap: float = 0.0):
    """h + o(attention(q, k, v)) → h's shape, where q, k, v are the products of h [B, 1, E]
    RMS-normalized by `norm` (weight [E], eps) with wq, wk, wv and the attention is
    decode_attention's (rotary, the cache write, `heads` query heads of `head_dim`): llama's
    attention with its norm and residual add in one kernel dispatch (matvec.c's
    sharkport_attention_block_<type>, in three phases), or None, having written nothing, where it
    does not apply (see ffn_block and decode_attention)."""
    return _attention_dispatch(h, norm, (wq, wk, wv, wo), None, cache_state, cache, layer, page_ids, start_positions,
                               seq_lens, heads, head_dim, rope, rope_layout, scale, window, logit_cap)


def layer_block(h, norm, wq, wk, wv, wo, ffn_norm, gate, up, down, cache_state, cache, layer, page_ids,
                start_positions, seq_lens, heads: int, head_dim: int, rope=None, rope_layout: str = "interleaved",
                scale: float | None = None, window: int = 0, logit_cap: float = 0.0):
    """A whole llama decode layer in one kernel dispatch (matvec.c's sharkport_layer_block_<type>,
    in five phases): attention_block's h1, then ffn_block's output on h1 with `ffn_norm` (weight,
    eps: the same eps as `norm`'s), gate, up and down. Or None, having written nothing, where either
    block does not apply. Against the two dispatches it saves a dispatch's start and end a layer,
    and a workgroup waiting at the end of the output projection fetches its first gate/up rows."""
    if float(ffn_norm[1]) != float(norm[1]):
        return None
    return _attention_dispatch(h, norm, (wq, wk, wv, wo), (ffn_norm[0], gate, up, down), cache_state, cache, layer,
                               page_ids, start_positions, seq_lens, heads, head_dim, rope, rope_layout, scale, window,
                               logit_cap)


def _attention_dispatch(h, norm, weights, ffn, cache_state, cache, layer, page_ids, start_positions, seq_lens,
                        heads, head_dim, rope, rope_layout, scale, window, logit_cap):
    """attention_block's result, or with `ffn` (the FFN norm's weight, gate, up, down) layer_block's."""
    rows = _block_rows(h, norm)
    if rows is None:
        return None
    M, E = rows.shape
    shape = _attention_shape(M, 1, heads, head_dim, rows.dtype, cache_state, cache, rope, rope_layout, scale, window,
                             logit_cap)
    kv = cache.kv_heads * head_dim
    matrices, shapes = list(weights), [(heads * head_dim, E), (kv, E), (kv, E), (E, heads * head_dim)]
    if ffn is not None:
        g2, gate, up, down = ffn
        I = gate.shape[0]
        if _block_rows(h, (g2, norm[1])) is None or not isinstance(I, int) or I > MAX_K:
            return None
        matrices, shapes = matrices + [gate, up, down], shapes + [(I, E), (I, E), (E, I)]
    found = shape is not None and _kernel_planes(matrices)
    if not found or [tuple(w.shape) for w in matrices] != shapes:
        return None
    kind, planes = found
    from .ops import BlockShape, block_op

    operands = [rows, norm[0], *planes[0], *planes[1], *planes[2], cache_state, page_ids, start_positions, seq_lens,
                _layer_operand(layer, cache), *_rope_operands(rope, rows), *planes[3]]
    if ffn is None:
        block = BlockShape("attention", kind, M, E, 0, float(norm[1]), shape)
    else:
        block = BlockShape("layer", kind, M, E, I, float(norm[1]), shape)
        operands += [g2, *planes[4], *planes[5], *planes[6]]
    y = block_op(block)(*operands)
    return y[:M * E].view(h.shape)


def kv_heads_per_workgroup(batch: int, kv_heads: int, gd: int) -> int:
    """How many of a sequence's kv heads each decode attention workgroup takes (`gd`: query heads
    per kv head times head_dim): the most, a divisor of kv_heads, that still leaves a workgroup
    for each CPU this process may run on (as many as the runner's IREE workers). A workgroup with
    all of them reads each page's K and V whole, in address order, and prefetches the next page
    whole, where one (sequence, kv head) a workgroup reads a third of each row (SmolLM2: 3 kv
    heads) and its neighbours the rest: decode bs4's attention 1.09 -> 0.80 ms a step in
    tools/attention_harness.c from memory. With fewer sequences than CPUs, more workgroups share
    each sequence (batch 1: one per kv head)."""
    fits = [w for w in range(1, kv_heads + 1) if kv_heads % w == 0 and w * gd <= MAX_GD]
    return max([w for w in fits if batch * (kv_heads // w) >= _cpus()], default=1)


def block_counters(phases: int) -> int:
    """int32 phase counters of a block dispatch of `phases` phases (matvec.c's BLOCK_COUNTERS(P,
    W), each on a line of 16): for each phase a line for each workgroup's span and one of the items
    finished, and one line of the workgroups that left."""
    return (phases * (workgroups() + 1) + 1) * 16


def workgroups() -> int:
    """How many workgroups a product's outputs aim at (see ROW_QUANTUM)."""
    return WORKGROUPS_PER_CPU * _cpus()


def _cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prefill_attention(q, k, v, scale: float | None = None, window: int = 0, logit_cap: float = 0.0):
    """Causal attention of prefill's q [B, S, H, D] to its own k and v [B, S, Hkv, D] (all rotated)
    by one kernel dispatch → [B, S, H, D], as ops.attention under ops.causal_mask. Returns None
    where the kernel does not apply: outside `enabled()`, a sliding window, soft-capping, inputs
    not in float32, D not a multiple of 8 or above PREFILL_MAX_D, (H / Hkv) * D above PREFILL_MAX_GD."""
    import torch

    B, S, H, D = q.shape
    Hkv = k.shape[2]
    if not (_enabled and q.dtype == k.dtype == v.dtype == torch.float32 and not window and not logit_cap
            and D % 8 == 0 and D <= PREFILL_MAX_D and H // Hkv * D <= PREFILL_MAX_GD):
        return None
    from .ops import PrefillShape, prefill_attention_op

    op = prefill_attention_op(PrefillShape(H, Hkv, D, D ** -0.5 if scale is None else float(scale)))
    return op(q.reshape(B, S, H * D), k.reshape(B, S, Hkv * D), v.reshape(B, S, Hkv * D)).view(B, S, H, D)


def quantized_x(x):
    """x [..., K] as the kernels multiply it with quantized weights: each block of 32 values
    quantized as gguf's Q8_0 reference quantizer does (scale max|x| / 127, values rounded half away
    from zero, the scale stored as float16) and dequantized to float32."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    v = blocks * (1 / scale).masked_fill(scale == 0, 0)
    a = v.abs()
    whole = a.floor()
    q = (whole + (2 * (a - whole)).floor()).copysign(v)
    return (q * scale.half().float()).reshape(x.shape)


def cache_dir() -> Path:
    """Where compiled kernel objects live: iree-compile finds them here by name."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sharkport" / "kernels"


def isa() -> str:
    """The instruction set the kernels are built for (a key of ISA_FLAGS): $SHARKPORT_KERNEL_ISA if
    set, else "avx512" where this machine has AVX-512 with VNNI, else "avx2". As IREE's
    `--iree-llvmcpu-target-cpu=host`, a module exported on an AVX-512 machine needs one to run;
    SHARKPORT_KERNEL_ISA=avx2 exports kernels that run on any x86-64 CPU with AVX2."""
    chosen = os.environ.get(ISA_ENV, "").strip().lower()
    if chosen:
        if chosen not in ISA_FLAGS:
            raise SharkportError(f"{ISA_ENV}={chosen!r}: choose one of {', '.join(ISA_FLAGS)} (or unset it to "
                                 "build for this machine)")
        return chosen
    return "avx512" if AVX512_FEATURES <= _cpu_features() else "avx2"


@cache
def _cpu_features() -> frozenset[str]:
    """This machine's CPU feature flags (/proc/cpuinfo's; none where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cflags() -> list[str]:
    """The compiler flags the object is built with: CFLAGS, those of isa() and, for
    $SHARKPORT_KERNEL_PRODUCTS other than "full", the measuring aid's define (PRODUCTS)."""
    aid = PRODUCTS[products()]
    return CFLAGS + ISA_FLAGS[isa()] + ([f"-DSHARKPORT_PRODUCTS={aid}"] if aid else [])


def products() -> str:
    """What the kernels' products do (a key of PRODUCTS): $SHARKPORT_KERNEL_PRODUCTS, else "full".
    "loads" and "none" are a measuring aid, not a model: their products are zeros."""
    chosen = os.environ.get(PRODUCTS_ENV, "").strip().lower() or "full"
    if chosen not in PRODUCTS:
        raise SharkportError(f"{PRODUCTS_ENV}={chosen!r}: choose one of {', '.join(PRODUCTS)} (or unset it for the "
                             "products themselves)")
    return chosen


def object_name() -> str:
    """The object's file name, unique to matvec.c's text, the compiler and its flags."""
    return _object_name(_compiler(), tuple(cflags()))


@cache
def _object_name(cc: str, flags: tuple[str, ...]) -> str:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc,) + flags).encode()).hexdigest()[:16]
    return f"matvec-{key}.o"


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def available() -> bool:
    """Whether this machine can build the kernels (an x86-64 host with a C compiler on PATH)."""
    return platform.machine().lower() in ("x86_64", "amd64") and shutil.which(_compiler()) is not None


def object_path() -> Path:
    """matvec.c compiled for x86-64 into cache_dir() (built once per source and flags).

    The MLIR names the object and iree-compile links it from there
    (`--iree-hal-executable-object-search-path`, which `compile_mlir` adds): IREE 3.9 fails to
    link the same object embedded in the MLIR as data (undefined symbol)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise SharkportError(f"--matvec-kernels: the kernels are written for x86-64, not {platform.machine()}; "
                             "export without --matvec-kernels")
    cc = _compiler()
    if shutil.which(cc) is None:
        raise SharkportError(f"--matvec-kernels needs a C compiler to build {SOURCE.name}: {cc!r} is not on PATH "
                             "(install gcc or clang, set CC, or export without --matvec-kernels)")
    flags = tuple(cflags())
    return _built(cc, flags, cache_dir() / _object_name(cc, flags))


@cache
def _built(cc: str, flags: tuple[str, ...], obj: Path) -> Path:
    """obj, matvec.c compiled by cc with flags unless the cache already holds it."""
    if not obj.exists():
        obj.parent.mkdir(parents=True, exist_ok=True)
        tmp = obj.with_suffix(f".{os.getpid()}.tmp")
        run = subprocess.run([cc, *flags, "-c", str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
        if run.returncode:
            tmp.unlink(missing_ok=True)
            first = (run.stderr.strip().splitlines() or ["no output"])[0]
            hint = f"; {ISA_ENV}=avx2 builds without AVX-512" if ISA_FLAGS["avx512"][0] in flags else ""
            raise SharkportError(f"--matvec-kernels: {cc} failed to compile {SOURCE} ({first}{hint})")
        os.replace(tmp, obj)
    return obj


@contextlib.contextmanager
def _mapped(mlir_path: str | os.PathLike):
    """An MLIR file's bytes, memory-mapped (b"" for an empty file, which mmap refuses)."""
    import mmap

    with open(mlir_path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            yield m


def referenced_by(mlir_path: str | os.PathLike) -> bool:
    """Whether an MLIR file calls the kernels (so iree-compile needs their object)."""
    with _mapped(mlir_path) as m:
        return any(m.find(symbol) >= 0 for symbol in (b"sharkport_matvec_", b"sharkport_decode_", b"sharkport_prefill_",
                                                      b"sharkport_attention_block_", b"sharkport_ffn_block_",
                                                      b"sharkport_layer_block_"))


def objects_named_by(mlir_path: str | os.PathLike) -> set[str]:
    """The kernel objects an MLIR file links (object_name() of the matvec.c it was exported with)."""
    with _mapped(mlir_path) as m:
        return {name.decode() for name in re.findall(rb"matvec-[0-9a-f]{16}\.o", m)}


def compile_flags_for(mlir_path: str | os.PathLike) -> list[str]:
    """iree-compile flags an MLIR file needs for the kernels it calls (building their object).

    The MLIR names its object by the hash of the matvec.c it was exported with, so it compiles
    with those kernels, from cache_dir(), even after matvec.c changes; an object no longer there
    (another version's, in a fresh cache) is an error naming it."""
    if not referenced_by(mlir_path):
        return []
    current = object_path()
    for name in sorted(objects_named_by(mlir_path) - {current.name}):
        if not (current.parent / name).exists():
            raise SharkportError(f"{mlir_path}: it links the kernels object {name}, built from another version of "
                                 f"{SOURCE.name} and not in {current.parent}; export the model again (this version "
                                 f"builds {current.name})")
    return [f"--iree-hal-executable-object-search-path={current.parent}"]
