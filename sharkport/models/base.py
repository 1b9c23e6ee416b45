"""What every recipe provides: the two ABI entry points over a paged cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..archive import Theta
from ..errors import SharkportError
from ..layers.paged_cache import PagedCache


@dataclass(frozen=True)
class ModelConfig:
    """How a recipe is instantiated (not what the weights say)."""

    block_seq_stride: int = 32
    dtype: torch.dtype = torch.float32  # activations
    # K and V rounded to float16 as llama.cpp's default cache: half the memory and half the bytes
    # decode attention reads of float32; float32 keeps them exact
    kv_cache_dtype: torch.dtype = torch.float16
    # prefill returns only each sequence's last logits, [B, 1, V] (skips the output projection
    # of every other position)
    prefill_final_logits: bool = False

    def __post_init__(self):
        if self.block_seq_stride <= 0 or self.block_seq_stride % 8:
            raise SharkportError(
                f"--block-seq-stride must be a positive multiple of 8, got {self.block_seq_stride}"
            )


class CausalLM(torch.nn.Module):
    """A decoder-only LM with `prefill` and `decode` as in docs/abi.md.

    prefill(tokens [B, S], seq_lens [B], seq_block_ids [B, S/stride], cache_state [P, E]) → [B, S, V]
        (→ [B, 1, V], the logits at seq_lens - 1, with `ModelConfig.prefill_final_logits`)
    decode(tokens [B, 1], seq_lens [B], start_positions [B], seq_block_ids [B, N], cache_state) → [B, 1, V]
    Both write K/V into cache_state in place and return float32 logits."""

    config: ModelConfig
    cache: PagedCache
    hp: Any  # the recipe's hyperparameters (formats/keys.py): arch, vocab_size, context_length, ...
    theta: Theta

    @property
    def vocab_size(self) -> int:
        return self.hp.vocab_size

    @property
    def context_length(self) -> int:
        return self.hp.context_length

    def _require_tensors(self, path, shapes: dict[str, tuple[int, ...]]) -> None:
        """One error naming the first missing tensors, or the first whose shape is not the one the
        hyperparameters give (numpy order), before any layer is built: the sizes every product,
        cache and token-id bound uses come from the hyperparameters."""
        missing = [n for n in shapes if n not in self.theta]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise SharkportError(f"{path}: {self.hp.arch} model is missing tensors {', '.join(missing[:3])}"
                                 f"{more}; the file is incomplete or not a {self.hp.arch} model")
        for name, shape in shapes.items():
            if tuple(self.theta[name].shape) != tuple(shape):
                raise SharkportError(f"{path}: {name} has shape {list(self.theta[name].shape)}, but the "
                                     f"{self.hp.arch} hyperparameters give {list(shape)}; the file's metadata "
                                     "and tensors disagree: re-create it")

    def _present(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The optional tensors of `shapes` that the weights have (biases, an untied output)."""
        return {n: s for n, s in shapes.items() if n in self.theta}

    def make_block(self, theta: Theta, index: int, layer: torch.Tensor | None = None) -> torch.nn.Module:
        """Transformer block `index` over its weights `theta` (blk.{index}.*): a module with
        `prefill(h, *inputs, cache_state)` and `decode(h, *inputs, cache_state)` → the new h,
        writing its K/V into cache layer `layer` (default `index`; a traced 0-d int64 tensor when
        the exporter traces one block for every layer of the same structure and block_key,
        sharkport.export.blocks). A block reads weights only through `theta` and tensors only
        from its arguments."""
        raise NotImplementedError

    def block_key(self, layer: int) -> Any:
        """What besides its weights' names, types and shapes makes block `layer` compute
        differently from another (Gemma-3: local or global attention); None where nothing does."""
        return None

    def _build_blocks(self) -> None:
        self.blocks = torch.nn.ModuleList(self.make_block(self.theta("blk", i), i) for i in range(self.hp.block_count))

    def run_blocks(self, kind: str, h: torch.Tensor, inputs: tuple, cache_state: torch.Tensor) -> torch.Tensor:
        """h through every block's `kind` ("prefill" or "decode") in turn."""
        for block in self.blocks:
            h = getattr(block, kind)(h, *inputs, cache_state)
        return h

    def _output_weight(self):
        """output.weight, or the embeddings when they are tied (GGUF files then omit output.weight)."""
        output = self.theta.get("output.weight")
        return output if output is not None else self.theta["token_embd.weight"]

    def _prefill_rows(self, h: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """The hidden states [B, S, E] whose logits prefill returns: all of them, or with
        `prefill_final_logits` each sequence's last one, [B, 1, E]."""
        if not self.config.prefill_final_logits:
            return h
        last = (seq_lens - 1).view(-1, 1, 1).expand(-1, 1, h.shape[-1])
        return torch.gather(h, 1, last)

    def new_cache(self, pages: int) -> torch.Tensor:
        return torch.zeros(pages, self.cache.page_elems, dtype=self.config.kv_cache_dtype)
