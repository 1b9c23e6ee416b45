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
from ..layers import AttentionConfig, Linear, PagedAttention, PagedCache, RMSNorm, SwiGLU
from ..models.base import CausalLM, ModelConfig
from ..ops import embedding, rope_angles
from .archive import ShardedDataset
from .comm import all_reduce, gather, replicate
from .sharding import bounds, check_shardable

_BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                  "ffn_down")


class ShardedLlamaBlock(torch.nn.Module):
    """A llama block over the ranks: each rank's attention and feed-forward on its own weights
    and cache, their partial sums all-reduced into the residual adds. h and every input are
    lists of one tensor per rank."""

    def __init__(self, thetas: list, hp: LlamaHParams, attention: AttentionConfig, cache: PagedCache, layer: int):
        super().__init__()
        self.attn_norm, self.ffn_norm = (torch.nn.ModuleList(RMSNorm(t[f"{n}.weight"], hp.rms_eps) for t in thetas)
                                         for n in ("attn_norm", "ffn_norm"))
        self.attention = torch.nn.ModuleList(PagedAttention(t, attention, cache, layer) for t in thetas)
        self.ffn = torch.nn.ModuleList(SwiGLU(t) for t in thetas)

    def _residual(self, h: list, attention_parts: list) -> list:
        h = [a + b for a, b in zip(h, all_reduce(attention_parts))]
        parts = [ffn(norm(x)) for ffn, norm, x in zip(self.ffn, self.ffn_norm, h)]
        return [a + b for a, b in zip(h, all_reduce(parts))]

    def prefill(self, h, ropes, seq_block_ids, cache_state):
        return self._residual(h, [attention.prefill(norm(x), rope, cache, ids) for attention, norm, x, rope, cache, ids
                                  in zip(self.attention, self.attn_norm, h, ropes, cache_state, seq_block_ids)])

    def decode(self, h, ropes, seq_block_ids, start_positions, seq_lens, cache_state):
        return self._residual(h, [attention.decode(norm(x), rope, cache, ids, starts, lens)
                                  for attention, norm, x, rope, cache, ids, starts, lens
                                  in zip(self.attention, self.attn_norm, h, ropes, cache_state, seq_block_ids,
                                         start_positions, seq_lens)])


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
        self.blocks = torch.nn.ModuleList(ShardedLlamaBlock([t("blk", i) for t in self.ranks], hp, attn, self.cache, i)
                                          for i in range(hp.block_count))
        self.vocab_rows = bounds(hp.vocab_size, n)
        self.output_norm = torch.nn.ModuleList(RMSNorm(t["output_norm.weight"], hp.rms_eps) for t in self.ranks)
        # Tied embeddings: each rank's output rows are its embedding rows (the same parameter).
        self.output = torch.nn.ModuleList(
            Linear(t["output.weight"] if "output.weight" in t else t["token_embd.weight"]) for t in self.ranks)

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

    def _embed(self, r: int, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] → rank r's part of the embeddings [B, S, E]: rows it holds, zeros elsewhere."""
        lo, hi = self.vocab_rows[r]
        local = tokens - lo
        row = local.clamp(0, hi - lo - 1)
        inside = row == local  # one comparison: iree-compile 3.9 cannot lower `&` of two bool tensors
        e = embedding(row, self.ranks[r]["token_embd.weight"], self.config.dtype)
        return torch.where(inside.unsqueeze(-1), e, torch.zeros((), dtype=e.dtype))

    def _ropes(self, positions: torch.Tensor) -> list:
        """(cos, sin) on each rank."""
        cos, sin = rope_angles(positions, self.hp.rope_dim, self.hp.rope_freq_base)
        return list(zip(replicate(cos, self.n), replicate(sin, self.n)))

    def _forward(self, kind: str, tokens: torch.Tensor, inputs: tuple, cache_state,
                 seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' `kind` over replicated inputs. With `seq_lens` (prefill), the logits of the
        rows `_prefill_rows` keeps."""
        n = self.n
        tokens = replicate(tokens, n)
        h = self.run_blocks(kind, all_reduce([self._embed(r, tokens[r]) for r in range(n)]), inputs, cache_state)
        if seq_lens is not None and self.config.prefill_final_logits:
            h = [self._prefill_rows(x, lens) for x, lens in zip(h, replicate(seq_lens, n))]
        logits = [output(norm(x)).to(torch.float32) for output, norm, x in zip(self.output, self.output_norm, h)]
        return gather(logits, dim=-1)

    # -- the ABI -----------------------------------------------------------------------------------
    def prefill(self, tokens, seq_lens, seq_block_ids, cache_state):
        B, S = tokens.shape
        ropes = self._ropes(torch.arange(S, device=tokens.device).unsqueeze(0).expand(B, S))
        return self._forward("prefill", tokens, (ropes, replicate(seq_block_ids, self.n)), cache_state, seq_lens)

    def decode(self, tokens, seq_lens, start_positions, seq_block_ids, cache_state):
        ropes = self._ropes(start_positions.unsqueeze(1))
        ids, starts, lens = (replicate(t, self.n) for t in (seq_block_ids, start_positions, seq_lens))
        return self._forward("decode", tokens, (ropes, ids, starts, lens), cache_state)
