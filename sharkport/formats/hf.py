"""Hugging Face checkpoint folders → hyperparameters under GGUF keys and a checked tensor plan.

A folder holds `config.json`, the weights as `model.safetensors` or as shards listed by
`model.safetensors.index.json`, and usually `tokenizer.json` / `tokenizer.model` with
`tokenizer_config.json`. `read_hf` reads only headers (safetensors `safe_open`, no tensor
data); `HfCheckpoint.plan` checks every tensor's name and shape against the hyperparameters
before anything is converted, and `HfCheckpoint.tensors` then yields one converted tensor at a
time, so the whole model is never in memory.

Weights keep the HF ("half") rotary layout of Q/K; no row permutation happens on import. What
does change is brought into the GGUF convention, so that a recipe reads one convention: Gemma
norms are stored as (1 + w), GPT-2's Conv1D weights are transposed to [out, in], and Mixtral's
per-expert matrices are stacked into one `ffn_*_exps` tensor, as llama.cpp's converter does.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import SharkportError, is_number, is_whole, json_type, short
from .keys import GEMMA3_KEYS, GPT2_KEYS, HPARAMS, LLAMA_KEYS, HParams
from .names import hf_to_gguf

__all__ = ["ARCHITECTURES", "HfCheckpoint", "PlannedTensor", "TORCH_TYPES", "hf_tokenizer_files", "read_hf"]

# HF `architectures[0]` → GGUF `general.architecture` of the recipe that runs it. Mistral (a
# sliding attention window) and Mixtral (experts) are llamas, as llama.cpp files them.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
    "GPT2LMHeadModel": "gpt2",
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

# GPT-2 config.json keys (its own names) for GPT2HParams fields.
_GPT2_CONFIG_KEYS: dict[str, str] = {
    "block_count": "n_layer",
    "embedding_length": "n_embd",
    "feed_forward_length": "n_inner",
    "head_count": "n_head",
    "norm_eps": "layer_norm_epsilon",
    "context_length": "n_positions",
    "vocab_size": "vocab_size",
}

# Buffers some older checkpoints saved alongside the weights; recomputed by every recipe
# (GPT-2's `attn.bias` is its causal mask).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor to import: its GGUF name, where it sits, and the ggml type it is written as."""

    name: str        # GGUF name, e.g. blk.0.attn_q.weight
    hf_name: str     # name in the safetensors file (of expert 0 for stacked experts)
    file: Path
    shape: tuple[int, ...]
    type_name: str   # F32, F16 or BF16
    # Stacked experts: (hf name, file) of each expert in order, stacked on a new first axis.
    experts: tuple[tuple[str, Path], ...] = ()

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
    hparams: HParams
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
        arch = self.hparams.arch
        expected = _EXPECTED_SHAPES[arch](self.hparams, self.tied, self.config)
        plan: list[PlannedTensor] = []
        experts: dict[str, dict[int, str]] = {}  # stacked GGUF name → expert → HF name
        for hf_name, (st_dtype, shape) in self.headers.items():
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if self.tied and hf_name == "lm_head.weight":
                continue  # a copy of the embeddings; GGUF files omit output.weight when tied
            name, expert = hf_to_gguf(hf_name, arch)
            hf_shape, shape = shape, _gguf_shape(arch, name, shape)
            if expert is not None and name in expected:
                experts.setdefault(name, {})[expert] = hf_name
                shape = (expected[name][0], *shape)  # every expert has the shape of one slice
            if name not in expected:
                raise SharkportError(
                    f"{self.files[hf_name]}: tensor {hf_name} is not part of this {self.hparams.arch} "
                    f"configuration (check config.json, e.g. attention_bias / tie_word_embeddings)"
                )
            if shape != expected[name]:
                raise SharkportError(
                    f"{self.files[hf_name]}: tensor {hf_name} has shape {list(hf_shape)} but config.json "
                    f"implies {list(_gguf_shape(arch, name, expected[name][-len(hf_shape):]))}; "
                    "the weights do not belong to this config.json"
                )
            stored = _safetensors_dtype(st_dtype, hf_name, self.files[hf_name])
            target = torch.float32 if len(shape) == 1 else (dtype or stored)
            if expert is None:
                plan.append(PlannedTensor(name, hf_name, self.files[hf_name], shape, _TYPE_OF_DTYPE[target]))
            elif expert == 0:
                plan.append(PlannedTensor(name, hf_name, self.files[hf_name], shape, _TYPE_OF_DTYPE[target]))
        plan = [self._stacked(p, experts[p.name]) if p.name in experts else p for p in plan]
        missing = sorted(set(expected) - {p.name for p in plan})
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise SharkportError(
                f"{self.path}: checkpoint is missing tensors {', '.join(missing[:3])}{more} "
                "(GGUF names); is the download complete (all shards present)?"
            )
        return plan

    def _stacked(self, first: PlannedTensor, by_expert: dict[int, str]) -> PlannedTensor:
        count = first.shape[0]
        absent = [x for x in range(count) if x not in by_expert]
        if absent:
            raise SharkportError(
                f"{self.path}: checkpoint has no expert {absent[0]} of {first.name} "
                f"({count} experts in config.json); is the download complete?"
            )
        sources = tuple((by_expert[x], self.files[by_expert[x]]) for x in range(count))
        return dataclasses.replace(first, experts=sources)

    def tensors(self, plan: list[PlannedTensor]) -> Iterator[tuple[PlannedTensor, torch.Tensor]]:
        """Yields (planned tensor, tensor in its target dtype and in the GGUF convention) one at
        a time, file by file."""
        from safetensors import safe_open

        by_file: dict[Path, list[PlannedTensor]] = {}
        for p in plan:
            by_file.setdefault(p.file, []).append(p)
        for file, items in by_file.items():
            with safe_open(file, framework="pt") as f:
                for p in items:
                    if p.experts:
                        t = torch.stack([_get_tensor(f, file, hf_name, expert_file)
                                         for hf_name, expert_file in p.experts])
                    else:
                        t = f.get_tensor(p.hf_name)
                    t = _to_gguf_convention(self.hparams.arch, p.name, t)
                    yield p, t.to(TORCH_TYPES[p.type_name]).contiguous()


def read_hf(model_dir: str | os.PathLike) -> HfCheckpoint:
    """Reads config.json and the safetensors headers of an HF checkpoint folder (no weights)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise SharkportError(f"{path}: not a directory; pass --model-dir a Hugging Face checkpoint folder")
    config = _read_json(path / "config.json", "the model's config.json")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise SharkportError(f"{path / 'config.json'}: architectures is {short(archs)}, not a list of class names; "
                             "re-download it")
    arch = ARCHITECTURES.get(archs[0]) if archs else None
    if arch is None:
        raise SharkportError(
            f"{path / 'config.json'}: architectures {archs} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    hparams = _hparams(config, arch, archs[0], path / "config.json")
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
            try:
                out[name] = (path / name).read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise SharkportError(f"{path / name}: not UTF-8 text ({e}); re-download it") from None
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
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SharkportError(f"{path}: not valid JSON ({e}); re-download it") from None
    if not isinstance(value, dict):
        raise SharkportError(f"{path}: holds a JSON {json_type(value)}, not an object; re-download it")
    return value


def _hparams(config: dict[str, Any], arch: str, hf_arch: str, where: Path) -> HParams:
    """config.json → the hyperparameters under GGUF keys, through the architecture's table."""
    try:
        metadata = _CONFIG_READERS[arch](config, hf_arch, where)
        return HPARAMS[arch].from_metadata({"general.architecture": arch, **metadata})
    except SharkportError as e:
        raise SharkportError(f"{where}: {e}") from None
    except KeyError as e:  # hidden_size / num_attention_heads absent
        raise SharkportError(f"{where}: missing the required key {e}") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:  # a mistyped field the readers use
        raise SharkportError(f"{where}: a field has a value of the wrong type or range ({e}); "
                             "re-download config.json") from None


def _keys(arch: str, table: dict[str, tuple[str, Any]], values: dict[str, Any]) -> dict[str, Any]:
    """HParams field → value (None: absent) as `{arch}.…` GGUF keys."""
    return {f"{arch}.{table[field][0]}": v for field, v in values.items() if v is not None}


def _quotient(hidden: Any, heads: Any) -> Any:
    """hidden // heads, or None when either is not a positive count (the range check names it)."""
    return hidden // heads if is_whole(hidden) and is_whole(heads) and hidden > 0 and heads > 0 else None


def _check_rope(rope: dict[str, Any], where: str) -> None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise SharkportError(
            f"rope scaling type {rope_type!r}{where} is not supported yet (only unscaled rotary "
            "embeddings); pick a model without rope_scaling"
        )


def _llama_config(config: dict[str, Any], hf_arch: str, where: Path) -> dict[str, Any]:
    """Llama, Mistral, Mixtral and Qwen2 (whose config.json keys are the same)."""
    arch = ARCHITECTURES[hf_arch]
    if config.get("mlp_bias"):
        raise SharkportError(f"mlp_bias is true; the {arch} recipe has no feed-forward biases")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    _check_rope(rope, "")
    values = {field: config.get(key) for field, key in _CONFIG_KEYS.items()}
    values["rope_freq_base"] = rope.get("rope_theta", config.get("rope_theta"))
    head_dim = config.get("head_dim") or _quotient(config["hidden_size"], config["num_attention_heads"])
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if not is_number(partial) or not 0 < partial <= 1:
        raise SharkportError(f"partial_rotary_factor is {short(partial)}; it must be a number in (0, 1]")
    values["rope_dim"] = int(head_dim * partial) if is_whole(head_dim) and head_dim > 0 else head_dim
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True):
        if hf_arch == "Qwen2ForCausalLM":
            raise SharkportError("use_sliding_window is true; the qwen2 recipe attends to every position "
                                 "of every layer (sliding windows on some layers are not supported)")
        if window < config.get("max_position_embeddings", window + 1):
            values["sliding_window"] = window
    if config.get("num_local_experts"):
        values["expert_count"] = config["num_local_experts"]
        values["expert_used_count"] = config.get("num_experts_per_tok")
    return _keys(arch, LLAMA_KEYS, values)


def _gemma3_config(config: dict[str, Any], hf_arch: str, where: Path) -> dict[str, Any]:
    """Gemma-3: per-layer-type rope bases, a sliding window on the layers `layer_types` marks."""
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise SharkportError(f"hidden_activation {config['hidden_activation']!r} is not supported "
                             "(the gemma3 recipe uses gelu_pytorch_tanh)")
    if config.get("attention_bias"):
        raise SharkportError("attention_bias is true; the gemma3 recipe has no attention biases")
    values = {field: config.get(key) for field, key in _CONFIG_KEYS.items()}
    rope = config.get("rope_parameters") or {}
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention", {})
    for kind, params in (("full_attention", full), ("sliding_attention", local)):
        _check_rope(params, f" ({kind} layers)")
    values["rope_freq_base"] = full.get("rope_theta", config.get("rope_theta"))
    values["rope_freq_base_swa"] = local.get("rope_theta", config.get("rope_local_base_freq"))
    values["sliding_window"] = config.get("sliding_window")
    if config.get("layer_types"):
        values["sliding_window_pattern"] = [t == "sliding_attention" for t in config["layer_types"]]
    elif config.get("sliding_window_pattern"):
        values["sliding_window_pattern"] = config["sliding_window_pattern"]
    if config.get("query_pre_attn_scalar"):
        values["attention_scale"] = config["query_pre_attn_scalar"] ** -0.5
    values["final_logit_softcapping"] = config.get("final_logit_softcapping")
    values["attn_logit_softcapping"] = config.get("attn_logit_softcapping")
    return _keys("gemma3", GEMMA3_KEYS, values)


def _gpt2_config(config: dict[str, Any], hf_arch: str, where: Path) -> dict[str, Any]:
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise SharkportError(f"activation_function {config['activation_function']!r} is not supported "
                             "(the gpt2 recipe uses tanh-approximated GELU, gelu_new)")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if config.get(flag):
            raise SharkportError(f"{flag} is true; the gpt2 recipe does not support it")
    return _keys("gpt2", GPT2_KEYS, {field: config.get(key) for field, key in _GPT2_CONFIG_KEYS.items()})


_CONFIG_READERS = {"llama": _llama_config, "qwen2": _llama_config, "gemma3": _gemma3_config,
                   "gpt2": _gpt2_config}


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name → the safetensors file that holds it (from the shard index if there is one)."""
    if (path / _INDEX).is_file():
        weight_map = _read_json(path / _INDEX, _INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SharkportError(f"{path / _INDEX}: has no weight_map; re-download it")
        for shard in set(weight_map.values()):  # file names beside the index, nothing elsewhere
            if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
                raise SharkportError(f"{path / _INDEX}: weight_map names {shard!r}, not a file in the "
                                     "checkpoint folder; re-download the index")
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


def _get_tensor(open_file, open_path: Path, name: str, file: Path) -> torch.Tensor:
    """Tensor `name` from `file`, through the already open `open_file` when it is that file."""
    from safetensors import safe_open

    if file == open_path:
        return open_file.get_tensor(name)
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name)


def _gguf_shape(arch: str, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a tensor has once `_to_gguf_convention` made it (its own inverse)."""
    return shape[::-1] if arch == "gpt2" and name.startswith("blk.") and len(shape) == 2 else shape


def _to_gguf_convention(arch: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """What llama.cpp's converter does to a tensor besides renaming it."""
    if arch == "gemma3" and name.endswith("norm.weight"):
        return t.to(torch.float32) + 1  # Gemma scales by (1 + w); GGUF files store 1 + w
    if arch == "gpt2" and name.startswith("blk.") and t.dim() == 2:
        return t.t()  # HF GPT-2 Conv1D weights are [in, out]
    return t


def _llama_shapes(hp, tied: bool, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF name → shape (numpy order) of every tensor a llama-family checkpoint with `hp` holds:
    Qwen2 has Q/K/V biases, llama optional Q/K/V/O biases (`attention_bias`), Mixtral experts."""
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
        })
        if hp.expert_count:
            X = hp.expert_count
            shapes.update({b + "ffn_gate_inp.weight": (X, E), b + "ffn_gate_exps.weight": (X, F, E),
                           b + "ffn_up_exps.weight": (X, F, E), b + "ffn_down_exps.weight": (X, E, F)})
        else:
            shapes.update({b + "ffn_gate.weight": (F, E), b + "ffn_up.weight": (F, E),
                           b + "ffn_down.weight": (E, F)})
        if hp.arch == "qwen2" or config.get("attention_bias"):
            shapes.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
        if config.get("attention_bias"):
            shapes[b + "attn_output.bias"] = (E,)
    return shapes


def _gemma3_shapes(hp, tied: bool, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    E, F, V, D = hp.embedding_length, hp.feed_forward_length, hp.vocab_size, hp.head_dim
    q, kv = hp.head_count * D, hp.head_count_kv * D
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if not tied:
        shapes["output.weight"] = (V, E)
    for i in range(hp.block_count):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm.weight": (E,), b + "post_attention_norm.weight": (E,),
            b + "ffn_norm.weight": (E,), b + "post_ffw_norm.weight": (E,),
            b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,),
            b + "attn_q.weight": (q, E), b + "attn_k.weight": (kv, E), b + "attn_v.weight": (kv, E),
            b + "attn_output.weight": (E, q),
            b + "ffn_gate.weight": (F, E), b + "ffn_up.weight": (F, E), b + "ffn_down.weight": (E, F),
        })
    return shapes


def _gpt2_shapes(hp, tied: bool, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Shapes after the import's transpose of the Conv1D weights to [out, in] (GGUF order)."""
    E, F, V = hp.embedding_length, hp.feed_forward_length, hp.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (V, E), "position_embd.weight": (hp.context_length, E),
        "output_norm.weight": (E,), "output_norm.bias": (E,),
    }
    if not tied:
        shapes["output.weight"] = (V, E)
    for i in range(hp.block_count):
        b = f"blk.{i}."
        for name, (rows, cols) in (("attn_qkv", (3 * E, E)), ("attn_output", (E, E)),
                                   ("ffn_up", (F, E)), ("ffn_down", (E, F))):
            shapes[b + name + ".weight"], shapes[b + name + ".bias"] = (rows, cols), (rows,)
        for norm in ("attn_norm", "ffn_norm"):
            shapes[b + norm + ".weight"] = shapes[b + norm + ".bias"] = (E,)
    return shapes


_EXPECTED_SHAPES = {"llama": _llama_shapes, "qwen2": _llama_shapes, "gemma3": _gemma3_shapes,
                    "gpt2": _gpt2_shapes}
