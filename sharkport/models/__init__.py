"""Recipes by `general.architecture`."""

from __future__ import annotations

from ..archive import Dataset
from ..errors import SharkportError
from .base import CausalLM, ModelConfig
from .llama import Llama

RECIPES: dict[str, type[CausalLM]] = {
    "llama": Llama,
}

__all__ = ["CausalLM", "ModelConfig", "RECIPES", "build_model"]


def build_model(dataset: Dataset, config: ModelConfig | None = None) -> CausalLM:
    """The recipe for the dataset's architecture, reading weights from its Theta."""
    arch = dataset.architecture
    if arch not in RECIPES:
        raise SharkportError(
            f"{dataset.path}: architecture {arch!r} has no recipe (known: {', '.join(sorted(RECIPES))})"
        )
    return RECIPES[arch](dataset, config or ModelConfig())
