"""Export with the hand-written CPU kernels (sharkport.kernels): `use_kernels(model)` swaps a
built model's blocks, attention, feed-forwards, products and norms for modules that call a kernel
where one applies and compute as the plain module elsewhere.

Which layers can take a kernel is decided here: a llama block whose attention has no Q/K norms,
no fused projection and no output bias is one dispatch in decode (`kernels.layer_block`; with q,
k and v biases, as qwen2's, its mixed-type block), or two (`attention_block`, `ffn_block`);
elsewhere a norm goes inside the products after it and a residual add inside the product before
it (`matvec_norm`, `qkv_norm`, `swiglu_norm`, `matvec_add`; a Gemma-3 block's pre-norms so, and
each of its post-norms with the residual add after it in one region), and decode's remaining
norms are one dispatch region each (ops.regions). What the kernels take of the tensors
themselves (float32, the weight types and sizes matvec.c handles, decode's few static rows for
the blocks and fused norms) is checked where they are called: each sharkport.kernels function
returns None where it does not apply, and the module computes as the plain one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..layers import Linear, PagedAttention, RMSNorm, SwiGLU
from ..models.gemma3 import Gemma3Block
from ..models.llama import LlamaBlock
from ..ops import cast, causal_mask, linear, rms_norm


def use_kernels(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every layer the kernels can take swapped (in place, children first) for its
    kernel module; returns the module, or its own replacement."""
    for name, child in list(module.named_children()):
        setattr(module, name, use_kernels(child))
    for plain, kernel in _SWAPS:
        if isinstance(module, plain):
            return kernel(module)
    if (isinstance(module, torch.nn.Sequential) and len(module) == 2 and isinstance(module[0], KernelRMSNorm)
            and isinstance(module[1], KernelLinear)):
        return KernelHead(module)
    return module


def fused_product(product, x: torch.Tensor, norm: "KernelRMSNorm | None"):
    """(product(rows, norm), x): a kernel's product of x's rows [M, K] (None where none applies),
    with `norm` (weight, eps) inside it where the kernel takes it, else with norm(x) computed
    first and returned as x."""
    if norm is not None:
        y = product(x.reshape(-1, x.shape[-1]), (norm.weight, norm.eps))
        if y is not None:
            return y, x
        x = norm(x)
    return product(x.reshape(-1, x.shape[-1]), None), x


class KernelRMSNorm(torch.nn.Module):
    """RMSNorm; over decode's rows one dispatch region (ops.regions), not IREE's reduction and
    its consumer."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def _region_rows(self, *xs: torch.Tensor):
        """xs as rows [M, E] where a region takes them (decode's float32 rows), else None."""
        rows = [x.reshape(-1, x.shape[-1]) for x in xs]
        if all(kernels.decode_rows(r) for r in rows) and self.weight.dtype == torch.float32:
            return rows
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._region_rows(x)
        if rows is not None:
            from ..ops.regions import rms_norm as region

            return region(*rows, self.weight, self.eps).view(x.shape)
        return rms_norm(x, self.weight, self.eps)

    def add_to(self, r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """r + this norm of x: a post-norm with its residual add, over decode's rows one dispatch
        region (ops.regions.add_rms_norm)."""
        rows = self._region_rows(r, x)
        if rows is not None:
            from ..ops.regions import add_rms_norm

            return add_rms_norm(*rows, self.weight, self.eps).view(x.shape)
        return r + rms_norm(x, self.weight, self.eps)


class KernelLinear(torch.nn.Module):
    """x @ w.T (+ bias), reading quantized and float16 weights as stored (kernels.matvec); with
    `norm`, of norm(x) normalized inside the product (decode), and with `residual` (and no bias)
    plus the residual added inside it."""

    def __init__(self, plain: Linear):
        super().__init__()
        self.plain = plain

    @property
    def weight(self):
        return self.plain.weight  # read when used: an expert's is a slice made in the trace

    @property
    def bias(self):
        return self.plain.bias

    def forward(self, x: torch.Tensor, norm: KernelRMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        w, bias = self.weight, self.bias
        added = residual if bias is None else None  # by the kernel
        y, x = fused_product(lambda rows, n: kernels.matvec(
            rows, w, n, None if added is None else added.reshape(rows.shape[0], -1)), x, norm)
        if y is None:
            y = linear(x, w, bias)
            return y if residual is None else residual + y
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        y = y if bias is None else y + cast(bias, y.dtype)
        return y if residual is None or added is not None else residual + y


class KernelHead(torch.nn.Module):
    """A final norm and the output product (a recipe's `Sequential(RMSNorm, Linear)`), the norm
    inside the product."""

    def __init__(self, head: torch.nn.Sequential):
        super().__init__()
        self.norm, self.output = head[0], head[1]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(h, norm=self.norm)


class KernelAttention(torch.nn.Module):
    """PagedAttention with q, k and v of one x in one dispatch (kernels.matvec_qkv), and decode
    and prefill attention by kernels (kernels.decode_attention: rotary, the cache write and the
    attention; kernels.prefill_attention). `norm` and `residual` are the block's norm before it
    and residual add after it, taken inside the products."""

    def __init__(self, plain: PagedAttention):
        super().__init__()
        self.plain = plain

    def fusable(self) -> bool:
        """Whether a block kernel can take the whole attention: separate q, k, v products, no Q/K
        norms and no output bias, which matvec.c's blocks do not compute (q, k and v biases the
        layer block of mixed types adds)."""
        a = self.plain
        return a.qkv is None and a.q_norm is None and a.output.bias is None

    def biases(self):
        """q's, k's and v's biases (qwen2's), or None where they have none."""
        a = self.plain
        found = [p.bias for p in (a.q, a.k, a.v)]
        return None if all(b is None for b in found) else found

    def project(self, x: torch.Tensor, norm: KernelRMSNorm | None = None):
        """q, k and v of x, normalized by `norm` inside the products where they take it: in one
        dispatch where they share a kernel type and have no biases (kernels.matvec_qkv), else a
        product each, each normalizing x itself (llama.cpp's mixtures put a Q6_K attn_v beside
        Q4_K q and k; a norm of its own would be IREE's reduction over prefill's rows)."""
        a = self.plain
        if a.qkv is not None or not all(isinstance(p, KernelLinear) for p in (a.q, a.k, a.v)):
            return a.project(x if norm is None else norm(x))
        if all(p.bias is None for p in (a.q, a.k, a.v)):
            ys = kernels.matvec_qkv(x.reshape(-1, x.shape[-1]), a.q.weight, a.k.weight, a.v.weight,
                                    None if norm is None else (norm.weight, norm.eps))
            if ys is not None:
                return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)
        return a.q(x, norm=norm), a.k(x, norm=norm), a.v(x, norm=norm)

    def block(self, h, norm: KernelRMSNorm, rope, cache_state, seq_block_ids, start_positions, seq_lens, ffn=None):
        """h + attention(norm(h)) by kernels.attention_block, or with `ffn` ((the FFN norm's weight,
        eps), gate, up, down) the whole layer by kernels.layer_block; None where neither applies,
        having computed nothing."""
        biases = self.biases()
        if not self.fusable() or (biases is not None and (ffn is None or None in biases)):
            return None
        a, c = self.plain, self.plain.config
        weights = (a.q.weight, a.k.weight, a.v.weight, a.output.weight)
        operands = (cache_state, a.cache, a.layer, seq_block_ids, start_positions, seq_lens, c.heads, c.head_dim,
                    rope, c.rope_layout, c.scale, c.window, c.logit_cap)
        if ffn is not None:
            return kernels.layer_block(h, (norm.weight, norm.eps), *weights, *ffn, *operands, biases=biases)
        return kernels.attention_block(h, (norm.weight, norm.eps), *weights, *operands)

    def prefill(self, x, rope, cache_state, seq_block_ids, norm: KernelRMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        a, c = self.plain, self.plain.config
        q, k, v = a.prefill_heads(*a.heads(x.shape, *self.project(x, norm)), rope, cache_state, seq_block_ids)
        o = kernels.prefill_attention(q, k, v, c.scale, c.window, c.logit_cap)
        if o is None:
            o = a.attend(q, k, v, causal_mask(x.shape[1], q.dtype, q.device, c.window))
        return a.output(o.flatten(2), residual=residual)

    def decode(self, x, rope, cache_state, seq_block_ids, start_positions, seq_lens,
               norm: KernelRMSNorm | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        a, c = self.plain, self.plain.config
        if norm is not None and residual is x:
            y = self.block(x, norm, rope, cache_state, seq_block_ids, start_positions, seq_lens)
            if y is not None:
                return y
        q, k, v = a.heads(x.shape, *self.project(x, norm))
        o = kernels.decode_attention(q, k, v, cache_state, a.cache, a.layer, seq_block_ids, start_positions,
                                     seq_lens, rope, c.rope_layout, c.scale, c.window, c.logit_cap)
        if o is None:
            o = a.decode_attend(q, k, v, rope, cache_state, seq_block_ids, start_positions, seq_lens)
        return a.output(o.flatten(2), residual=residual)


class KernelFFN(torch.nn.Module):
    """SwiGLU's gate and up products in one dispatch (kernels.swiglu); with `norm` and `residual`
    (the block's norm before it and residual add after it) the whole of it in one
    (kernels.ffn_block). GeGLU's gate and up are a product each, both normalizing x inside."""

    def __init__(self, plain: SwiGLU):
        super().__init__()
        self.plain = plain

    @property
    def silu(self) -> bool:
        return self.plain.activation is F.silu

    def forward(self, x: torch.Tensor, norm: KernelRMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        f = self.plain
        if not self.silu:
            g, normed = fused_product(lambda rows, n: kernels.matvec(rows, f.gate.weight, n), x, norm)
            g = f.gate(normed) if g is None else g.reshape(*x.shape[:-1], g.shape[-1])
            u = f.up(normed, norm=norm if normed is x else None)  # x normalized inside gate's product too
            return f.down(f.activation(g) * u, residual=residual)
        if norm is not None and residual is x:
            y = kernels.ffn_block(x, (norm.weight, norm.eps), f.gate.weight, f.up.weight, f.down.weight)
            if y is not None:
                return y
        g, x = fused_product(lambda rows, n: kernels.swiglu(rows, f.gate.weight, f.up.weight, n), x, norm)
        g = f.gated(x) if g is None else g.reshape(*x.shape[:-1], g.shape[-1])
        return f.down(g, residual=residual)


class KernelLlamaBlock(torch.nn.Module):
    """A llama block whose norms and residual adds go inside the kernels around them: in decode
    the whole layer in one dispatch where it can (kernels.layer_block)."""

    def __init__(self, plain: LlamaBlock):
        super().__init__()
        self.plain = plain

    def prefill(self, h, cos, sin, seq_block_ids, cache_state):
        b = self.plain
        h = b.attention.prefill(h, (cos, sin), cache_state, seq_block_ids, norm=b.attn_norm, residual=h)
        return self._ffn(h)

    def decode(self, h, cos, sin, seq_block_ids, start_positions, seq_lens, cache_state):
        b = self.plain
        if isinstance(b.ffn, KernelFFN) and b.ffn.silu:
            f = b.ffn.plain
            y = b.attention.block(h, b.attn_norm, (cos, sin), cache_state, seq_block_ids, start_positions, seq_lens,
                                  ffn=((b.ffn_norm.weight, b.ffn_norm.eps), f.gate.weight, f.up.weight, f.down.weight))
            if y is not None:
                return y
        h = b.attention.decode(h, (cos, sin), cache_state, seq_block_ids, start_positions, seq_lens,
                               norm=b.attn_norm, residual=h)
        return self._ffn(h)

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        b = self.plain
        if isinstance(b.ffn, KernelFFN):
            return b.ffn(h, norm=b.ffn_norm, residual=h)
        return h + b.ffn(b.ffn_norm(h))  # a mixture of experts: its products take the kernels one by one


class KernelGemma3Block(torch.nn.Module):
    """Gemma-3's block with its pre-norms inside the products after them, and each post-norm with
    its residual add in one dispatch region in decode (KernelRMSNorm.add_to)."""

    def __init__(self, plain: Gemma3Block):
        super().__init__()
        self.plain = plain

    def prefill(self, h, cos_l, sin_l, cos_g, sin_g, seq_block_ids, cache_state):
        b = self.plain
        a = b.attention.prefill(h, b._rope(cos_l, sin_l, cos_g, sin_g), cache_state, seq_block_ids, norm=b.attn_norm)
        return self._after_attention(h, a)

    def decode(self, h, cos_l, sin_l, cos_g, sin_g, seq_block_ids, start_positions, seq_lens, cache_state):
        b = self.plain
        a = b.attention.decode(h, b._rope(cos_l, sin_l, cos_g, sin_g), cache_state, seq_block_ids, start_positions,
                               seq_lens, norm=b.attn_norm)
        return self._after_attention(h, a)

    def _after_attention(self, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        b = self.plain
        h = b.post_attention_norm.add_to(h, a)
        return b.post_ffw_norm.add_to(h, b.ffn(h, norm=b.ffn_norm))


# plain module type -> its kernel module, for use_kernels (children are swapped first)
_SWAPS = ((LlamaBlock, KernelLlamaBlock), (Gemma3Block, KernelGemma3Block), (PagedAttention, KernelAttention),
          (SwiGLU, KernelFFN), (Linear, KernelLinear), (RMSNorm, KernelRMSNorm))
