"""What a GGUF file holds, as a report (metadata with vocabularies summarized, the tensor
table), and its tensors dumped as .npy (`python -m sharkport.tools.dump_gguf`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .errors import SharkportError
from .fileio import atomic_output
from .formats.gguf import GgufFile, GgufTensor
from .quant import BLOCK_TYPES

_ARRAY_HEAD = 3
_TEXT_HEAD = 60


def summarize(value: Any) -> Any:
    """Long arrays and texts (tokenizer vocabularies, chat templates) cut to a readable head."""
    if isinstance(value, list) and len(value) > 8:
        kind = type(value[0]).__name__ if value else "?"
        return {"array_of": kind, "length": len(value), "head": value[:_ARRAY_HEAD]}
    if isinstance(value, str) and len(value) > 2 * _TEXT_HEAD:
        return {"text_length": len(value), "head": value[:_TEXT_HEAD]}
    return value


def report(gg: GgufFile) -> dict[str, Any]:
    return {
        "file": str(gg.path),
        "metadata": {k: summarize(v) for k, v in gg.metadata.items()},
        "tensors": [
            {"name": t.name, "type": t.type_name, "shape": list(t.shape), "bytes": t.n_bytes}
            for t in gg.tensors
        ],
    }


def _text(value: Any) -> str:
    if isinstance(value, dict) and "array_of" in value:
        return f"[{value['length']} x {value['array_of']}] {value['head']} ..."
    if isinstance(value, dict) and "text_length" in value:
        return f"{value['head']!r} ... ({value['text_length']} chars)"
    return repr(value) if isinstance(value, str) else str(value)


def print_report(rep: dict[str, Any]) -> None:
    print(f"file: {rep['file']}")
    print(f"metadata ({len(rep['metadata'])} keys):")
    width = max((len(k) for k in rep["metadata"]), default=0)
    for k, v in rep["metadata"].items():
        print(f"  {k:<{width}}  {_text(v)}")
    tensors = rep["tensors"]
    total = sum(t["bytes"] for t in tensors)
    print(f"tensors ({len(tensors)}, {total / 2**20:.1f} MiB):")
    name_w = max((len(t["name"]) for t in tensors), default=4)
    print(f"  {'name':<{name_w}}  {'type':<5}  {'shape':<16}  bytes")
    for t in tensors:
        shape = "x".join(map(str, t["shape"]))
        print(f"  {t['name']:<{name_w}}  {t['type']:<5}  {shape:<16}  {t['bytes']}")


_DUMP_CHUNK_BYTES = 64 << 20  # float32 output written per step, so memory stays flat


def dump_tensors(tensors: list[GgufTensor], out_dir: Path, progress: bool = False) -> dict[str, Any]:
    """Writes, per tensor, `<name>.npy` (float32 values as sharkport dequantizes them) and for a
    quantized tensor `<name>.<plane>.npy` (its packed planes, as the archive stores them), plus
    `index.json` naming each tensor's type, shape and files. Each file is written atomically,
    large tensors a chunk of rows at a time."""
    import numpy as np
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {}
    for t in tqdm(tensors, desc=f"dump to {out_dir}", unit="tensor", disable=not progress):
        files = {"values": f"{t.name}.npy"}
        rows = t.data.reshape(-1).view(np.uint8).reshape(int(np.prod(t.shape[:-1], dtype=np.int64)), -1)
        step = max(1, _DUMP_CHUNK_BYTES // (4 * t.shape[-1]))
        with atomic_output(out_dir / files["values"]) as tmp:
            values = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=t.shape)
            flat = values.reshape(rows.shape[0], t.shape[-1])
            for start in range(0, rows.shape[0], step):
                chunk = rows[start:start + step]
                flat[start:start + len(chunk)] = _float_rows(t.type_name, chunk, t.shape[-1])
            values.flush()
            del values, flat
        if t.type_name in BLOCK_TYPES:
            for plane, data in BLOCK_TYPES[t.type_name].unpack(rows, t.shape).items():
                files[plane] = f"{t.name}.{plane}.npy"
                with atomic_output(out_dir / files[plane]) as tmp:
                    with open(tmp, "wb") as f:
                        np.save(f, data)
        index[t.name] = {"type": t.type_name, "shape": list(t.shape), "files": files}
    with atomic_output(out_dir / "index.json") as tmp:
        tmp.write_text(json.dumps(index, indent=1) + "\n")
    return index


def _float_rows(type_name: str, raw_rows, n: int):
    """Raw bytes [rows, bytes per row] of one tensor → float32 [rows, n], with the same code
    the archive and the exported program use."""
    import torch

    from .archive.tensors import QuantizedTensor, weight_from_raw

    w = weight_from_raw(type_name, (raw_rows.shape[0], n), raw_rows)
    return (w.dequant() if isinstance(w, QuantizedTensor) else w.to(torch.float32)).numpy()


def select(gg: GgufFile, tensor_regex: str | None, num_blocks: int | None) -> tuple[GgufFile, list[GgufTensor]]:
    """The file cut to --num-blocks, and its tensors matching --tensor-regex (re.search)."""
    if num_blocks is not None:
        gg = gg.first_blocks(num_blocks)
    if tensor_regex is None:
        return gg, gg.tensors
    try:
        pattern = re.compile(tensor_regex)
    except re.error as e:
        raise SharkportError(f"--tensor-regex {tensor_regex!r} is not a valid regular expression ({e})") from None
    chosen = [t for t in gg.tensors if pattern.search(t.name)]
    if not chosen:
        raise SharkportError(f"--tensor-regex {tensor_regex!r} matches no tensor of {gg.path}")
    return gg, chosen
