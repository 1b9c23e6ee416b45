"""The llama recipe over N tensor-parallel ranks (Megatron-style), built from the same layers.

Rank r runs PagedAttention and SwiGLU unchanged on its own weights (H/N query heads, Hkv/N kv
heads, F/N FFN columns) and its own cache. Per layer, the hidden state h [B, S, E] is the same
on every device; each rank's `attn_output` / `ffn_down` product over its slice of the inputs is a
partial sum, and the partial sums are all-reduced. The embedding and the output head are split by
vocabulary rows: each rank embeds the tokens in its rows (zeros elsewhere, all-reduced), and
computes the logits of its rows, gathered on device 0.

prefill(tokens [B, S], seq_lens [B], seq_block_ids [B, S/stride], cache_state [N × [P, E/N]])
decode(tokens [B, 1], seq_lens [B], start_positions [B], seq_block_ids [B, blocks], cache_state)
Inputs and logits live on device 0; cache_state[r] lives on device r.
"""

from __future__ import annotations

import torch

from ..errors import SharkportError
from ..formats.keys import LlamaHParams
from ..layers import AttentionConfig, PagedAttention, PagedCache, SwiGLU
from ..models.base import CausalLM, ModelConfig
from ..ops import embedding, linear, rms_norm, rope_angles
from .archive import ShardedDataset
from .comm import all_reduce, gather, replicate
from .sharding import bounds, check_shardable

_BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                  "ffn_down")


class ShardedLlama(CausalLM):
    """The llama recipe over the ranks of a ShardedDataset (see the module docstring)."""

    def __init__(self, sharded: ShardedDataset, config: ModelConfig):
        super().__init__()
        hp = LlamaHParams.from_metadata(sharded.hparams)
        n = sharded.size
        check_shardable(hp, n, str(sharded.path))
        self.hp, self.config, self.n, self.ranks = hp, config, n, sharded.ranks
        self._check_tensors(sharded)
        # One device's cache: Hkv/N kv heads. Every device's cache has this geometry.
        self.cache = PagedCache(hp.block_count, hp.head_count_kv // n, hp.head_dim, config.block_seq_stride)
        attn = AttentionConfig(hp.head_count // n, hp.head_count_kv // n, hp.head_dim, sharded.rope_layout,
                               window=hp.sliding_window)
        self.attention = torch.nn.ModuleList(torch.nn.ModuleList(
            PagedAttention(t("blk", i), attn, self.cache, i) for i in range(hp.block_count)) for t in self.ranks)
        self.ffn = torch.nn.ModuleList(torch.nn.ModuleList(
            SwiGLU(t("blk", i)) for i in range(hp.block_count)) for t in self.ranks)
        self.vocab_rows = bounds(hp.vocab_size, n)
        # Tied embeddings: each rank's output rows are its embedding rows (the same parameter).
        self.outputs = [t["output.weight"] if "output.weight" in t else t["token_embd.weight"] for t in self.ranks]

    def _check_tensors(self, sharded: ShardedDataset) -> None:
        names = ["token_embd.weight", "output_norm.weight"] + [
            f"blk.{i}.{n}.weight" for i in range(self.hp.block_count) for n in _BLOCK_TENSORS]
        for r, theta in enumerate(self.ranks):
            missing = [n for n in names if n not in theta]
            if missing:
                raise SharkportError(f"{sharded.path}: rank {r} lacks tensors {', '.join(missing[:3])}; "
                                     "re-create the tensor-parallel archives")

    def new_cache(self, pages: int) -> list[torch.Tensor]:
        """One zeroed cache_state [pages, page_elems / N] per device."""
        return [torch.zeros(pages, self.cache.page_elems, dtype=self.config.kv_cache_dtype) for _ in range(self.n)]

    # -- pieces, each on one rank ------------------------------------------------------------------
    def _embed(self, r: int, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] → rank r's part of the embeddings [B, S, E]: rows it holds, zeros elsewhere."""
        lo, hi = self.vocab_rows[r]
        local = tokens - lo
        row = local.clamp(0, hi - lo - 1)
        inside = row == local  # one comparison: iree-compile 3.9 cannot lower `&` of two bool tensors
        e = embedding(row, self.ranks[r]["token_embd.weight"], self.config.dtype)
        return torch.where(inside.unsqueeze(-1), e, torch.zeros((), dtype=e.dtype))

    def _rope(self, positions: torch.Tensor):
        return rope_angles(positions, self.hp.rope_dim, self.hp.rope_freq_base)

    def _norm(self, r: int, h: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(h, self.ranks[r][name], self.hp.rms_eps)

    def _forward(self, tokens: list[torch.Tensor], ropes: list, attend,
                 seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """The layers over replicated inputs; attend(rank, attention layer, x, rope) → partial sum.
        With `seq_lens` (prefill), the logits of the rows `_prefill_rows` keeps."""
        n = self.n
        h = all_reduce([self._embed(r, tokens[r]) for r in range(n)])
        for i in range(self.hp.block_count):
            blk = f"blk.{i}."
            parts = [attend(r, self.attention[r][i], self._norm(r, h[r], blk + "attn_norm.weight"), ropes[r])
                     for r in range(n)]
            h = [a + b for a, b in zip(h, all_reduce(parts))]
            parts = [self.ffn[r][i](self._norm(r, h[r], blk + "ffn_norm.weight")) for r in range(n)]
            h = [a + b for a, b in zip(h, all_reduce(parts))]
        if seq_lens is not None and self.config.prefill_final_logits:
            h = [self._prefill_rows(x, lens) for x, lens in zip(h, replicate(seq_lens, n))]
        logits = [linear(self._norm(r, h[r], "output_norm.weight"), self.outputs[r]).to(torch.float32)
                  for r in range(n)]
        return gather(logits, dim=-1)

    # -- the ABI -----------------------------------------------------------------------------------
    def prefill(self, tokens, seq_lens, seq_block_ids, cache_state):
        B, S = tokens.shape
        positions = torch.arange(S, device=tokens.device).unsqueeze(0).expand(B, S)
        cos, sin = self._rope(positions)
        ropes = list(zip(replicate(cos, self.n), replicate(sin, self.n)))
        ids = replicate(seq_block_ids, self.n)
        return self._forward(replicate(tokens, self.n), ropes, lambda r, attn, x, rope: attn.prefill(
            x, rope, cache_state[r], ids[r]), seq_lens)

    def decode(self, tokens, seq_lens, start_positions, seq_block_ids, cache_state):
        cos, sin = self._rope(start_positions.unsqueeze(1))
        ropes = list(zip(replicate(cos, self.n), replicate(sin, self.n)))
        ids, lens, starts = (replicate(t, self.n) for t in (seq_block_ids, seq_lens, start_positions))
        return self._forward(replicate(tokens, self.n), ropes, lambda r, attn, x, rope: attn.decode(
            x, rope, cache_state[r], ids[r], starts[r], lens[r]))
