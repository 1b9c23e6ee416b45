"""Hand-written CPU kernels linked into exported modules (IREE custom dispatches): the
products of decode and prefill, and their attention.

`matvec.c` computes x [M, K] @ w[N, K].T reading w as stored: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS planes, float16 or bfloat16 (quantized matrices
of a row count that is a multiple of 8 with their rows interleaved eight at a time, as archives
hold them: quant.interleave_planes);
also q, k, v of one x in one dispatch (`matvec_qkv`), SwiGLU's silu(x gate^T) * (x up^T)
(`swiglu`), each product optionally of x RMS-normalized first (`norm`) or, for one matrix, plus
a residual (`residual`); decode attention over the paged cache with rotary and the new
position's cache write (`decode_attention`), prefill's causal attention of the prompt to its own
K and V (`prefill_attention`), and a llama decode layer in one dispatch (`layer_block`) or two
(`attention_block`, `ffn_block`), whose workgroups share out each phase's work and wait for each
other inside the dispatch.

With quantized weights it multiplies 8-bit integers, as llama.cpp does on CPUs: x is quantized
per block of 32 values as gguf's Q8_0 quantizer does (IQ4_NL and IQ4_XS too), or for the
K-quants per 256 values as llama.cpp's Q8_K, so the product is that of the dequantized weights with the dequantized x
(`quantized_x`), about 1e-3 relative from the float32 product. IREE 3.9 generates no code that
multiplies by quantized weights at memory speed (docs/performance.md); the export swaps a model's
layers for modules that call these functions (sharkport.export.kernels). Each function returns
None where its kernel does not apply (a dynamic M where a kernel needs a static one, other
dtypes, weight types or sizes), and the caller computes as before. Prefill's products take the
kernels too, over its dynamic number of tokens (x quantized into a scratch buffer of the
dispatch, up to PASS_BYTES of rows, which each pass over a workgroup's weight rows takes, eight
rows of w against all of them at a time while those stay in the caches): faster than IREE's
dequantizing matmuls on quantized weights, and the module then holds no float32 copy of a weight
(docs/performance.md).

`build` compiles matvec.c for the exporting machine's x86-64 instruction set; `layout` holds
what the kernels take and how their work is split into workgroups; `ops` makes each kernel a
turbine custom op whose body (`mlir`) is a `flow.dispatch` of a `stream.executable` that calls
the C function once per workgroup (loaded on use: compiling needs only `build`). Eagerly the
ops compute the same in torch."""

from __future__ import annotations

from .build import (AVX512_FEATURES, CFLAGS, ISA_ENV, ISA_FLAGS, PRODUCTS, PRODUCTS_ENV, SOURCE, available, cache_dir,
                    cflags, compile_flags_for, isa, object_name, object_path, objects_named_by, products,
                    referenced_by)
from .layout import (BLOCK_CHUNK_ROWS, BLOCK_KINDS, FLOAT_KINDS, INTERLEAVED, MAX_GD, MAX_K, MAX_NORMED, MAX_ROWS, MAX_STRIDE,
                     MIXED_KINDS, MIXED_LAYER_PLANES, MIXED_SLOTS, PLANES, PREFILL_MAX_D, PREFILL_MAX_GD, SIZES, STORED, X_PER_256,
                     block_counters, block_kv_heads_per_workgroup, cpus, kv_heads_per_workgroup, quantized_x, workgroups,
                     x_on_stack)

__all__ = ["AVX512_FEATURES", "BLOCK_CHUNK_ROWS", "BLOCK_KINDS", "CFLAGS", "FLOAT_KINDS", "INTERLEAVED", "ISA_ENV", "ISA_FLAGS",
           "MAX_GD", "MAX_K", "MAX_NORMED", "MAX_ROWS", "MAX_STRIDE", "PLANES", "PREFILL_MAX_D", "PREFILL_MAX_GD",
           "PRODUCTS", "PRODUCTS_ENV", "SIZES", "SOURCE", "STORED", "X_PER_256", "attention_block", "available",
           "block_counters", "block_kv_heads_per_workgroup", "cache_dir", "cflags", "compile_flags_for", "cpus",
           "decode_attention", "decode_indices", "decode_rows", "ffn_block", "isa", "kernel_type",
           "kv_heads_per_workgroup", "layer_block", "matvec", "matvec_qkv", "object_name", "object_path",
           "objects_named_by", "prefill_attention", "products", "quantized_x", "referenced_by", "swiglu", "workgroups"]


def decode_indices(seq_lens, start_positions, seq_block_ids):
    """decode's index arguments as the kernels should read them: each made by a dispatch of its
    own (clamped at 0, as valid ones are) rather than read from the call's arguments. IREE 3.9
    copies an argument of a batch-1 call into a transient buffer before each kernel dispatch that
    reads it (the page ids twice a layer, the positions and the lengths once), where these are 3
    small dispatches in one stage."""
    return tuple(t.clamp(min=0) for t in (seq_lens, start_positions, seq_block_ids))


def kernel_type(w) -> str | None:
    """The kernel that multiplies by weight `w` (a key of PLANES), or None."""
    import torch

    from ..archive.tensors import QuantizedTensor

    if isinstance(w, QuantizedTensor):
        return w.type_name if w.type_name in PLANES and len(w.shape) == 2 else None
    floats = {torch.float16: "F16", torch.bfloat16: "BF16"}
    return floats.get(w.dtype) if w.dim() == 2 and w.shape[1] % 8 == 0 else None


def decode_rows(x) -> bool:
    """Whether x [M, ...] is decode's: float32, a static M of at most MAX_ROWS. Such RMSNorms are
    one dispatch region (ops.regions), and such a layer can be one block kernel."""
    import torch

    rows = x.shape[0]
    return isinstance(rows, int) and rows <= MAX_ROWS and x.dtype == torch.float32


def _product(form: str, x, weights, norm=None, residual=None):
    """x [M, K] float32 times `weights` through the kernel of `form` (see kernels.ops.FORMS), or
    None where none applies: other dtypes and weight types, matrices of different types, rows
    longer than MAX_K. M may be dynamic (prefill's tokens). `norm` (its weight [K] float32, eps): x
    RMS-normalized first, for K <= MAX_NORMED; `residual` [M, N] float32: added to the product."""
    import torch

    M, K = x.shape
    if not (x.dtype == torch.float32 and isinstance(K, int) and K <= MAX_K):
        return None
    if norm is not None and not (K <= MAX_NORMED and norm[0].dtype == torch.float32 and tuple(norm[0].shape) == (K,)):
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
    by, or None where their types differ or have no kernel: with rows interleaved (INTERLEAVED)
    where every matrix's row count is a multiple of 8, as an archive holds them (planes held
    otherwise are permuted in the program, a copy IREE makes as the module loads)."""
    from ..archive.tensors import QuantizedTensor
    from ..quant import interleaves

    kinds = {kernel_type(w) for w in weights}
    if len(kinds) != 1 or None in kinds:
        return None
    kind = kinds.pop()
    if kind in FLOAT_KINDS:
        return kind, [[w] for w in weights]
    x8 = kind in INTERLEAVED and all(interleaves(w.type_name, w.shape) for w in weights)
    held = [(w if w.interleaved else QuantizedTensor.held(w.type_name, w.shape, w.planes)) if x8 else w.row_order()
            for w in weights]
    return INTERLEAVED[kind] if x8 else kind, [[w.planes[n] for n in PLANES[kind]] for w in held]


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
    flat, rows, start, parts = y.flatten(), x.shape[0], 0, []
    for w in (wq, wk, wv):  # slices, not split(): torch-mlir lowers no split into sizes of a dynamic M
        parts.append(flat[start:start + rows * w.shape[0]].view(rows, w.shape[0]))
        start = start + rows * w.shape[0]
    return tuple(parts)


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
    < seq_lens (with a sliding `window`, only the last `window` of them) → [B, 1, H, D]. Returns
    None, having written nothing, where the kernel does not apply: soft-capping, q not in float32,
    a cache in neither float32 nor float16, shapes beyond MAX_GD / MAX_STRIDE."""
    B, S, H, D = q.shape
    shape = _attention_shape(B, S, H, D, q.dtype, cache_state, cache, rope, rope_layout, scale, window, logit_cap)
    if shape is None:
        return None
    from .ops import attention_op

    out = attention_op(shape)(q.reshape(B, H * D), k.reshape(B, -1), v.reshape(B, -1), cache_state, page_ids,
                              start_positions, seq_lens, _layer_operand(layer, cache), *_rope_operands(rope, q))
    return out.view(B, 1, H, D)


def _attention_shape(B, S, H, D, dtype, cache_state, cache, rope, rope_layout, scale, window, logit_cap,
                     block=False):
    """The kernels.ops.AttentionShape of decode attention of B sequences' S query positions of H
    heads of D (in a block: its items split by pages), or None where the kernel does not apply (see
    decode_attention)."""
    import torch

    element = {torch.float32: "f32", torch.float16: "f16"}.get(cache_state.dtype)  # of the kernels' cache
    G, rope_dim = H // cache.kv_heads, 2 * rope[0].shape[-1] if rope is not None else 0
    if not (isinstance(S, int) and S == 1 and dtype == torch.float32
            and element and not logit_cap
            and D % 8 == 0 and G * D <= MAX_GD and cache.stride <= MAX_STRIDE and rope_dim <= D):
        return None
    from .ops import AttentionShape

    per_workgroup = block_kv_heads_per_workgroup if block else kv_heads_per_workgroup
    return AttentionShape(H, cache.kv_heads, D, cache.block_count, cache.stride,
                          D ** -0.5 if scale is None else float(scale), rope_dim, rope_layout, element,
                          per_workgroup(B, cache.kv_heads, G * D), int(window))


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
    phases), or None where it does not apply: matrices of differing types or of types without
    block kernels (BLOCK_KINDS), shapes beyond the products' (MAX_K, MAX_NORMED)."""
    rows = _block_rows(h, norm)
    if rows is None:
        return None
    (M, E), I = rows.shape, gate.shape[0]
    found = _kernel_planes([gate, up, down])
    if (not found or found[0] not in BLOCK_KINDS or tuple(up.shape) != (I, E) or tuple(down.shape) != (E, I)
            or not x_on_stack(M, I)):
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
                scale: float | None = None, window: int = 0, logit_cap: float = 0.0, biases=None):
    """A whole llama decode layer in one kernel dispatch (matvec.c's sharkport_layer_block_<type>,
    in five phases): attention_block's h1, then ffn_block's output on h1 with `ffn_norm` (weight,
    eps: the same eps as `norm`'s), gate, up and down. Where the matrices' types differ (llama.cpp's
    mixtures) or have no block kernel of their own, sharkport_layer_block_mixed takes each of
    MIXED_KINDS (gate's and up's the same, MIXED_LAYER_PLANES planes in all at most), in up to
    seven phases. Or None, having written nothing, where neither applies, or where a product's x
    would not fit a workgroup's stack (x_on_stack: its weights would be read once for each part of
    x). Against a dispatch per product it saves their starts and ends, each product's normalizing
    of x, and a workgroup waiting at the end of a phase fetches its first rows of the next. With
    `biases` (of q, k and v: qwen2's) the layer block of mixed types adds them to the products
    (its _bias twin; the three in one buffer, a binding besides the planes)."""
    if float(ffn_norm[1]) != float(norm[1]):
        return None
    return _attention_dispatch(h, norm, (wq, wk, wv, wo), (ffn_norm[0], gate, up, down), cache_state, cache, layer,
                               page_ids, start_positions, seq_lens, heads, head_dim, rope, rope_layout, scale, window,
                               logit_cap, biases)


def _attention_dispatch(h, norm, weights, ffn, cache_state, cache, layer, page_ids, start_positions, seq_lens,
                        heads, head_dim, rope, rope_layout, scale, window, logit_cap, biases=None):
    """attention_block's result, or with `ffn` (the FFN norm's weight, gate, up, down) layer_block's
    (with `biases` of q, k and v, the mixed layer block's)."""
    rows = _block_rows(h, norm)
    if rows is None:
        return None
    M, E = rows.shape
    shape = _attention_shape(M, 1, heads, head_dim, rows.dtype, cache_state, cache, rope, rope_layout, scale, window,
                             logit_cap, block=True)
    kv = cache.kv_heads * head_dim
    matrices, shapes = list(weights), [(heads * head_dim, E), (kv, E), (kv, E), (E, heads * head_dim)]
    if ffn is not None:
        g2, gate, up, down = ffn
        I = gate.shape[0]
        if _block_rows(h, (g2, norm[1])) is None or not isinstance(I, int) or I > MAX_K:
            return None
        matrices, shapes = matrices + [gate, up, down], shapes + [(I, E), (I, E), (E, I)]
    if shape is None or [tuple(w.shape) for w in matrices] != shapes:
        return None
    if not all(x_on_stack(M, w.shape[1]) for w in matrices):
        return None  # a product's x would be prepared again for each part of its rows, the weights read again
    found, kinds = _kernel_planes(matrices), ()
    if biases is not None or not found or found[0] not in BLOCK_KINDS:  # only the mixed layer adds biases
        found = _mixed_planes(matrices, biases is not None) if ffn is not None else None
        if found is None:
            return None
        kinds, found = found[0], ("MIXED", found[1])
    kind, planes = found
    from .ops import BlockShape, block_op

    bias = [] if biases is None else [_bias_operand(biases, M)]
    operands = [rows, norm[0], *planes[0], *planes[1], *planes[2], *bias, cache_state, page_ids, start_positions,
                seq_lens, _layer_operand(layer, cache), *_rope_operands(rope, rows), *planes[3]]
    if ffn is None:
        block = BlockShape("attention", kind, M, E, 0, float(norm[1]), shape)
    else:
        block = BlockShape("layer", kind, M, E, I, float(norm[1]), shape, kinds, biases is not None)
        operands += [g2, *planes[4], *planes[5], *planes[6]]
    y = block_op(block)(*operands)
    return y[:M * E].view(h.shape)


def _mixed_planes(matrices, bias: bool = False):
    """(each matrix's kernel type, its planes in MIXED_SLOTS slots: its own, then its first again)
    of a layer's seven matrices (q, k, v, o, gate, up, down) for the layer block of mixed types, or
    None where one's type is not in MIXED_KINDS, gate's and up's differ, or their planes (and with
    `bias`, the biases' buffer) are more than one dispatch takes (MIXED_LAYER_PLANES)."""
    found = [_kernel_planes([w]) for w in matrices]
    if not all(found) or any(kind not in MIXED_KINDS for kind, _ in found) or found[4][0] != found[5][0]:
        return None
    if sum(len(planes) for _, [planes] in found) + bias > MIXED_LAYER_PLANES:
        return None
    return (tuple(kind for kind, _ in found),
            [[*planes, *[planes[0]] * (MIXED_SLOTS - len(planes))] for _, [planes] in found])


def _bias_operand(biases, rows: int):
    """The biases of q, k and v as the mixed layer block adds them: float32, laid out as its
    products, [rows, Nq] [rows, Nkv] [rows, Nkv] one after the other (a constant of the weights,
    which IREE computes once, as the module loads)."""
    import torch

    return torch.cat([b.to(torch.float32).reshape(1, -1).expand(rows, -1).reshape(-1) for b in biases])


def prefill_attention(q, k, v, scale: float | None = None, window: int = 0, logit_cap: float = 0.0):
    """Causal attention of prefill's q [B, S, H, D] to its own k and v [B, S, Hkv, D] (all rotated)
    by one kernel dispatch → [B, S, H, D], as ops.attention under ops.causal_mask (with a sliding
    `window`, only the last `window` keys). Returns None where the kernel does not apply:
    soft-capping, inputs not in float32, D not a multiple of 8 or above PREFILL_MAX_D, (H / Hkv) * D
    above PREFILL_MAX_GD."""
    import torch

    B, S, H, D = q.shape
    Hkv = k.shape[2]
    if not (q.dtype == k.dtype == v.dtype == torch.float32 and not logit_cap
            and D % 8 == 0 and D <= PREFILL_MAX_D and H // Hkv * D <= PREFILL_MAX_GD):
        return None
    from .ops import PrefillShape, prefill_attention_op

    op = prefill_attention_op(PrefillShape(H, Hkv, D, D ** -0.5 if scale is None else float(scale), int(window)))
    return op(q.reshape(B, S, H * D), k.reshape(B, S, Hkv * D), v.reshape(B, S, Hkv * D)).view(B, S, H, D)
