"""The parameter archive (.irpa): streamed, atomic writes and memory-mapped reads.

Layout (see DESIGN.md §2): plain tensors under their GGUF name, quantized ones as planes
`<name>:<plane>`, every entry carrying turbine's `PYTORCH:` tensor metadata (so
`iree.turbine.aot.ParameterArchive(...).items()[i][1].as_tensor()` works on it), and one JSON
entry `METADATA_KEY` with the hyperparameters, tokenizer, rotary layout and tensor layouts.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import iree.runtime as rt
import numpy as np
import torch

from ..errors import SharkportError
from ..fileio import atomic_output
from ..quant import BLOCK_TYPES, PLAIN_TYPES
from .tensors import QuantizedTensor, Weight

METADATA_KEY = "__sharkport__"
ARCHIVE_VERSION = 1

_NUMPY_TO_TORCH = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int32): torch.int32,
}
_TORCH_NAMES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int8: "int8", torch.uint8: "uint8", torch.int32: "int32",
}
_NAME_TO_TORCH = {v: k for k, v in _TORCH_NAMES.items()}


@dataclass(frozen=True)
class Entry:
    """One archive entry: `data` is a contiguous numpy array, or (`file`, `offset`) names bytes
    already on disk (a plain GGUF tensor is copied from the GGUF file without touching memory)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: np.ndarray | None = None
    file: Path | None = None
    offset: int = 0

    @property
    def n_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def entry_metadata(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """turbine's per-entry tensor description (the format `ParameterArchiveEntry.as_tensor` reads)."""
    desc = {
        "type": "Tensor",
        "dtype": _TORCH_NAMES[dtype],
        "shape": list(shape),
        "dtype_desc": {
            "class_name": type(dtype).__name__,
            "is_complex": dtype.is_complex,
            "is_floating_point": dtype.is_floating_point,
            "is_signed": dtype.is_signed,
            "itemsize": dtype.itemsize,
        },
    }
    return "PYTORCH:" + json.dumps(desc)


def write_archive(path: str | os.PathLike, entries: Iterable[Entry], metadata: dict[str, Any],
                  progress=None) -> None:
    """Writes an .irpa atomically. Entries holding arrays are spooled to a scratch file as they
    arrive, so peak memory is one tensor, not the model."""
    path = Path(path)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(atomic_output(path))
        scratch = stack.enter_context(tempfile.TemporaryFile(dir=path.parent))
        scratch_handle = rt.FileHandle.wrap_fd(scratch.fileno())
        handles: dict[Path, rt.FileHandle] = {}
        index = rt.ParameterIndex()
        for e in entries:
            meta = entry_metadata(e.dtype, e.shape)
            if e.data is not None:
                offset = scratch.tell()
                scratch.write(memoryview(np.ascontiguousarray(e.data)).cast("B"))
                index.add_from_file_handle(e.key, scratch_handle, e.n_bytes, offset, metadata=meta)
            else:
                if e.file not in handles:
                    f = stack.enter_context(open(e.file, "rb"))
                    handles[e.file] = rt.FileHandle.wrap_fd(f.fileno())
                index.add_from_file_handle(e.key, handles[e.file], e.n_bytes, e.offset, metadata=meta)
            if progress is not None:
                progress.update(e.n_bytes)
        scratch.flush()
        index.add_buffer(METADATA_KEY, json.dumps(metadata).encode())
        index.create_archive_file(str(out))


def weight_entries(name: str, weight_type: str, shape: tuple[int, ...], raw: np.ndarray,
                   file: Path | None = None, offset: int = 0) -> list[Entry]:
    """The archive entries of one GGUF tensor given its raw bytes (and, for plain types, where
    those bytes sit in `file`, so they are copied from disk rather than through memory)."""
    if weight_type in PLAIN_TYPES:
        dtype = getattr(torch, PLAIN_TYPES[weight_type][1])
        if file is not None:
            return [Entry(name, dtype, shape, file=file, offset=offset)]
        return [Entry(name, dtype, shape, data=raw)]
    block = BLOCK_TYPES[weight_type]
    return [
        Entry(f"{name}:{plane}", _NUMPY_TO_TORCH[arr.dtype], arr.shape, data=arr)
        for plane, arr in block.unpack(raw, shape).items()
    ]


def index_metadata(index) -> dict[str, Any] | None:
    """The sharkport metadata among the archives loaded into an `iree.runtime.ParameterIndex`, or
    None when none of them has it (the runtime's reader, without turbine's)."""
    entries = dict(index.items())
    if METADATA_KEY not in entries:
        return None
    return json.loads(bytes(np.asarray(entries[METADATA_KEY].file_view)))


def read_archive(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Weight], Any]:
    """Memory-maps an .irpa → (metadata, weights by GGUF name, the archive that keeps the map alive)."""
    from iree.turbine.aot import ParameterArchive  # slow to import; only readers need it

    path = Path(path)
    if not path.is_file():
        raise SharkportError(f"{path}: no such file; pass an .irpa made by `sharkport.tools.dump_gguf --save`")
    try:
        archive = ParameterArchive(path, mmap=True)
        entries = dict(archive.items())
    except Exception as e:
        raise SharkportError(f"{path}: not a readable parameter archive ({e}); re-create it") from None
    if METADATA_KEY not in entries:
        raise SharkportError(
            f"{path}: has no {METADATA_KEY} entry, so it was not written by sharkport; "
            "re-import the model with `python -m sharkport.tools.dump_gguf --save`"
        )
    metadata = json.loads(bytes(np.asarray(entries[METADATA_KEY].raw.file_view)))

    def tensor(key: str) -> torch.Tensor:
        if key not in entries:
            raise SharkportError(f"{path}: tensor entry {key} is missing; re-create the archive")
        meta = json.loads(entries[key].raw.metadata.decode().removeprefix("PYTORCH:"))
        raw = np.asarray(entries[key].raw.file_view)
        with _quiet_readonly():
            flat = torch.from_numpy(raw)
        return flat.view(_NAME_TO_TORCH[meta["dtype"]]).view(meta["shape"])

    weights: dict[str, Weight] = {}
    for name, layout in metadata["tensors"].items():
        if layout["type"] in PLAIN_TYPES:
            weights[name] = tensor(name)
        else:
            planes = {p: tensor(f"{name}:{p}") for p in layout["planes"]}
            weights[name] = QuantizedTensor(layout["type"], tuple(layout["shape"]), planes)
    return metadata, weights, archive


@contextlib.contextmanager
def _quiet_readonly():
    # Memory-mapped archive views are read-only; torch warns once per process about that. The
    # model never writes to its weights, so the warning says nothing useful here.
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        yield
