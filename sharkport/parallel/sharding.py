"""How a llama's weights are cut across N tensor-parallel ranks (Megatron-style), as pure functions.

Each tensor gets one rule, keyed by its GGUF name without the `blk.{i}.` prefix:

* `rows`: split along dim 0, the output features. Q/K/V by whole heads (rank r gets query heads
  [r*H/N, (r+1)*H/N) and kv heads [r*Hkv/N, ...), so grouped-query attention stays rank-local),
  gate/up by FFN columns, and the embedding and output head by vocabulary rows.
* `cols`: split along the last dim, the input features: `attn_output` and `ffn_down`, whose
  per-rank products are partial sums that the model all-reduces.
* `replicated`: a copy per rank (the RMSNorm scales).
* `first`: rank 0 only: `attn_output.bias`, added once to the all-reduced sum.

Quantized tensors are split by whole ggml blocks: rows always (a row is whole blocks), columns
only when every rank's first column starts a block, else a SharkportError names the tensor.
"""

from __future__ import annotations

from ..archive.tensors import QuantizedTensor, Weight
from ..errors import SharkportError
from ..quant import BLOCK_TYPES

RULES: dict[str, str] = {
    "token_embd.weight": "rows",
    "output.weight": "rows",
    "output_norm.weight": "replicated",
    "attn_norm.weight": "replicated",
    "ffn_norm.weight": "replicated",
    "attn_q.weight": "rows", "attn_k.weight": "rows", "attn_v.weight": "rows",
    "attn_q.bias": "rows", "attn_k.bias": "rows", "attn_v.bias": "rows",
    "attn_output.weight": "cols",
    "attn_output.bias": "first",
    "ffn_gate.weight": "rows", "ffn_up.weight": "rows",
    "ffn_down.weight": "cols",
}
ARCHITECTURES = ("llama", "qwen2")  # the recipe (models/llama.py) that ShardedLlama mirrors


def rule(name: str) -> str | None:
    """The split rule of a GGUF tensor name, or None for tensors the llama recipe never reads
    (such as `rope_freqs.weight`), which are not sharded at all."""
    if name.startswith("blk."):
        name = name.split(".", 2)[2]
    return RULES.get(name)


def shard_name(name: str, rank: int) -> str:
    """The archive/parameter name of rank `rank`'s piece: `blk.0.attn_q.weight.shard.1`. Names
    differ across ranks, so every rank file loads into the one parameter scope `model`."""
    return f"{name}.shard.{rank}"


def bounds(size: int, n: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of n nearly equal pieces of `size` (sizes differ by at most one)."""
    return [(size * r // n, size * (r + 1) // n) for r in range(n)]


def check_shardable(hp, n: int, where: str) -> None:
    """SharkportError unless a llama with hyperparameters `hp` (LlamaHParams) splits over n ranks:
    heads and kv heads must divide by n, and mixtures of experts are not sharded (yet)."""
    if n < 1:
        raise SharkportError(f"--tensor-parallelism-size must be at least 1, got {n}")
    if hp.arch not in ARCHITECTURES:
        raise SharkportError(f"{where}: tensor parallelism supports the llama recipe "
                             f"({', '.join(ARCHITECTURES)}), not {hp.arch!r}; export it unsharded")
    if hp.expert_count:
        raise SharkportError(f"{where}: a mixture of experts ({hp.expert_count} experts) cannot be "
                             "sharded yet; export it with --tensor-parallelism-size 1")
    for key, count in (("head_count", hp.head_count), ("head_count_kv", hp.head_count_kv)):
        if count % n:
            raise SharkportError(
                f"{where}: {hp.arch}.attention.{key} ({count}) does not divide by "
                f"--tensor-parallelism-size {n}; choose a size that divides {count}")


def split_weight(name: str, w: Weight, how: str, n: int) -> list[Weight | None]:
    """Rank r's piece of weight `w` (2-D [out, in] or 1-D) under rule `how`; None where a rank
    holds nothing (`first`). Pieces are views where slicing allows; callers copy them if needed."""
    if how == "replicated":
        return [w] * n
    if how == "first":
        return [w] + [None] * (n - 1)
    if how == "rows":
        return [_narrow(w, 0, lo, hi) for lo, hi in bounds(w.shape[0], n)]
    if how == "cols":
        if len(w.shape) != 2:
            raise SharkportError(f"tensor {name}: expected a 2-D matrix to split by columns, got shape "
                                 f"{list(w.shape)}")
        return [_narrow(w, 1, lo, hi, name) for lo, hi in bounds(w.shape[1], n)]
    raise ValueError(f"unknown split rule {how!r}")


def _narrow(w: Weight, dim: int, lo: int, hi: int, name: str = "") -> Weight:
    if not isinstance(w, QuantizedTensor):
        return w.narrow(dim, lo, hi - lo)
    w = w.row_order()
    shape = list(w.shape)
    shape[dim] = hi - lo
    if dim == 0:  # whole rows: every plane's dim 0 is the row
        return QuantizedTensor(w.type_name, tuple(shape), {k: p[lo:hi] for k, p in w.planes.items()})
    block = BLOCK_TYPES[w.type_name].block_size
    if lo % block or hi % block:
        raise SharkportError(
            f"tensor {name} ({w.type_name}, {block}-value blocks) cannot be split by columns at "
            f"{lo}..{hi}: a rank's columns must be whole blocks; use a smaller "
            "--tensor-parallelism-size or requantize this tensor (e.g. to f16 or q8_0)")
    # Planes are [out, blocks(, bytes)]: columns lo..hi are blocks lo/block..hi/block.
    return QuantizedTensor(w.type_name, tuple(shape),
                           {k: p[:, lo // block:hi // block] for k, p in w.planes.items()})
