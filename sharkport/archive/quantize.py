"""Requantize a model's weights: which tensor gets which ggml type, and a lazy view of the model
with its tensors converted (one tensor at a time, so writing it streams).

Quantization itself is `gguf.quants.quantize` (llama.cpp's reference algorithm, ported to numpy
by the gguf package), so the bytes equal what llama.cpp's reference code writes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Iterator

import gguf
import numpy as np
import torch
from gguf import quants

from ..errors import SharkportError
from ..formats.irpa import tensor_layout
from ..quant import BLOCK_TYPES, PLAIN_TYPES
from . import Dataset, QuantizedTensor, Theta, Weight
from .tensors import weight_from_raw

# What gguf.quants can write: the 32-value block types and the plain float types.
QUANTIZE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32")


def parse_type(text: str, flag: str = "--type") -> str:
    name = text.strip().upper()
    if name not in QUANTIZE_TYPES:
        known = ", ".join(t.lower() for t in QUANTIZE_TYPES)
        k_hint = " (K-quants and IQ4 types can be read and run, not yet written)" if name in BLOCK_TYPES else ""
        raise SharkportError(f"{flag} {text!r}: cannot quantize to that type{k_hint}; choose one of {known}")
    return name


@dataclass(frozen=True)
class TypeRule:
    """`--type-map 'regex=type'`: tensors whose name matches (re.search) get `type_name`."""

    pattern: re.Pattern
    type_name: str

    @classmethod
    def parse(cls, text: str) -> "TypeRule":
        regex, sep, type_text = text.rpartition("=")
        if not sep or not regex:
            raise SharkportError(f"--type-map {text!r}: expected 'REGEX=TYPE', e.g. 'ffn_down=q8_0'")
        try:
            pattern = re.compile(regex)
        except re.error as e:
            raise SharkportError(f"--type-map {text!r}: {regex!r} is not a valid regular expression ({e})") from None
        return cls(pattern, parse_type(type_text, f"--type-map {text!r}:"))


def plan_types(layouts: dict[str, dict[str, Any]], default: str | None,
               rules: list[TypeRule] = ()) -> dict[str, str]:
    """name → target type. The first matching rule decides (a block type only for matrices: a
    vector, as a norm or a bias, takes a rule's f16, bf16 or f32 and else keeps its type);
    otherwise matrices (2-D and up) whose rows fill whole blocks get `default`, and everything
    else (norms, biases, odd rows) keeps its type, as llama.cpp's quantizer does."""
    plan = {}
    for name, layout in layouts.items():
        shape, current = tuple(layout["shape"]), layout["type"]
        rule = next((r for r in rules if r.pattern.search(name)
                     and (len(shape) >= 2 or r.type_name in PLAIN_TYPES)), None)
        if rule is not None:
            target = rule.type_name
            if not _fits(target, shape):
                raise SharkportError(
                    f"--type-map sends tensor {name} {list(shape)} to {target.lower()}, whose blocks of "
                    f"{BLOCK_TYPES[target].block_size} values do not divide its rows; exclude it from the rule")
        elif default is not None and len(shape) >= 2 and _fits(default, shape):
            target = default
        else:
            target = current
        plan[name] = target
    return plan


def _fits(type_name: str, shape: tuple[int, ...]) -> bool:
    return type_name in PLAIN_TYPES or shape[-1] % BLOCK_TYPES[type_name].block_size == 0


def quantize_array(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [..., N] → the tensor as ggml stores it: raw block bytes [..., bytes per row] for
    block types, the values for F32/F16, uint16 bits for BF16."""
    if type_name == "F32":
        return values.astype(np.float32, copy=False)
    if type_name == "F16":
        return values.astype(np.float16)
    return quants.quantize(values, gguf.GGMLQuantizationType[type_name])


def float_values(w: Weight) -> np.ndarray:
    return (w.dequant() if isinstance(w, QuantizedTensor) else w.to(torch.float32)).numpy()


class _Requantized(Mapping):
    """The dataset's weights, each converted to its planned type when it is read."""

    def __init__(self, dataset: Dataset, plan: dict[str, str]):
        self._dataset, self._plan = dataset, plan

    def __getitem__(self, name: str) -> Weight:
        w = self._dataset.theta[name]
        target = self._plan[name]
        current = w.type_name if isinstance(w, QuantizedTensor) else self._dataset.metadata["tensors"][name]["type"]
        if target == current:
            return w
        shape = tuple(self._dataset.metadata["tensors"][name]["shape"])
        return weight_from_raw(target, shape, quantize_array(float_values(w), target))

    def __iter__(self) -> Iterator[str]:
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)


def requantized(dataset: Dataset, plan: dict[str, str]) -> Dataset:
    """A Dataset whose weights are converted to `plan`'s types as they are read (lazily: one
    tensor in memory at a time), with the metadata's tensor layouts to match."""
    tensors = {}
    for name, layout in dataset.metadata["tensors"].items():
        tensors[name] = tensor_layout(plan[name], tuple(layout["shape"]))
    metadata = {**dataset.metadata, "tensors": tensors}
    return replace(dataset, metadata=metadata, theta=Theta(_Requantized(dataset, plan)))

