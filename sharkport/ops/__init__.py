"""Pure tensor functions shared by every recipe. Shapes: B batch, S sequence, T key positions,
H heads, Hkv kv heads, D head dim, V vocab. They trace under torch.export as written."""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..archive.tensors import QuantizedTensor, Weight


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, adding no graph node when it already is (each traced cast costs export time)."""
    return x if x.dtype == dtype else x.to(dtype)


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as plain values (dequantized in the graph when it is quantized)."""
    return cast(w.dequant() if isinstance(w, QuantizedTensor) else w, dtype)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w[out, in].T (+ bias) → [..., out]. The one place that dispatches on weight
    type.

    Leading dims are flattened so the product is a 2-D mm: traced as a 3-D matmul it becomes a
    batch matmul over a broadcast copy of the weight, which IREE runs several times slower
    (docs/performance.md)."""
    y = torch.mm(x.reshape(-1, x.shape[-1]), dense(w, x.dtype).transpose(0, 1))
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + cast(bias, y.dtype)


def silu_gate(x: torch.Tensor, gate: Callable[[torch.Tensor], torch.Tensor],
              up: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """silu(gate(x)) * up(x), `gate` and `up` being x's two products (llama's SwiGLU before its
    down projection). Over a traced dynamic number of rows (prefill), silu and the multiply are a
    dispatch region of their own (regions)."""
    rows = x.reshape(-1, x.shape[-1])
    g, u = gate(rows), up(rows)
    if isinstance(rows.shape[0], torch.SymInt):
        from .regions import silu_mul  # loads turbine: only while tracing

        y = silu_mul(g, u)
    else:
        y = torch.nn.functional.silu(g) * u
    return y.reshape(*x.shape[:-1], y.shape[-1])


def expert(w: Weight, index: int) -> Weight:
    """Slice `index` of a stacked expert weight [X, out, in] (plain or quantized) → [out, in]."""
    if isinstance(w, QuantizedTensor):  # stacked experts are never interleaved (quant.interleaves)
        return QuantizedTensor(w.type_name, tuple(w.shape[1:]), {k: p[index] for k, p in w.planes.items()})
    return w[index]


def embedding(ids: torch.Tensor, w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """ids [...] → [..., D]; a quantized table dequantizes only the rows it gathers."""
    return cast(w.rows(ids) if isinstance(w, QuantizedTensor) else w[ids], dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim, in float32."""
    x32 = cast(x, torch.float32)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return cast(y * cast(w, torch.float32), x.dtype)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim, computed in float32 (GPT-2)."""
    x32 = cast(x, torch.float32)
    y = torch.nn.functional.layer_norm(x32, (x.shape[-1],), cast(w, torch.float32), cast(b, torch.float32), eps)
    return cast(y, x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU (HF `gelu_new` / `gelu_pytorch_tanh`), written out: IREE
    3.9 compiles `F.gelu(approximate="tanh")` with errors up to 5e-5, and this form at 1e-6."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma's soft logit capping; x unchanged when cap is 0."""
    return torch.tanh(x / cap) * cap if cap else x


def rope_angles(positions: torch.Tensor, rope_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, S] int → cos, sin [B, S, rope_dim/2] (float32)."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim
    inv_freq = 1.0 / (base ** exponents)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotates x [B, S, H, D] by angles [B, S, R/2] over its first R dims.

    `interleaved`: rotary pairs are (2i, 2i+1), as in GGUF files (llama.cpp's converter permutes
    Q/K rows into that order). `half`: pairs are (i, i + R/2), as in HF checkpoints."""
    rot_dim = cos.shape[-1] * 2
    xr, rest = x[..., :rot_dim], x[..., rot_dim:]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    if layout == "interleaved":
        # (a, b) -> (a cos - b sin, b cos + a sin) as pairs * cos + (-b, a) * sin: one elementwise
        # op for IREE, where stacking the two halves cost two more dispatches and two copies.
        pairs = xr.unflatten(-1, (-1, 2))
        swapped = pairs.flip(-1) * torch.tensor([-1.0, 1.0], dtype=pairs.dtype, device=pairs.device)
        out = (pairs * cos.unsqueeze(-1) + swapped * sin.unsqueeze(-1)).flatten(-2)
    elif layout == "half":
        a, b = xr.chunk(2, dim=-1)
        out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    else:
        raise ValueError(f"unknown rope layout {layout!r}")
    out = cast(out, x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              scale: float | None = None, logit_cap: float = 0.0) -> torch.Tensor:
    """Grouped-query attention. q [B, S, H, D], k/v [B, T, Hkv, D], mask [B|1, 1, S|1, T] additive
    (0 or -inf) → [B, S, H, D]. Query head h reads kv head h // G (G = H / Hkv), as in llama.
    Scores are q·k * scale (default D^-0.5), soft-capped by `logit_cap` when it is not 0.

    The G query heads of a kv head are folded into the sequence axis ([B, Hkv, G*S, D]), so K and
    V are used as they are, never repeated (less memory traffic than repeat_interleave)."""
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    q = q.view(B, S, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * S, D)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
    if mask.shape[2] != 1 and G > 1:  # a per-query mask repeats for each group folded into rows
        mask = mask.repeat(1, 1, G, 1)
    # One query position (decode): products as broadcast multiply + sum, which IREE fuses into
    # one dispatch each; as matmuls they are data-tiled, packed and unpacked (6 more dispatches).
    one = isinstance(S, int) and S == 1
    qk = (q.unsqueeze(3) * k.unsqueeze(2)).sum(-1) if one else torch.matmul(q, k.transpose(-1, -2))
    scores = softcap(qk * (D ** -0.5 if scale is None else scale), logit_cap) + mask  # [B, Hkv, G*S, T]
    probs = cast(torch.softmax(cast(scores, torch.float32), dim=-1), q.dtype)
    out = (probs.unsqueeze(-1) * v.unsqueeze(2)).sum(-2) if one else torch.matmul(probs, v)  # [B, Hkv, G*S, D]
    return out.unflatten(2, (G, S)).permute(0, 3, 1, 2, 4).reshape(B, S, H, D)


def causal_mask(seq_len: int, dtype: torch.dtype, device=None, window: int = 0) -> torch.Tensor:
    """[1, 1, S, S] additive mask: position i sees keys 0..i, or with a sliding `window` only the
    last `window` of them (keys j with i - j < window, as transformers and llama.cpp count)."""
    full = torch.full((seq_len, seq_len), float("-inf"), dtype=dtype, device=device)
    mask = torch.triu(full, diagonal=1)
    if window:
        mask = mask + torch.tril(full, diagonal=-window)
    return mask[None, None]


def length_mask(seq_lens: torch.Tensor, key_len: int, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
    """seq_lens [B] → [B, 1, 1, T] additive mask hiding keys at positions ≥ seq_len, and with a
    sliding `window` also those at positions ≤ seq_len - 1 - window (the query is at seq_len - 1)."""
    positions = torch.arange(key_len, device=seq_lens.device)
    hidden = positions[None, :] >= seq_lens[:, None]
    if window:
        hidden = hidden | (positions[None, :] <= seq_lens[:, None] - 1 - window)
    zeros = torch.zeros(hidden.shape, dtype=dtype, device=seq_lens.device)
    return zeros.masked_fill(hidden, float("-inf"))[:, None, None, :]
