"""GGUF on disk → plain records over memory-mapped views (a thin, checked layer over gguf.GGUFReader)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..errors import SharkportError


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file. `shape` is in numpy order (outermost first), the reverse of
    ggml's `ne`; `data` is the raw memory-mapped bytes, `n_bytes` long, at file offset `offset`."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GgufFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list[GgufTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def read_gguf(path: str | os.PathLike) -> GgufFile:
    """Opens a GGUF file memory-mapped. Raises SharkportError (naming the file) when it is not a
    readable GGUF, or when any tensor's data lies outside the file."""
    path = Path(path)
    if not path.is_file():
        raise SharkportError(f"{path}: no such file; pass the path of a .gguf model file")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError, struct/numpy errors, ... on bad bytes.
        raise SharkportError(
            f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
            "is the download complete? Re-download or check the file"
        ) from None

    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        metadata[key] = value.tolist() if isinstance(value, np.ndarray) else value

    file_size = path.stat().st_size
    tensors = []
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_size or t.data.nbytes != t.n_bytes:
            raise SharkportError(
                f"{path}: tensor {t.name} needs bytes up to offset {end} but the file has "
                f"{file_size}; the file is truncated, re-download it"
            )
        tensors.append(
            GgufTensor(
                name=t.name,
                type_name=t.tensor_type.name,
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                data=t.data,
                offset=int(t.data_offset),
                n_bytes=int(t.n_bytes),
            )
        )
    return GgufFile(path=path, metadata=metadata, tensors=tensors)
