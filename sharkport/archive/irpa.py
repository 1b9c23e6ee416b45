"""The parameter archive (.irpa): streamed, atomic writes and memory-mapped reads. The file's bytes
are laid out and written by `sharkport.formats.irpa` (no torch there; see its docstring).

Layout (docs/archive.md): plain tensors under their GGUF name, quantized ones as planes
`<name>:<plane>` (`<name>:<plane>:x8` with rows interleaved: quant.plane_key), every entry
carrying turbine's `PYTORCH:` tensor metadata (so
`iree.turbine.aot.ParameterArchive(...).items()[i][1].as_tensor()` works on it), then the JSON
entry `METADATA_KEY` with the hyperparameters, tokenizer, rotary layout and tensor layouts, and
sharktank's two dataset entries.

The metadata readers (`read_metadata`, `index_metadata`) need IREE's runtime but not torch, so
running a compiled module does not load it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from ..errors import SharkportError, is_whole, short
from ..formats.irpa import (ARCHIVE_VERSION, DTYPES, METADATA_KEY, Slot, copy_range, plane_keys, tensor_metadata,
                            with_metadata, write_at, write_slots)

__all__ = ["ARCHIVE_VERSION", "METADATA_KEY", "Entry", "entry_metadata", "write_archive", "index_metadata",
           "parse_metadata", "read_archive", "read_metadata"]
from ..quant import BLOCK_TYPES, INTERLEAVED_ROWS, PLAIN_TYPES, interleaves
from .tensors import QuantizedTensor, Weight

if TYPE_CHECKING:
    import torch


@functools.cache
def _torch_names() -> dict[torch.dtype, str]:
    """torch dtype → its name in the archive's tensor descriptions (torch loads only when a
    tensor is written or read, not for the metadata)."""
    import torch

    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
            torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32"}


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
    return tensor_metadata(_torch_names()[dtype], shape)


def write_archive(path: str | os.PathLike, entries: Iterable[Entry], metadata: dict[str, Any],
                  progress=None) -> None:
    """Writes an .irpa atomically. Entries holding arrays are spooled to a scratch file as they
    arrive, so peak memory is one tensor, not the model; `metadata` is read after the last
    entry (callers may fill it while the entries stream). Data then goes to its place in the
    archive by kernel copies."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryFile(dir=path.parent))
        files: dict[Path, int] = {}
        slots, sources = [], []
        for e in entries:
            if e.data is not None:
                sources.append((scratch.fileno(), scratch.tell(), "a scratch file"))
                scratch.write(np.ascontiguousarray(e.data).reshape(-1).view(np.uint8).data)
            else:
                if e.file not in files:
                    files[e.file] = stack.enter_context(open(e.file, "rb")).fileno()
                sources.append((files[e.file], e.offset, str(e.file)))
            slots.append(Slot(e.key, entry_metadata(e.dtype, e.shape).encode(), e.n_bytes))
            if progress is not None:
                progress.update(e.n_bytes)
        scratch.flush()
        all_slots, blobs = with_metadata(slots, metadata)

        def fill(fd: int, offsets: tuple[int, ...]) -> None:
            for (src, offset, where), slot, dst in zip(sources, slots, offsets):
                copy_range(src, offset, fd, dst, slot.length, where)
            for blob, dst in zip(blobs, offsets[len(slots):]):
                write_at(fd, blob, dst)

        write_slots(path, all_slots, fill)


def parse_metadata(raw: bytes, path: Any, tensors: bool = True) -> dict[str, Any]:
    """The bytes of an archive's METADATA_KEY entry as metadata, checked for what every reader
    relies on (an object with hparams and tensors, each tensor a known type, a shape of whole
    numbers, its type's planes); else one SharkportError naming `path`. `tensors=False` leaves
    the tensors' layouts to the caller (`check` reports each bad one: layout_problem)."""
    try:
        metadata = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SharkportError(f"{path}: its {METADATA_KEY} entry is not JSON ({e}); re-create the archive") from None
    problem = _metadata_problem(metadata)
    if problem is None and tensors:
        problem = next((f"gives tensor {p}" for p in (layout_problem(n, layout) for n, layout in
                                                       metadata["tensors"].items()) if p), None)
    if problem:
        raise SharkportError(f"{path}: its {METADATA_KEY} metadata {problem}; re-create the archive")
    return metadata


def _metadata_problem(m: Any) -> str | None:
    if not isinstance(m, dict):
        return "is not a JSON object"
    if not isinstance(m.get("hparams"), dict):
        return "has no hparams object"
    if not isinstance(m.get("tensors"), dict):
        return "has no tensors object"
    if m.get("tokenizer") is not None and not isinstance(m["tokenizer"], dict):
        return "has a tokenizer that is not an object"
    if m.get("rope_layout", "interleaved") not in ("interleaved", "half"):
        return f"has an unknown rope_layout {short(m['rope_layout'])}"
    return None


def is_shape(shape: Any) -> bool:
    """A tensor shape as metadata must hold it: a non-empty list of whole numbers from 0."""
    return isinstance(shape, list) and bool(shape) and all(is_whole(d) and d >= 0 for d in shape)


def layout_problem(name: str, layout: Any) -> str | None:
    """What is wrong with one tensor's layout {type, shape, planes} ("NAME ..."), or None."""
    kind = layout.get("type") if isinstance(layout, dict) else None
    if not isinstance(kind, str) or (kind not in PLAIN_TYPES and kind not in BLOCK_TYPES):
        return f"{short(name)} no known type ({short(kind)})"
    shape = layout.get("shape")
    if not is_shape(shape):
        return f"{short(name)} the shape {short(shape)}, not a list of whole numbers"
    if kind in BLOCK_TYPES and layout.get("planes") != [f for f, _, _ in BLOCK_TYPES[kind].fields]:
        return f"{short(name)} of type {kind} the planes {short(layout.get('planes'))}"
    rows = layout.get("interleaved_rows")
    if rows is not None and (rows != INTERLEAVED_ROWS or not interleaves(kind, shape)):
        return f"{short(name)} of type {kind} and shape {shape} rows interleaved by {short(rows)}"
    return None


def index_metadata(index, path: Any = "the archive") -> dict[str, Any] | None:
    """The sharkport metadata among the archives loaded into an `iree.runtime.ParameterIndex`, or
    None when none of them has it (the runtime's reader, without turbine's)."""
    entries = dict(index.items())
    if METADATA_KEY not in entries:
        return None
    return parse_metadata(bytes(np.asarray(entries[METADATA_KEY].file_view)), path)


def read_archive(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Weight], Any]:
    """Memory-maps an .irpa → (metadata, weights by GGUF name, the index that keeps the map alive)."""
    import torch

    metadata, tensors, index = _open(path)
    name_to_torch = {v: k for k, v in _torch_names().items()}

    def tensor(key: str) -> torch.Tensor:
        dtype, shape, raw = tensors[key]
        with _quiet_readonly():
            flat = torch.from_numpy(raw)
        return flat.view(name_to_torch[dtype]).view(shape)

    weights: dict[str, Weight] = {}
    for name, layout in metadata["tensors"].items():
        if layout["type"] in PLAIN_TYPES:
            weights[name] = tensor(name)
        else:
            planes = {p: tensor(key) for p, key in zip(layout["planes"], plane_keys(name, layout))}
            weights[name] = QuantizedTensor(layout["type"], tuple(layout["shape"]), planes,
                                            interleaved="interleaved_rows" in layout)
    return metadata, weights, index


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """An .irpa's metadata, the archive checked as read_archive checks it (every tensor entry
    present and described), without torch: what running a compiled module reads."""
    return _open(path)[0]


def _open(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], np.ndarray]], Any]:
    """Memory-maps an .irpa → (metadata, each tensor entry's (dtype name, shape, bytes) by key,
    the iree.runtime.ParameterIndex holding the map), or one SharkportError."""
    import iree.runtime as rt

    path = Path(path)
    if not path.is_file():
        raise SharkportError(f"{path}: no such file; pass an .irpa made by `sharkport.tools.dump_gguf --output-irpa`")
    try:
        index = rt.ParameterIndex()
        index.load(str(path), mmap=True)
        entries = dict(index.items())
    except Exception as e:
        raise SharkportError(f"{path}: not a readable parameter archive ({e}); re-create it") from None
    if METADATA_KEY not in entries:
        raise SharkportError(
            f"{path}: has no {METADATA_KEY} entry, so it was not written by sharkport; "
            "re-import the model with `python -m sharkport.tools.dump_gguf --output-irpa`"
        )
    metadata = parse_metadata(bytes(np.asarray(entries[METADATA_KEY].file_view)), path)

    def described(key: str) -> tuple[str, list[int], np.ndarray]:
        if key not in entries:
            if key.endswith("p") and key[:-1] in entries:  # quant.plane_key: Q5's fifth bits in value order
                raise SharkportError(f"{path}: holds {key[:-1]}, Q5 fifth bits in the layout of an older sharkport; "
                                     "re-import the model with `python -m sharkport.tools.dump_gguf --output-irpa`")
            raise SharkportError(f"{path}: tensor entry {key} is missing; re-create the archive")
        raw = np.asarray(entries[key].file_view)
        try:
            meta = json.loads(entries[key].metadata.decode().removeprefix("PYTORCH:"))
            dtype, itemsize = meta["dtype"], DTYPES[meta["dtype"]][2]
            shape = [int(d) for d in meta["shape"]]
            if raw.nbytes != math.prod(shape) * itemsize:
                raise ValueError(f"{raw.nbytes} bytes for {meta['dtype']} {shape}")
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise SharkportError(f"{path}: entry {key} has no valid tensor description ({e}); "
                                 "re-create the archive") from None
        return dtype, shape, raw

    tensors = {}
    for name, layout in metadata["tensors"].items():
        tensors.update((key, described(key)) for key in plane_keys(name, layout))
    return metadata, tensors, index


@contextlib.contextmanager
def _quiet_readonly():
    # Memory-mapped archive views are read-only; torch warns once per process about that. The
    # model never writes to its weights, so the warning says nothing useful here.
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        yield
