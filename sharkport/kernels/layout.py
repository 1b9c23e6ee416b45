"""What the kernels take and how they share out work: the limits matvec.c is built for, the
planes each weight type passes, the row interleaving of quantized weights, and the workgroups a
dispatch is split into (one for each CPU the exporting process may run on)."""

from __future__ import annotations

import os
from fractions import Fraction

from ..quant import ROW_INTERLEAVED_TYPES

MAX_ROWS = 8  # decode's rows: up to these, norms are one dispatch region and a layer one block kernel
MAX_K = 32 * 512  # longest rows of w: a workgroup keeps x quantized (MAX_K bytes a row) on its stack
# Where x's quantized rows outgrow a workgroup's stack (more than MAX_ROWS rows, or MAX_K bytes:
# prefill), a product quantizes x into a scratch buffer of its dispatch instead, up to PASS_BYTES
# of rows (a multiple of 8, at least 8) for each pass over the weights, so that they stay in a
# core's L2 while the weights stream past once (matvec.c's product_all_rows).
PASS_BYTES = 512 << 10
# products that RMS-normalize x first (matvec.c's XN_FLOATS): each workgroup keeps x normalized on
# its stack, of at most MAX_NORMED values (32 KiB): a row at a time as it quantizes it (float16
# weights: the rows it multiplies at a time), so rows of K <= MAX_NORMED at any M; a block kernel
# keeps all of decode's x [M, K], M * K <= MAX_NORMED. Longer x is normalized by a dispatch of its own.
MAX_NORMED = 8192
# decode attention: query heads per kv head times head_dim, and positions per page, it takes
MAX_GD, MAX_STRIDE = 2048, 256
# outputs a chunk of a block's product takes (the block kernels' `chunk` argument): a multiple
# of the interleaved rows' 8
BLOCK_CHUNK_ROWS = 32
# prefill attention: the longest head, and query heads per kv head times head_dim, it takes
PREFILL_MAX_D, PREFILL_MAX_GD = 256, 1024  # matvec.c's PA_MAX_D, PA_MAX_GD
# Outputs per workgroup for a product with N outputs: min(4096, 32 * ceil(N / (32 * W))), a
# multiple of 32 aiming at W = workgroups(), one for each CPU: fewer, larger workgroups quantize
# (and normalize) x fewer times, as each does all of it (SmolLM2 on 2 CPUs: 96 rows for 192
# outputs, 4096 for the 49152 of the output projection, 12 workgroups).
ROW_QUANTUM, WORKGROUPS_PER_CPU, MAX_ROWS_PER_WORKGROUP = 32, 1, 4096
# plane order of each kernel's arguments after x (sharkport.quant's plane names). The X8 kinds
# (Q8_0X8, Q4_0X8, ...: INTERLEAVED) are those of ROW_INTERLEAVED_TYPES with their rows interleaved
# eight at a time, as matvec.c's q8_x8, q4_x8 and q4k_x8 read them and archives hold them
# (sharkport.quant.interleave_planes).
PLANES = {"Q8_0": ("qs", "d"), "Q4_0": ("qs", "d"), "Q4_1": ("qs", "d", "m"), "F16": ("w",), "BF16": ("w",),
          "Q5_0": ("qs", "d", "qh"), "Q5_1": ("qs", "d", "m", "qh"), "Q4_K": ("qs", "d", "dmin", "scales"),
          "Q5_K": ("qs", "d", "dmin", "scales", "qh"), "Q6_K": ("ql", "d", "qh", "scales"),
          "Q3_K": ("qs", "d", "hmask", "scales"), "Q2_K": ("qs", "d", "dmin", "scales"),
          "IQ4_NL": ("qs", "d"), "IQ4_XS": ("qs", "d", "scales_h", "scales_l")}
FLOAT_KINDS = ("F16", "BF16")  # float weights: read as they are, x not quantized
# a weight type -> its kernel's with interleaved rows
INTERLEAVED = {kind: f"{kind}X8" for kind in ROW_INTERLEAVED_TYPES}
PLANES.update({x8: PLANES[kind] for kind, x8 in INTERLEAVED.items()})
STORED = {x8: kind for kind, x8 in INTERLEAVED.items()}  # and back
# kernel types matvec.c's block kernels (a whole decode layer in one dispatch) are built for
BLOCK_KINDS = ("Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "Q8_0X8", "Q4_0X8", "Q4_1X8")
# kernel types a layer block of mixed types takes (matvec.c's sharkport_layer_block_mixed; its
# MIXED_KINDS lists them in this order, and the C function takes each matrix's type as its index
# here), and the plane slots each of its matrices has (the most planes of a type: Q5_K's, Q5_1's)
MIXED_KINDS = ("Q8_0X8", "Q4_0X8", "Q4_1X8", "Q5_0X8", "Q5_1X8", "Q4_KX8", "Q5_KX8", "Q6_KX8", "Q2_KX8", "Q3_KX8",
               "IQ4_NLX8", "IQ4_XSX8", "F16", "BF16")
MIXED_SLOTS = 5
# A dispatch takes at most 32 buffers in IREE 3.9 (a command buffer's bindings; one buffer bound
# twice counts once). Compiled without the discrete memory model (sharkport.compile's CPU presets
# have it), each weight plane of a decode block is a buffer of its own (the block's function takes
# them as arguments), and the layer block's other operands are 7 more (the norms' weights, the
# layer's constant, the cache, the counters, and one transient buffer holding x, y, the page ids,
# positions, lengths and rotary), so a mixed layer of up to these planes is one dispatch (one
# buffer to spare); of more (Q4_K_M's K-quant layers: 28 or 29), a dispatch a product.
MIXED_LAYER_PLANES = 24
# elements of each buffer the C function receives (x, the planes, y), as products of M, N and K
# over a divisor (times a factor): x is M*K floats, Q8_0's qs N*K bytes, a block scale plane
# N*K/32, Q4_K's scales 12 bytes per 256 values (N*K*3/64), ...
SIZES = {"Q8_0": ("mk", ("nk", 1), ("nk", 32), "mn"), "Q4_0": ("mk", ("nk", 2), ("nk", 32), "mn"),
         "Q4_1": ("mk", ("nk", 2), ("nk", 32), ("nk", 32), "mn"), "F16": ("mk", ("nk", 1), "mn"),
         "Q5_0": ("mk", ("nk", 2), ("nk", 32), ("nk", 8), "mn"),
         "Q5_1": ("mk", ("nk", 2), ("nk", 32), ("nk", 32), ("nk", 8), "mn"),
         "Q4_K": ("mk", ("nk", 2), ("nk", 256), ("nk", 256), ("nk", 64, 3), "mn"),
         "Q5_K": ("mk", ("nk", 2), ("nk", 256), ("nk", 256), ("nk", 64, 3), ("nk", 8), "mn"),
         "Q6_K": ("mk", ("nk", 2), ("nk", 256), ("nk", 4), ("nk", 16), "mn"),
         "Q3_K": ("mk", ("nk", 4), ("nk", 256), ("nk", 8), ("nk", 64, 3), "mn"),
         "Q2_K": ("mk", ("nk", 4), ("nk", 256), ("nk", 256), ("nk", 16), "mn"),
         "IQ4_NL": ("mk", ("nk", 2), ("nk", 32), "mn"),
         "IQ4_XS": ("mk", ("nk", 2), ("nk", 256), ("nk", 256), ("nk", 64), "mn")}
SIZES["BF16"] = SIZES["F16"]
SIZES.update({x8: SIZES[kind] for kind, x8 in INTERLEAVED.items()})


# weight types whose products take x quantized per 256 values (llama.cpp's Q8_K), not per 32 (Q8_0)
X_PER_256 = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q2_KX8", "Q3_KX8", "Q4_KX8", "Q5_KX8", "Q6_KX8")


def quantized_x(x, kind: str = "Q8_0"):
    """x [..., K] as the kernels multiply it by weights of `kind` and dequantized to float32. For
    the K-quants (X_PER_256) as llama.cpp's Q8_K reference quantizer does: per 256 values, the
    first of the largest magnitude m, values round(-127 / m * x) (half to even, at most 127),
    scale 1 / (-127 / m), all in float32. Else each block of 32 values as gguf's Q8_0 reference
    quantizer does (scale max|x| / 127, values rounded half away from zero, the scale stored as
    float16)."""
    if kind in X_PER_256:
        blocks = x.reshape(*x.shape[:-1], -1, 256).double()
        m = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        iscale = (-127 / m).float().double()  # each step rounded to float32, as the C code computes
        q = (iscale * blocks).float().round().clamp(max=127)
        scale = (1 / iscale).float()
        return (q * scale).masked_fill(m == 0, 0).reshape(x.shape)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    v = blocks * (1 / scale).masked_fill(scale == 0, 0)
    a = v.abs()
    whole = a.floor()
    q = (whole + (2 * (a - whole)).floor()).copysign(v)
    return (q * scale.half().float()).reshape(x.shape)


def kv_heads_per_workgroup(batch: int, kv_heads: int, gd: int) -> int:
    """How many of a sequence's kv heads each decode attention workgroup takes (`gd`: query heads
    per kv head times head_dim): the most, a divisor of kv_heads, that still leaves a workgroup
    for each CPU this process may run on (as many as the runner's IREE workers). A workgroup with
    all of them reads each page's K and V whole, in address order, and prefetches the next page
    whole, where one (sequence, kv head) a workgroup reads a third of each row (SmolLM2: 3 kv
    heads) and its neighbours the rest, fetching lines the others also fetch
    (tools/attention_harness.c times the two). With fewer sequences than CPUs, more workgroups
    share each sequence (batch 1: one per kv head). A block's attention, split by pages, takes
    block_kv_heads_per_workgroup instead."""
    return max([w for w in _kv_head_groups(kv_heads, gd) if batch * (kv_heads // w) >= cpus()], default=1)


def _kv_head_groups(kv_heads: int, gd: int) -> list[int]:
    """The kv heads a workgroup may take: the divisors of kv_heads whose query heads fit MAX_GD."""
    return [w for w in range(1, kv_heads + 1) if kv_heads % w == 0 and w * gd <= MAX_GD]


# parts of its positions a block's decode attention item is split into at most (matvec.c's MAX_SPLITS)
MAX_ATTENTION_SPLITS = 4


def attention_splits(items: int, workgroups: int) -> int:
    """How many parts of its pages each of a block's `items` decode attention items (sequences
    times kv-head groups) is split into: the fewest, up to MAX_ATTENTION_SPLITS, that share the
    items' work most evenly among the workgroups, each workgroup then merging the parts (batch 1 on
    2 CPUs: one item becomes 2)."""
    return min(range(1, MAX_ATTENTION_SPLITS + 1), key=lambda s: (_busiest(items, s, workgroups), s))


def _busiest(items: int, splits: int, workgroups: int) -> Fraction:
    """The share of the attention's work the busiest of `workgroups` takes when each of `items`
    equal items is split into `splits` parts."""
    return Fraction(-(-items * splits // workgroups), items * splits)


def block_kv_heads_per_workgroup(batch: int, kv_heads: int, gd: int) -> int:
    """kv_heads_per_workgroup for a block's attention, whose items are split by pages among the
    workgroups (attention_splits): the most kv heads an item that share the work as evenly as any
    fewer do, so that a part reads its pages whole (SmolLM2 at batch 1 on 2 CPUs: one item of all 3
    kv heads in two parts, rather than 3 items in six parts each reading a third of every row)."""
    def busiest(w: int) -> Fraction:
        items = batch * (kv_heads // w)
        return _busiest(items, attention_splits(items, workgroups()), workgroups())

    return min(_kv_head_groups(kv_heads, gd), key=lambda w: (busiest(w), -w))


def block_counters(phases: int) -> int:
    """int32 phase counters of a block dispatch of `phases` phases (matvec.c's BLOCK_COUNTERS(P,
    W), each on a line of 16): for each phase a line for each workgroup's span and one of the items
    finished, and one line of the workgroups that left."""
    return (phases * (workgroups() + 1) + 1) * 16


def x_on_stack(rows, k: int) -> bool:
    """Whether a product's workgroups keep x [rows, k] quantized on their stacks (else its
    dispatch's scratch): rows is an int at most MAX_ROWS (a dynamic row count is not) and
    rows * k at most MAX_K bytes."""
    return isinstance(rows, int) and rows <= MAX_ROWS and rows * k <= MAX_K


def workgroups() -> int:
    """How many workgroups a product's outputs aim at (see ROW_QUANTUM)."""
    return WORKGROUPS_PER_CPU * cpus()


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
