"""Recipes by `general.architecture`: each reads its hyperparameters from the archive metadata
and its weights from the archive's Theta (GGUF names)."""

from __future__ import annotations

from ..archive import Dataset
from ..errors import SharkportError
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
    arch = dataset.architecture
    if arch not in RECIPES:
        raise SharkportError(
            f"{dataset.path}: architecture {arch!r} (general.architecture) has no recipe; "
            f"known architectures: {', '.join(sorted(RECIPES))}"
        )
    try:
        return RECIPES[arch](dataset, config or ModelConfig())
    except SharkportError as e:  # hyperparameter errors do not know the file: name it
        if str(dataset.path) in str(e):
            raise
        raise SharkportError(f"{dataset.path}: {e}") from None
