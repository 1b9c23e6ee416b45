"""Hugging Face checkpoint folders → hyperparameters under GGUF keys and a checked tensor plan.

A folder holds `config.json`, the weights as `model.safetensors` or as shards listed by
`model.safetensors.index.json`, and usually `tokenizer.json` / `tokenizer.model` with
`tokenizer_config.json`. `read_hf` reads only headers (safetensors `safe_open`, no tensor
data); `HfCheckpoint.plan` checks every tensor's name and shape against the hyperparameters
before anything is converted, and `HfCheckpoint.tensors` then yields one converted tensor at a
time, so the whole model is never in memory.

Weights keep the HF ("half") rotary layout of Q/K; no row permutation happens on import.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import SharkportError
from .keys import LLAMA_KEYS, LlamaHParams
from .names import hf_to_gguf_name

__all__ = ["ARCHITECTURES", "HfCheckpoint", "PlannedTensor", "TORCH_TYPES", "hf_tokenizer_files", "read_hf"]

# HF `architectures[0]` → GGUF `general.architecture` of the recipe that runs it. Mistral is a
# llama with a sliding attention window (see _context_length), as llama.cpp treats it.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
}

# LlamaHParams field → config.json key (None: no config key, derived below).
_CONFIG_KEYS: dict[str, str] = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "head_count": "num_attention_heads",
    "head_count_kv": "num_key_value_heads",
    "head_dim": "head_dim",
    "rms_eps": "rms_norm_eps",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
}

# ggml type names of the plain types an import writes, and their torch dtypes.
TORCH_TYPES: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TYPE_OF_DTYPE = {v: k for k, v in TORCH_TYPES.items()}

# Buffers some older checkpoints saved alongside the weights; recomputed by every recipe.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor to import: its GGUF name, where it sits, and the ggml type it is written as."""

    name: str        # GGUF name, e.g. blk.0.attn_q.weight
    hf_name: str     # name in the safetensors file
    file: Path
    shape: tuple[int, ...]
    type_name: str   # F32, F16 or BF16

    @property
    def n_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * TORCH_TYPES[self.type_name].itemsize


@dataclass(frozen=True)
class HfCheckpoint:
    """A checked HF checkpoint folder: config, hyperparameters and where every tensor lives."""

    path: Path
    config: dict[str, Any]
    hparams: LlamaHParams
    tied: bool
    files: dict[str, Path]                  # HF tensor name → safetensors file
    headers: dict[str, tuple[str, tuple[int, ...]]]  # HF tensor name → (safetensors dtype, shape)

    def hparams_metadata(self) -> dict[str, Any]:
        """The GGUF keys a GGUF import of the same model would carry."""
        return {"general.name": self.config.get("_name_or_path") or self.path.name,
                **self.hparams.to_metadata()}

    def plan(self, dtype: torch.dtype | None = None) -> list[PlannedTensor]:
        """Every tensor to import, checked: unknown names, missing tensors and wrong shapes are
        SharkportErrors naming the tensor. Matrices are written in `dtype` (default: as
        stored); vectors (norms, biases) in float32, as llama.cpp's converter does."""
        expected = _expected_shapes(self.hparams, self.tied, bool(self.config.get("attention_bias")))
        plan: list[PlannedTensor] = []
        for hf_name, (st_dtype, shape) in self.headers.items():
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if self.tied and hf_name == "lm_head.weight":
                continue  # a copy of the embeddings; GGUF files omit output.weight when tied
            name = hf_to_gguf_name(hf_name)
            if name not in expected:
                raise SharkportError(
                    f"{self.files[hf_name]}: tensor {hf_name} is not part of this {self.hparams.arch} "
                    f"configuration (check config.json, e.g. attention_bias / tie_word_embeddings)"
                )
            if shape != expected[name]:
                raise SharkportError(
                    f"{self.files[hf_name]}: tensor {hf_name} has shape {list(shape)} but config.json "
                    f"implies {list(expected[name])}; the weights do not belong to this config.json"
                )
            stored = _safetensors_dtype(st_dtype, hf_name, self.files[hf_name])
            target = torch.float32 if len(shape) == 1 else (dtype or stored)
            plan.append(PlannedTensor(name, hf_name, self.files[hf_name], shape, _TYPE_OF_DTYPE[target]))
        missing = sorted(set(expected) - {p.name for p in plan})
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise SharkportError(
                f"{self.path}: checkpoint is missing tensors {', '.join(missing[:3])}{more} "
                "(GGUF names); is the download complete (all shards present)?"
            )
        return plan

    def tensors(self, plan: list[PlannedTensor]) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
        """Yields (planned tensor, tensor in its target dtype) one at a time, file by file."""
        from safetensors import safe_open

        by_file: dict[Path, list[PlannedTensor]] = {}
        for p in plan:
            by_file.setdefault(p.file, []).append(p)
        for file, items in by_file.items():
            with safe_open(file, framework="pt") as f:
                for p in items:
                    yield p, f.get_tensor(p.hf_name).to(TORCH_TYPES[p.type_name]).contiguous()


def read_hf(model_dir: str | os.PathLike) -> HfCheckpoint:
    """Reads config.json and the safetensors headers of an HF checkpoint folder (no weights)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise SharkportError(f"{path}: not a directory; pass --model-dir a Hugging Face checkpoint folder")
    config = _read_json(path / "config.json", "the model's config.json")
    archs = config.get("architectures") or []
    arch = ARCHITECTURES.get(archs[0]) if archs else None
    if arch is None:
        raise SharkportError(
            f"{path / 'config.json'}: architectures {archs} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    hparams = _hparams(config, arch, path / "config.json")
    files = _tensor_files(path)
    headers = _read_headers(files)
    return HfCheckpoint(path, config, hparams, bool(config.get("tie_word_embeddings", False)), files, headers)


def hf_tokenizer_files(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The tokenizer files of a checkpoint folder, as JSON-able values: `tokenizer.json` (text),
    `tokenizer.model` (base64), `tokenizer_config.json` and `special_tokens_map.json` (objects),
    `chat_template.jinja` (text). Absent files are left out."""
    path = Path(model_dir)
    out: dict[str, Any] = {}
    for name in ("tokenizer.json", "chat_template.jinja"):
        if (path / name).is_file():
            out[name] = (path / name).read_text(encoding="utf-8")
    if (path / "tokenizer.model").is_file():
        out["tokenizer.model"] = base64.b64encode((path / "tokenizer.model").read_bytes()).decode()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).is_file():
            out[name] = _read_json(path / name, name)
    return out


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise SharkportError(f"{path}: missing; a Hugging Face checkpoint folder needs {what}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SharkportError(f"{path}: not valid JSON ({e}); re-download it") from None


def _hparams(config: dict[str, Any], arch: str, where: Path) -> LlamaHParams:
    if config.get("mlp_bias"):
        raise SharkportError(f"{where}: mlp_bias is true; the {arch} recipe has no feed-forward biases")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise SharkportError(
            f"{where}: rope scaling type {rope_type!r} is not supported yet (only unscaled rotary "
            "embeddings); pick a model without rope_scaling"
        )
    metadata: dict[str, Any] = {"general.architecture": arch}
    for field, key in _CONFIG_KEYS.items():
        if config.get(key) is not None:
            metadata[f"{arch}.{LLAMA_KEYS[field][0]}"] = config[key]
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is not None:
        metadata[f"{arch}.{LLAMA_KEYS['rope_freq_base'][0]}"] = theta
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    metadata[f"{arch}.{LLAMA_KEYS['rope_dim'][0]}"] = int(head_dim * partial)
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) and window < config.get("max_position_embeddings", window + 1):
        # The recipe attends to every position; it matches the model only within its window.
        metadata[f"{arch}.{LLAMA_KEYS['context_length'][0]}"] = window
    try:
        return LlamaHParams.from_metadata(metadata)
    except SharkportError as e:
        raise SharkportError(f"{where}: {e}") from None
    except KeyError as e:  # hidden_size / num_attention_heads absent
        raise SharkportError(f"{where}: missing the required key {e}") from None


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name → the safetensors file that holds it (from the shard index if there is one)."""
    if (path / _INDEX).is_file():
        weight_map = _read_json(path / _INDEX, _INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SharkportError(f"{path / _INDEX}: has no weight_map; re-download it")
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise SharkportError(f"{shard}: shard listed in {_INDEX} is missing; download it")
        return files
    single = path / _SINGLE
    if not single.is_file():
        hint = " (only pytorch_model.bin: convert it to safetensors first)" if (path / "pytorch_model.bin").exists() else ""
        raise SharkportError(f"{path}: has no {_SINGLE} or {_INDEX}{hint}")
    return {name: single for name, _ in _headers_of(single)}


def _read_headers(files: dict[str, Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(set(files.values())):
        for name, header in _headers_of(file):
            if files.get(name) == file:  # a shard may hold stray tensors the index does not list
                headers[name] = header
    unlisted = [n for n in files if n not in headers]
    if unlisted:
        raise SharkportError(f"{files[unlisted[0]]}: does not hold tensor {unlisted[0]}, which {_INDEX} lists there")
    return headers


def _headers_of(file: Path) -> list[tuple[str, tuple[str, tuple[int, ...]]]]:
    """(name, (safetensors dtype, shape)) of every tensor in `file`, read from its header only."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return [(n, (f.get_slice(n).get_dtype(), tuple(int(d) for d in f.get_slice(n).get_shape())))
                    for n in f.keys()]
    except Exception as e:
        raise SharkportError(f"{file}: not a readable safetensors file ({e}); re-download it") from None


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _safetensors_dtype(st_dtype: str, name: str, file: Path) -> torch.dtype:
    if st_dtype not in _SAFETENSORS_DTYPES:
        raise SharkportError(
            f"{file}: tensor {name} has dtype {st_dtype}; only F32, F16 and BF16 checkpoints can be "
            "imported (a quantized checkpoint needs its original weights or a GGUF)"
        )
    return _SAFETENSORS_DTYPES[st_dtype]


def _expected_shapes(hp: LlamaHParams, tied: bool, attention_bias: bool) -> dict[str, tuple[int, ...]]:
    """GGUF name → shape (numpy order) of every tensor a llama checkpoint with `hp` holds."""
    E, F, V = hp.embedding_length, hp.feed_forward_length, hp.vocab_size
    q, kv = hp.head_count * hp.head_dim, hp.head_count_kv * hp.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if not tied:
        shapes["output.weight"] = (V, E)
    for i in range(hp.block_count):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm.weight": (E,), b + "ffn_norm.weight": (E,),
            b + "attn_q.weight": (q, E), b + "attn_k.weight": (kv, E), b + "attn_v.weight": (kv, E),
            b + "attn_output.weight": (E, q),
            b + "ffn_gate.weight": (F, E), b + "ffn_up.weight": (F, E), b + "ffn_down.weight": (E, F),
        })
        if attention_bias:
            shapes.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,),
                           b + "attn_output.bias": (E,)})
    return shapes
