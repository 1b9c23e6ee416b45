"""Write a model as a GGUF file, for llama.cpp and every other GGUF reader
(`python -m sharkport.tools.to_gguf`, and `tools.quantize --output-gguf`).

Tensors are written as they are stored (F32, F16, BF16 or packed ggml blocks), under their
GGUF names; Q/K rows of weights in the HF ("half") rotary layout are permuted into llama.cpp's
interleaved order, as its converter does. The hyperparameters go under the standard `llama.*`
keys, the tokenizer under its `tokenizer.*` keys. One tensor is in memory at a time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SharkportError

# Typed writers for the tokenizer keys sharkport reads (GGUFWriter method per key).
_TOKENIZER_WRITERS = {
    "tokenizer.ggml.model": "add_tokenizer_model",
    "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list",
    "tokenizer.ggml.scores": "add_token_scores",
    "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.merges": "add_token_merges",
    "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id",
    "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_add_eos_token",
    "tokenizer.ggml.add_space_prefix": "add_add_space_prefix",
    "tokenizer.ggml.remove_extra_whitespaces": "add_remove_extra_whitespaces",
    "tokenizer.chat_template": "add_chat_template",
}


def write_gguf(dataset, output: str | Path, progress: bool = True) -> None:
    """Writes `dataset` (a sharkport.archive.Dataset of a llama-family model) as a GGUF file,
    atomically, streaming one tensor at a time. Only the Dataset's attributes are used, so this
    module imports nothing from the archive stage."""
    import gguf
    from tqdm import tqdm

    from ..fileio import atomic_output
    from .keys import LlamaHParams

    hp = LlamaHParams.from_metadata(dataset.hparams)
    if hp.arch != "llama":
        raise SharkportError(f"{dataset.path}: architecture {hp.arch!r} cannot be written as GGUF yet (only llama)")
    layouts: dict[str, dict[str, Any]] = dataset.metadata["tensors"]
    output = Path(output)
    if output.exists() and output.resolve() == Path(dataset.path).resolve():
        raise SharkportError(f"{output}: refusing to overwrite the input; choose another --output")

    with atomic_output(output) as tmp:
        writer = gguf.GGUFWriter(str(tmp), hp.arch)
        _write_hparams(writer, hp, dataset.hparams)
        _write_tokenizer(writer, dataset.metadata.get("tokenizer") or {})
        for name, layout in layouts.items():
            shape, dtype, nbytes, raw = _tensor_info(layout)
            writer.add_tensor_info(name, shape, dtype, nbytes, raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(_tensor_info(layout)[2] for layout in layouts.values())
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"write {output.name}",
                  disable=not progress) as bar:
            for name, layout in layouts.items():
                data = _gguf_bytes(name, dataset.theta[name], layout, hp, dataset.rope_layout)
                writer.write_tensor_data(data)
                bar.update(data.nbytes)
        writer.close()


def _write_hparams(writer, hp, hparams: dict[str, Any]) -> None:
    """The hyperparameters' GGUF keys (HParams.to_metadata: every field, the optional ones such as
    a sliding window or experts where set), typed as llama.cpp's converter writes them; the head
    dim as key and value length only where it is not embedding_length / head_count."""
    if hparams.get("general.name"):
        writer.add_name(str(hparams["general.name"]))
    for key, value in hp.to_metadata().items():
        if key == "general.architecture":  # GGUFWriter writes it
            continue
        if key == f"{hp.arch}.attention.key_length":
            if value == hp.embedding_length // hp.head_count:
                continue
            writer.add_uint32(f"{hp.arch}.attention.value_length", value)
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_array(key, value)


def _write_tokenizer(writer, tokenizer: dict[str, Any]) -> None:
    if tokenizer and "tokenizer.ggml.model" not in tokenizer:
        # A tokenizer.json kept whole: readers that need tokenizer.ggml.* get no tokenizer.
        print("warning: the model's tokenizer is a Hugging Face tokenizer.json; it is stored as "
              "tokenizer.huggingface.json, which llama.cpp does not read", file=sys.stderr)
    for key, value in tokenizer.items():
        method = _TOKENIZER_WRITERS.get(key)
        if method is not None:
            getattr(writer, method)(value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_int32(key, value) if value < 0 else writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)


def _tensor_info(layout: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype, int, Any]:
    """(shape, numpy dtype, bytes, raw ggml type or None) as GGUFWriter.add_tensor_info takes them."""
    import gguf

    from ..quant import BLOCK_TYPES

    shape, type_name = tuple(layout["shape"]), layout["type"]
    n = int(np.prod(shape, dtype=np.int64))
    if type_name == "F32":
        return shape, np.dtype(np.float32), 4 * n, None
    if type_name == "F16":
        return shape, np.dtype(np.float16), 2 * n, None
    if type_name == "BF16":
        return shape, np.dtype(np.uint16), 2 * n, gguf.GGMLQuantizationType.BF16
    block = BLOCK_TYPES[type_name]
    row_bytes = shape[-1] // block.block_size * block.type_size
    byte_shape = (*shape[:-1], row_bytes)
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape, dtype=np.int64)), gguf.GGMLQuantizationType[type_name]


def _gguf_bytes(name: str, weight, layout: dict[str, Any], hp, rope_layout: str) -> np.ndarray:
    """The tensor's data as GGUF stores it (Q/K rows permuted when they are in HF order)."""
    import torch

    from ..quant import BLOCK_TYPES
    from .names import permute_qk

    heads = None
    if rope_layout == "half" and name.split(".")[-2:-1] in (["attn_q"], ["attn_k"]):
        heads = hp.head_count if ".attn_q." in name else hp.head_count_kv

    def rows(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(permute_qk(a, heads) if heads else a)

    if layout["type"] in BLOCK_TYPES:  # a QuantizedTensor: its layout names its block type
        block = BLOCK_TYPES[layout["type"]]
        return rows(block.pack({k: p.numpy() for k, p in weight.row_order().planes.items()}))
    if weight.dtype == torch.bfloat16:
        return rows(weight.view(torch.int16).numpy().view(np.uint16))
    return rows(weight.numpy())
