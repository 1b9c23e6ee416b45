"""Recipes by `general.architecture`: each reads its hyperparameters from the archive metadata
and its weights from the archive's Theta (GGUF names)."""

from __future__ import annotations

from ..archive import Dataset
from ..errors import SharkportError
from ..formats.names import block_indices
from .base import CausalLM, ModelConfig
from .gemma3 import Gemma3
from .gpt2 import GPT2
from .llama import Llama

# llama covers Mistral (sliding window) and Mixtral (experts), as llama.cpp files them; qwen2 is
# llama with Q/K/V biases and HF's rotary layout.
RECIPES: dict[str, type[CausalLM]] = {
    "llama": Llama,
    "qwen2": Llama,
    "gemma3": Gemma3,
    "gpt2": GPT2,
}

__all__ = ["CausalLM", "ModelConfig", "RECIPES", "build_model"]


def build_model(dataset: Dataset, config: ModelConfig | None = None) -> CausalLM:
    """The recipe for the dataset's architecture, reading weights from its Theta."""
    tp = dataset.metadata.get("tensor_parallelism")
    if tp is not None:  # its weights are in rank files: sharkport.parallel reads them
        what = f"rank {tp['rank']} of a tensor-parallel archive" if "rank" in tp else "a tensor-parallel root archive"
        raise SharkportError(f"{dataset.path}: is {what} ({tp['size']} ranks); only the tensor-parallel export "
                             "and compiled module read it (docs/parallel.md); use the unsharded archive here")
    arch = dataset.architecture
    if not isinstance(arch, str) or arch not in RECIPES:
        raise SharkportError(
            f"{dataset.path}: architecture {arch!r} (general.architecture) has no recipe; "
            f"known architectures: {', '.join(sorted(RECIPES))}"
        )
    # the count that sizes every loop over the layers must be the blocks the archive holds
    count, blocks = dataset.hparams.get(f"{arch}.block_count"), block_indices(dataset.metadata["tensors"])
    if isinstance(count, bool) or not isinstance(count, int) or count < 1 or count != len(blocks) \
            or blocks != set(range(len(blocks))):
        raise SharkportError(f"{dataset.path}: {arch}.block_count is {count!r}, but the tensors hold "
                             f"{len(blocks)} blocks (blk.0 ..); re-create the archive or fix its metadata")
    try:
        return RECIPES[arch](dataset, config or ModelConfig())
    except SharkportError as e:  # hyperparameter errors do not know the file: name it
        if str(dataset.path) in str(e):
            raise
        raise SharkportError(f"{dataset.path}: {e}") from None
