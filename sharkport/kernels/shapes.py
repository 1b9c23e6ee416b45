"""What each kernel op is specialised for: a product's form (FORMS), a decode attention's, a prefill
attention's and a block's shape. Their constants are baked into the MLIR (kernels.mlir) and into
the names of its functions, so one op and one module function exist per distinct value."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .layout import BLOCK_CHUNK_ROWS, MIXED_KINDS, MIXED_SLOTS, PLANES, attention_splits, workgroups


def float_bits(value: float) -> int:
    """A float32's bits: how the kernels' float constants are written into MLIR and names."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


# ---- products (matvec.c's sharkport_matvec*) ----

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


def product_c_name(kind: str, form: str, scratch: bool = False) -> str:
    """matvec.c's function: sharkport_matvec_<type>, and sharkport_matvec_<form>_<type> for the
    other forms (a form's own "matvec_" dropped: sharkport_matvec_add_<type>); with `scratch`,
    its twin taking the dispatch's scratch for x's quantized rows (<name>_scratch)."""
    name = form.removeprefix("matvec").lstrip("_")
    return "_".join(["sharkport_matvec", *([name] if name else []), kind.lower(), *(["scratch"] if scratch else [])])


def product_stem(kind: str, form: str, eps: float | None, scratch: bool = False) -> str:
    """The name of the util.func calling the kernel (<stem>_dispatch) and of its executable
    (<stem>_executable): the C function's, and a norm's eps, which is baked into both."""
    return f"{product_c_name(kind, form, scratch)}{'' if eps is None else f'_e{float_bits(eps):08x}'}"


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
    window: int = 0  # sliding window: the query sees the last `window` positions (0: all)

    @property
    def scale_bits(self) -> int:
        """The scale as float32 bits (as the C function receives it)."""
        return float_bits(self.scale)

    @property
    def name(self) -> str:
        rope = f"_r{self.rope_dim}{'i' if self.rope_layout == 'interleaved' else 'h'}" if self.rope_dim else ""
        walk = f"_w{self.kv_heads_per_workgroup}" if self.kv_heads_per_workgroup > 1 else ""
        window = f"_sw{self.window}" if self.window else ""
        return (f"sharkport_decode_attention_h{self.heads}_kv{self.kv_heads}_d{self.head_dim}"
                f"_l{self.layers}_s{self.stride}_x{self.scale_bits:08x}{rope}{walk}{window}{self.c_suffix}")

    @property
    def c_suffix(self) -> str:
        """The C functions' suffix for the cache's element type (matvec.c)."""
        return "" if self.cache_dtype == "f32" else f"_{self.cache_dtype}"

    @property
    def operands(self) -> tuple[tuple[str, str, int], ...]:
        """The op's tensor operands as (name, element type, rank). The cache is updated in place
        (a result tied to it); the attention's output is a new [B, H*D]."""
        return (("q", "f32", 2), ("k", "f32", 2), ("v", "f32", 2), ("cache", self.cache_dtype, 2),
                ("pages", "i64", 2), ("starts", "i64", 1), ("lens", "i64", 1), ("layer", "i64", 1),
                ("cos", "f32", 2), ("sin", "f32", 2))

    def constants(self) -> list[tuple[str, str]]:
        """The attention's constant arguments of the C functions (decode attention's and the
        blocks'), in their order, as (MLIR value, type)."""
        sizes = (self.heads, self.kv_heads, self.head_dim, self.layers, self.stride, self.rope_dim,
                 int(self.rope_layout == "interleaved"), self.kv_heads_per_workgroup)
        return [(str(size), "index") for size in sizes] + [(f"0x{self.scale_bits:08X}", "f32"),
                                                            (str(self.window), "index")]


# ---- prefill attention over the prompt's own K and V (matvec.c's sharkport_prefill_attention) ----

PREFILL_ROWS = 12  # query positions per workgroup: matvec.c's PREFILL_ROWS


@dataclass(frozen=True)
class PrefillShape:
    """What a prefill attention op is specialised for (baked into its MLIR as constants)."""
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int = 0  # sliding window: position p sees keys p - window < j <= p (0: all earlier ones)

    @property
    def scale_bits(self) -> int:
        """The scale as float32 bits (as the C function receives it)."""
        return float_bits(self.scale)

    @property
    def name(self) -> str:
        window = f"_sw{self.window}" if self.window else ""
        return (f"sharkport_prefill_attention_h{self.heads}_kv{self.kv_heads}_d{self.head_dim}_x{self.scale_bits:08x}"
                f"{window}")


# ---- a decode layer in one dispatch (matvec.c's sharkport_layer_block_<type>), or two
#      (sharkport_attention_block_<type> and sharkport_ffn_block_<type>) ----

@dataclass(frozen=True)
class BlockShape:
    """What a block op is specialised for (baked into its MLIR as constants): the attention block
    (norm, q/k/v product, decode attention, output product, residual add), the FFN block (norm,
    SwiGLU's products, the down product, residual add) or the layer block (the one, then the other)
    of M rows of h [M, E]."""
    form: str  # "attention", "ffn" or "layer"
    kind: str  # the matrices' kernel type (a key of PLANES), or a layer's "MIXED" (see kinds)
    rows: int  # M
    width: int  # E
    inner: int  # the FFN's gate rows I (0 for attention)
    eps: float  # of the norm (the layer's two norms)
    attention: AttentionShape | None = None
    # a layer of kind "MIXED": each matrix's type, of MIXED_KINDS (q, k, v, the output projection,
    # gate, up, down; gate's and up's the same)
    kinds: tuple[str, ...] = ()
    bias: bool = False  # a mixed layer's q, k and v have biases (qwen2's): its _bias twin

    @property
    def name(self) -> str:
        sizes = "" if self.form == "ffn" else self.attention.name.removeprefix("sharkport_decode_attention")
        sizes += f"_i{self.inner}" if self.inner else ""
        sizes += f"_p{self.splits}" if self.splits > 1 else ""
        types = f"_t{''.join(chr(ord('a') + MIXED_KINDS.index(k)) for k in self.kinds)}" if self.kinds else ""
        types += "_b" if self.bias else ""
        return (f"sharkport_{self.form}_block_{self.kind.lower()}{types}_m{self.rows}_e{self.width}"
                f"_n{float_bits(self.eps):08x}{sizes}_wg{workgroups()}")

    @property
    def c_name(self) -> str:
        bias = "_bias" if self.bias else ""
        return f"sharkport_{self.form}_block_{self.kind.lower()}{bias}{self.attention.c_suffix if self.attention else ''}"

    @property
    def splits(self) -> int:
        """Parts of its pages each attention item is split into (kernels.attention_splits)."""
        if self.attention is None:
            return 1
        a = self.attention
        return attention_splits(self.rows * (a.kv_heads // a.kv_heads_per_workgroup), workgroups())

    @property
    def phases(self) -> int:
        """The dispatch's phases (matvec.c's ATTENTION_PHASES, FFN_PHASES): its counters' size."""
        if self.kinds:  # a mixed layer's q, k and v take up to three (MIXED_ATTENTION_PHASES)
            return 7
        return {"attention": 3, "ffn": 2, "layer": 5}[self.form]

    @property
    def operands(self) -> list[str]:
        """The op's tensor operands in order (planes as <matrix>_<plane>)."""
        def planes(matrix):  # a mixed layer's: MIXED_SLOTS slots, its planes and then repeats
            return [f"{matrix}_{p}" for p in (range(MIXED_SLOTS) if self.kinds else PLANES[self.kind])]
        ffn = [*planes("gate"), *planes("up"), *planes("down")]
        if self.form == "ffn":
            return ["x", "g", *ffn]
        attention = ["x", "g", *planes("q"), *planes("k"), *planes("v"), *(["qkv_bias"] if self.bias else []),
                     "cache", "pages", "starts", "lens", "layer", "cos", "sin", *planes("o")]
        return attention + (["g2", *ffn] if self.form == "layer" else [])

    @property
    def tied(self) -> list[str]:
        """Operands the dispatch updates in place, in the order of their results."""
        return [] if self.form == "ffn" else ["cache"]

    @property
    def widths(self) -> tuple[int, ...]:
        """The dispatch's result, per row of h: the output, then the intermediates (FFN: silu(g) *
        u; attention: q, k, v, then the attention's output; layer: the attention block's output,
        the attention's intermediates, the FFN's); where the attention's items are split, their
        parts (each head's sums, maximum and total) and the other workgroups' merged copies."""
        if self.form == "ffn":
            return self.width, self.inner
        a = self.attention
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        parts = (self.splits * a.heads * (a.head_dim + 2), (workgroups() - 1) * q) if self.splits > 1 else ()
        if self.form == "layer":
            return self.width, self.width, q, kv, kv, q, self.inner, *parts
        return self.width, q, kv, kv, q, *parts

    def constants(self) -> list[tuple[str, str]]:
        """The C function's constant arguments after its memrefs (and the attention's page
        columns), as (MLIR value, type)."""
        def index(v):
            return str(v), "index"
        # outputs a chunk of a product takes, the norm's eps, the workgroups
        last = [index(BLOCK_CHUNK_ROWS), (f"0x{float_bits(self.eps):08X}", "f32"), index(workgroups())]
        if self.form == "ffn":
            return [index(self.rows), index(self.width), index(self.inner), *last]
        types = [index(MIXED_KINDS.index(k)) for k in self.kinds]  # a mixed layer's, after I
        return [index(self.rows), index(self.width), *self.attention.constants(), index(self.splits),
                *([index(self.inner)] if self.form == "layer" else []), *types, *last]
