"""GPT-2: learned absolute positions (`position_embd`), pre-LayerNorm blocks with biases, one
fused QKV projection (`attn_qkv`), tanh-GELU MLP, output tied to the token embeddings (llama.cpp
writes a copy as `output.weight`; HF imports leave it out). No rotary embedding."""

from __future__ import annotations

import torch

from ..archive import Dataset
from ..formats.keys import GPT2HParams
from ..layers import AttentionConfig, GeluMLP, PagedAttention, PagedCache
from ..ops import embedding, layer_norm, linear
from .base import CausalLM, ModelConfig

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
        attn = AttentionConfig(hp.head_count, hp.head_count, hp.head_dim, rope_layout="half")
        self.attention = torch.nn.ModuleList(
            PagedAttention(self.theta("blk", i), attn, self.cache, i) for i in range(hp.block_count))
        self.ffn = torch.nn.ModuleList(GeluMLP(self.theta("blk", i)) for i in range(hp.block_count))
        self.output = self._output_weight()  # (context_length: the learned position table ends there)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        dtype = self.config.dtype
        return (embedding(tokens, self.theta["token_embd.weight"], dtype)
                + embedding(positions, self.theta["position_embd.weight"], dtype))

    def _norm(self, h: torch.Tensor, t, name: str) -> torch.Tensor:
        return layer_norm(h, t[f"{name}.weight"], t[f"{name}.bias"], self.hp.norm_eps)

    def _block(self, i: int, h: torch.Tensor, attend) -> torch.Tensor:
        t = self.theta("blk", i)
        h = h + attend(self.attention[i], self._norm(h, t, "attn_norm"))
        return h + self.ffn[i](self._norm(h, t, "ffn_norm"))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(self._norm(h, self.theta, "output_norm"), self.output).to(torch.float32)

    def prefill(self, tokens, seq_lens, seq_block_ids, cache_state):
        B, S = tokens.shape
        h = self._embed(tokens, torch.arange(S, device=tokens.device).unsqueeze(0).expand(B, S))
        for i in range(self.hp.block_count):
            h = self._block(i, h, lambda attn, x: attn.prefill(x, None, cache_state, seq_block_ids))
        return self._logits(self._prefill_rows(h, seq_lens))

    def decode(self, tokens, seq_lens, start_positions, seq_block_ids, cache_state):
        h = self._embed(tokens, start_positions.unsqueeze(1))
        for i in range(self.hp.block_count):
            h = self._block(i, h, lambda attn, x: attn.decode(
                x, None, cache_state, seq_block_ids, start_positions, seq_lens))
        return self._logits(h)
