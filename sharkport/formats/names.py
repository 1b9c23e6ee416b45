"""Tensor names: Hugging Face ↔ GGUF (llama.cpp) for the llama family, and the Q/K rotary permutation.

The archive stores weights under GGUF names (DESIGN.md §2), so an HF checkpoint is renamed on
import with `hf_to_gguf_name`, and tests go back with `gguf_to_hf_name`. Both directions come
from one table of `{bid}` templates, where `{bid}` stands for the block (layer) index.

HF llama checkpoints rotate (i, i + D/2) pairs of each head ("half" layout); llama.cpp's
converter permutes the rows of Q and K so the pairs become adjacent, (2i, 2i + 1)
("interleaved"). `permute_qk` applies that permutation and `unpermute_qk` undoes it.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from ..errors import SharkportError

__all__ = ["LLAMA_NAMES", "gguf_to_hf_name", "hf_to_gguf_name", "permute_qk", "unpermute_qk"]

# HF template → GGUF template. One row per tensor; `{bid}` is the block index.
LLAMA_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{bid}.input_layernorm.weight": "blk.{bid}.attn_norm.weight",
    "model.layers.{bid}.self_attn.q_proj.weight": "blk.{bid}.attn_q.weight",
    "model.layers.{bid}.self_attn.k_proj.weight": "blk.{bid}.attn_k.weight",
    "model.layers.{bid}.self_attn.v_proj.weight": "blk.{bid}.attn_v.weight",
    "model.layers.{bid}.self_attn.o_proj.weight": "blk.{bid}.attn_output.weight",
    "model.layers.{bid}.self_attn.q_proj.bias": "blk.{bid}.attn_q.bias",
    "model.layers.{bid}.self_attn.k_proj.bias": "blk.{bid}.attn_k.bias",
    "model.layers.{bid}.self_attn.v_proj.bias": "blk.{bid}.attn_v.bias",
    "model.layers.{bid}.self_attn.o_proj.bias": "blk.{bid}.attn_output.bias",
    "model.layers.{bid}.post_attention_layernorm.weight": "blk.{bid}.ffn_norm.weight",
    "model.layers.{bid}.mlp.gate_proj.weight": "blk.{bid}.ffn_gate.weight",
    "model.layers.{bid}.mlp.up_proj.weight": "blk.{bid}.ffn_up.weight",
    "model.layers.{bid}.mlp.down_proj.weight": "blk.{bid}.ffn_down.weight",
}


def _matcher(template: str) -> re.Pattern[str]:
    """A template as an anchored regex whose one group (if any) captures the block index."""
    return re.compile("^" + re.escape(template).replace(re.escape("{bid}"), r"(\d+)") + "$")


# (pattern of the source name, target template), one list per direction.
_HF_TO_GGUF = [(_matcher(hf), gg) for hf, gg in LLAMA_NAMES.items()]
_GGUF_TO_HF = [(_matcher(gg), hf) for hf, gg in LLAMA_NAMES.items()]


def _rename(name: str, rules: list[tuple[re.Pattern[str], str]], kind: str) -> str:
    for pattern, target in rules:
        m = pattern.match(name)
        if m:
            return target.format(bid=int(m.group(1))) if m.groups() else target
    raise SharkportError(
        f"tensor {name!r} is not a known {kind} llama tensor name; the checkpoint is not a llama "
        f"model or uses an unsupported variant (known names: sharkport.formats.names.LLAMA_NAMES)"
    )


def hf_to_gguf_name(name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` → `blk.3.attn_q.weight`.

    Raises SharkportError naming the tensor when it has no GGUF counterpart."""
    return _rename(name, _HF_TO_GGUF, "Hugging Face")


def gguf_to_hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight` (the inverse of
    `hf_to_gguf_name`). Raises SharkportError naming the tensor when it is unknown."""
    return _rename(name, _GGUF_TO_HF, "GGUF")


def _regroup(w, n_head: int, inner: tuple[int, int]):
    """Reshapes the rows of w [n_head * D, ...] to (n_head, *inner, ...), swaps the two inner
    axes and flattens back. Works on numpy arrays and torch tensors alike."""
    if w.shape[0] % (2 * n_head):
        raise SharkportError(
            f"cannot permute Q/K rows: {w.shape[0]} rows is not a multiple of 2 x {n_head} heads; "
            "the head count does not match the tensor"
        )
    grouped = w.reshape(n_head, *inner, *w.shape[1:])
    swapped = grouped.swapaxes(1, 2) if isinstance(w, np.ndarray) else grouped.transpose(1, 2)
    return swapped.reshape(w.shape)


def permute_qk(w: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """HF ("half") → GGUF ("interleaved") row order of a Q or K weight [n_head * D, E] or bias
    [n_head * D], as llama.cpp's converter does it: within each head, row i of the first half
    and row i of the second half become rows 2i and 2i + 1. Pass the KV head count for K."""
    head_dim = w.shape[0] // n_head
    return _regroup(w, n_head, (2, head_dim // 2))


def unpermute_qk(w: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """The inverse of `permute_qk`: GGUF ("interleaved") → HF ("half") row order."""
    head_dim = w.shape[0] // n_head
    return _regroup(w, n_head, (head_dim // 2, 2))
