"""Tensor names: Hugging Face ↔ GGUF (llama.cpp) per architecture, and the Q/K rotary permutation.

The archive stores weights under GGUF names (docs/archive.md), so an HF checkpoint is renamed on
import with `hf_to_gguf_name`, and tests go back with `gguf_to_hf_name`. Both directions come
from one table of `{bid}` templates per architecture (`NAMES`, keyed by `general.architecture`),
where `{bid}` stands for the block (layer) index and `{xid}` for an expert: HF keeps one tensor
per expert, GGUF stacks them into one `ffn_*_exps` tensor [experts, ...].

HF llama checkpoints rotate (i, i + D/2) pairs of each head ("half" layout); llama.cpp's
converter permutes the rows of Q and K so the pairs become adjacent, (2i, 2i + 1)
("interleaved"). `permute_qk` applies that permutation and `unpermute_qk` undoes it.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from ..errors import SharkportError

__all__ = ["LLAMA_NAMES", "NAMES", "block_indices", "gguf_rope_layout", "gguf_to_hf_name", "hf_to_gguf", "hf_to_gguf_name",
           "permute_qk", "unpermute_qk"]

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


# Mixtral (GGUF architecture `llama` with experts): the router and the stacked experts.
MOE_NAMES: dict[str, str] = {
    "model.layers.{bid}.block_sparse_moe.gate.weight": "blk.{bid}.ffn_gate_inp.weight",
    "model.layers.{bid}.block_sparse_moe.experts.{xid}.w1.weight": "blk.{bid}.ffn_gate_exps.weight",
    "model.layers.{bid}.block_sparse_moe.experts.{xid}.w2.weight": "blk.{bid}.ffn_down_exps.weight",
    "model.layers.{bid}.block_sparse_moe.experts.{xid}.w3.weight": "blk.{bid}.ffn_up_exps.weight",
}

GEMMA3_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{bid}.input_layernorm.weight": "blk.{bid}.attn_norm.weight",
    "model.layers.{bid}.self_attn.q_proj.weight": "blk.{bid}.attn_q.weight",
    "model.layers.{bid}.self_attn.k_proj.weight": "blk.{bid}.attn_k.weight",
    "model.layers.{bid}.self_attn.v_proj.weight": "blk.{bid}.attn_v.weight",
    "model.layers.{bid}.self_attn.o_proj.weight": "blk.{bid}.attn_output.weight",
    "model.layers.{bid}.self_attn.q_norm.weight": "blk.{bid}.attn_q_norm.weight",
    "model.layers.{bid}.self_attn.k_norm.weight": "blk.{bid}.attn_k_norm.weight",
    "model.layers.{bid}.post_attention_layernorm.weight": "blk.{bid}.post_attention_norm.weight",
    "model.layers.{bid}.pre_feedforward_layernorm.weight": "blk.{bid}.ffn_norm.weight",
    "model.layers.{bid}.post_feedforward_layernorm.weight": "blk.{bid}.post_ffw_norm.weight",
    "model.layers.{bid}.mlp.gate_proj.weight": "blk.{bid}.ffn_gate.weight",
    "model.layers.{bid}.mlp.up_proj.weight": "blk.{bid}.ffn_up.weight",
    "model.layers.{bid}.mlp.down_proj.weight": "blk.{bid}.ffn_down.weight",
}

GPT2_NAMES: dict[str, str] = {
    "transformer.wte.weight": "token_embd.weight",
    "transformer.wpe.weight": "position_embd.weight",
    "transformer.ln_f.weight": "output_norm.weight",
    "transformer.ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
    **{f"transformer.h.{{bid}}.{hf}.{kind}": f"blk.{{bid}}.{gg}.{kind}"
       for hf, gg in (("ln_1", "attn_norm"), ("attn.c_attn", "attn_qkv"), ("attn.c_proj", "attn_output"),
                      ("ln_2", "ffn_norm"), ("mlp.c_fc", "ffn_up"), ("mlp.c_proj", "ffn_down"))
       for kind in ("weight", "bias")},
}

# general.architecture → HF template → GGUF template.
NAMES: dict[str, dict[str, str]] = {
    "llama": {**LLAMA_NAMES, **MOE_NAMES},
    "qwen2": LLAMA_NAMES,
    "gemma3": GEMMA3_NAMES,
    "gpt2": GPT2_NAMES,
}

# How llama.cpp's converter leaves the rotary pairs of Q/K: it permutes them to adjacent pairs
# only for `llama` (Mistral and Mixtral included); Qwen2 and Gemma-3 keep HF's (NEOX) order.
_GGUF_ROPE_LAYOUT = {"llama": "interleaved"}


_BLOCK = re.compile(r"blk\.(\d+)\.")


def block_indices(names) -> set[int]:
    """The transformer blocks (the N of `blk.N.*`) that tensors named `names` belong to."""
    return {int(m.group(1)) for m in map(_BLOCK.match, names) if m}


def gguf_rope_layout(arch: str) -> str:
    """`interleaved` or `half`: the Q/K rotary layout of a GGUF file of architecture `arch`."""
    return _GGUF_ROPE_LAYOUT.get(arch, "half")


def _matcher(template: str) -> re.Pattern[str]:
    """A template as an anchored regex capturing the block index (`bid`) and expert (`xid`)."""
    pattern = re.escape(template)
    for group in ("bid", "xid"):
        pattern = pattern.replace(re.escape("{" + group + "}"), rf"(?P<{group}>\d+)")
    return re.compile("^" + pattern + "$")


@functools.cache
def _rules(arch: str, reverse: bool) -> list[tuple[re.Pattern[str], str]]:
    """(pattern of the source name, target template) for one architecture and direction."""
    if arch not in NAMES:
        raise SharkportError(f"no tensor names for architecture {arch!r} (known: {', '.join(NAMES)})")
    pairs = NAMES[arch].items()
    return [(_matcher(gg), hf) for hf, gg in pairs if "{xid}" not in hf] if reverse else \
        [(_matcher(hf), gg) for hf, gg in pairs]


def _rename(name: str, arch: str, reverse: bool) -> tuple[str, int | None]:
    for pattern, target in _rules(arch, reverse):
        m = pattern.match(name)
        if m:
            groups = m.groupdict()
            bid = int(groups["bid"]) if "bid" in groups else None
            xid = int(groups["xid"]) if "xid" in groups else None
            return target.format(bid=bid), xid
    kind = "GGUF" if reverse else "Hugging Face"
    raise SharkportError(
        f"tensor {name!r} is not a known {kind} {arch} tensor name; the checkpoint is not a {arch} "
        f"model or uses an unsupported variant (known names: sharkport.formats.names.NAMES[{arch!r}])"
    )


def hf_to_gguf(name: str, arch: str = "llama") -> tuple[str, int | None]:
    """(GGUF name, expert index or None): `model.layers.3.block_sparse_moe.experts.5.w1.weight`
    → (`blk.3.ffn_gate_exps.weight`, 5). Raises SharkportError naming an unknown tensor."""
    return _rename(name, arch, reverse=False)


def hf_to_gguf_name(name: str, arch: str = "llama") -> str:
    """`model.layers.3.self_attn.q_proj.weight` → `blk.3.attn_q.weight`.

    Raises SharkportError naming the tensor when it has no GGUF counterpart."""
    return _rename(name, arch, reverse=False)[0]


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight` (the inverse of
    `hf_to_gguf_name`, for tensors that are not stacked experts). Raises SharkportError naming
    the tensor when it is unknown."""
    return _rename(name, arch, reverse=True)[0]


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
