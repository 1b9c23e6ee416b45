"""GPT-2: learned absolute positions (`position_embd`), pre-LayerNorm blocks with biases, one
fused QKV projection (`attn_qkv`), tanh-GELU MLP, output tied to the token embeddings (llama.cpp
writes a copy as `output.weight`; HF imports leave it out). No rotary embedding."""

from __future__ import annotations

import torch

from ..archive import Dataset
from ..archive.tensors import Theta
from ..formats.keys import GPT2HParams
from ..layers import AttentionConfig, GeluMLP, LayerNorm, Linear, PagedAttention, PagedCache
from ..ops import embedding
from .base import CausalLM, ModelConfig


class GPT2Block(torch.nn.Module):
    """LayerNorm, attention (no rotary) and the residual add; LayerNorm, the MLP and the residual add."""

    def __init__(self, theta: Theta, hp: GPT2HParams, attention: AttentionConfig, cache: PagedCache, layer):
        super().__init__()
        self.attn_norm, self.ffn_norm = (LayerNorm(theta[f"{n}.weight"], theta[f"{n}.bias"], hp.norm_eps)
                                         for n in ("attn_norm", "ffn_norm"))
        self.attention = PagedAttention(theta, attention, cache, layer)
        self.ffn = GeluMLP(theta)

    def prefill(self, h, seq_block_ids, cache_state):
        h = h + self.attention.prefill(self.attn_norm(h), None, cache_state, seq_block_ids)
        return h + self.ffn(self.ffn_norm(h))

    def decode(self, h, seq_block_ids, start_positions, seq_lens, cache_state):
        h = h + self.attention.decode(self.attn_norm(h), None, cache_state, seq_block_ids, start_positions, seq_lens)
        return h + self.ffn(self.ffn_norm(h))


class GPT2(CausalLM):
    def __init__(self, dataset: Dataset, config: ModelConfig):
        super().__init__()
        hp = GPT2HParams.from_metadata(dataset.hparams)
        self.hp, self.config, self.theta = hp, config, dataset.theta
        E, F, V = hp.embedding_length, hp.feed_forward_length, hp.vocab_size
        block = {"attn_norm": (E,), "attn_qkv": (3 * E, E), "attn_output": (E, E), "ffn_norm": (E,),
                 "ffn_up": (F, E), "ffn_down": (E, F)}
        expected = {"token_embd.weight": (V, E), "position_embd.weight": (hp.context_length, E),
                    "output_norm.weight": (E,), "output_norm.bias": (E,)} | self._present({"output.weight": (V, E)})
        for i in range(hp.block_count):
            expected |= {f"blk.{i}.{n}.weight": s for n, s in block.items()}
            expected |= {f"blk.{i}.{n}.bias": s[:1] for n, s in block.items()}
        self._require_tensors(dataset.path, expected)
        self.cache = PagedCache(hp.block_count, hp.head_count, hp.head_dim, config.block_seq_stride)
        self._build_blocks()
        self.output_norm = LayerNorm(self.theta["output_norm.weight"], self.theta["output_norm.bias"], hp.norm_eps)
        self.output = Linear(self._output_weight())  # (context_length: the learned position table ends there)

    def make_block(self, theta: Theta, index: int, layer=None) -> GPT2Block:
        hp = self.hp
        attention = AttentionConfig(hp.head_count, hp.head_count, hp.head_dim, rope_layout="half")
        return GPT2Block(theta, hp, attention, self.cache, index if layer is None else layer)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        dtype = self.config.dtype
        return (embedding(tokens, self.theta["token_embd.weight"], dtype)
                + embedding(positions, self.theta["position_embd.weight"], dtype))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.output_norm(h)).to(torch.float32)

    def prefill(self, tokens, seq_lens, seq_block_ids, cache_state):
        B, S = tokens.shape
        h = self._embed(tokens, torch.arange(S, device=tokens.device).unsqueeze(0).expand(B, S))
        h = self.run_blocks("prefill", h, (seq_block_ids,), cache_state)
        return self._logits(self._prefill_rows(h, seq_lens))

    def decode(self, tokens, seq_lens, start_positions, seq_block_ids, cache_state):
        h = self._embed(tokens, start_positions.unsqueeze(1))
        h = self.run_blocks("decode", h, (seq_block_ids, start_positions, seq_lens), cache_state)
        return self._logits(h)
