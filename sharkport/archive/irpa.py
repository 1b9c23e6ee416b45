"""The parameter archive (.irpa): streamed, atomic writes and memory-mapped reads.

Layout (see DESIGN.md §2): plain tensors under their GGUF name, quantized ones as planes
`<name>:<plane>`, every entry carrying turbine's `PYTORCH:` tensor metadata (so
`iree.turbine.aot.ParameterArchive(...).items()[i][1].as_tensor()` works on it), and one JSON
entry `METADATA_KEY` with the hyperparameters, tokenizer, rotary layout and tensor layouts.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from ..errors import SharkportError
from ..fileio import atomic_output
from ..quant import PLAIN_TYPES, BlockType
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


# --- The archive's bytes. IREE's parameter archive v0 (iree/schemas/parameter_archive.h), laid out
# exactly as IREE's own builder (iree_io_build_parameter_archive) lays it out: tests compare the
# bytes. sharkport writes them itself because IREE's builder copies through 32 KiB read/write
# pairs and then fsyncs the whole file, which bounded a 2.2 GB import at ~0.5 GB/s.
_MAGIC = 0x41505249  # "IRPA"
_HEADER = struct.Struct("<IHHQQQQ6Q")  # magic, version 0.0, header size, next header, flags; entry count; 3 ranges
_DATA_ENTRY = struct.Struct("<QIQ4QQ2Q")  # entry size, type, flags, name ref, metadata ref, min alignment, storage ref
_TYPE_DATA = 2
_ENTRY_ALIGN, _DATA_ALIGN, _FILE_ALIGN = 16, 64, 4096


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class Slot:
    """One archive entry before its bytes exist: key, metadata and length."""

    key: str
    metadata: bytes
    length: int


@dataclass(frozen=True)
class ArchiveLayout:
    """Where everything of an archive goes: `head` is the file's first bytes (header, entry table,
    metadata segment), `offsets[i]` the absolute file offset of slot i's data, `size` the file size."""

    head: bytes
    offsets: tuple[int, ...]
    size: int


def archive_layout(slots: Sequence[Slot]) -> ArchiveLayout:
    """The layout of an archive holding `slots` in order (all as data entries, 64-byte aligned)."""
    entry_seg = (_align(_HEADER.size, _ENTRY_ALIGN), 80 * len(slots) - 4 if slots else 0)
    assert _align(_DATA_ENTRY.size, _ENTRY_ALIGN) == 80 and _DATA_ENTRY.size == 76
    meta_seg = (entry_seg[0] + entry_seg[1], sum(len(s.key.encode()) + len(s.metadata) for s in slots))
    storage_offset = _align(sum(meta_seg), _DATA_ALIGN if slots else 1)
    relative, storage_len = [], 0
    for s in slots:
        relative.append(_align(storage_len, _DATA_ALIGN))
        storage_len = relative[-1] + s.length
    head = bytearray(sum(meta_seg))
    _HEADER.pack_into(head, 0, _MAGIC, 0, 0, _HEADER.size, 0, 0, len(slots),
                      *entry_seg, *meta_seg, storage_offset, storage_len)
    names = bytearray()
    for i, (s, rel) in enumerate(zip(slots, relative)):
        key = s.key.encode()
        name_ref = (len(names), len(key))
        meta_ref = (len(names) + len(key) if s.metadata else 0, len(s.metadata))
        names += key + s.metadata
        _DATA_ENTRY.pack_into(head, entry_seg[0] + 80 * i, _DATA_ENTRY.size, _TYPE_DATA, 0,
                              *name_ref, *meta_ref, _DATA_ALIGN, rel, s.length)
    head[meta_seg[0]:] = names
    return ArchiveLayout(bytes(head), tuple(storage_offset + r for r in relative),
                         _align(storage_offset + storage_len, _FILE_ALIGN))


def write_slots(path: str | os.PathLike, slots: Sequence[Slot], fill: Callable[[int, tuple[int, ...]], None]) -> None:
    """Writes an archive atomically: lays out `slots`, then `fill(fd, offsets)` writes each slot's
    bytes at its offset (pwrite or kernel copies; anything not written stays zero). No fsync:
    the rename makes it appear whole, and a kill leaves only the hidden temporary file."""
    layout = archive_layout(slots)
    with atomic_output(path) as tmp:
        fd = os.open(tmp, os.O_RDWR)
        try:
            os.ftruncate(fd, layout.size)
            write_at(fd, layout.head, 0)
            fill(fd, layout.offsets)
        finally:
            os.close(fd)


def write_at(fd: int, data, offset: int) -> None:
    """pwrite all of `data` (bytes or a contiguous array) at `offset`."""
    view = memoryview(data)
    view = view if view.ndim == 1 and view.format == "B" else view.cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _copy_file_range(src: int, dst: int, n: int, src_offset: int, dst_offset: int) -> int:
    return os.copy_file_range(src, dst, n, src_offset, dst_offset)


def _sendfile(src: int, dst: int, n: int, src_offset: int, dst_offset: int) -> int:
    os.lseek(dst, dst_offset, os.SEEK_SET)
    return os.sendfile(dst, src, src_offset, n)


def _pread_pwrite(src: int, dst: int, n: int, src_offset: int, dst_offset: int) -> int:
    data = os.pread(src, min(n, 8 << 20), src_offset)
    return os.pwrite(dst, data, dst_offset) if data else 0


# Ways to copy a file range, fastest first: in-kernel copies, then through a buffer. Each later one
# is used when the kernel or the pair of filesystems refuses the earlier (copy_file_range across
# filesystems: EXDEV on Linux >= 5.19).
COPIERS = (_copy_file_range, _sendfile, _pread_pwrite)
_UNSUPPORTED = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF, errno.ESPIPE}


def copy_range(src: int, src_offset: int, dst: int, dst_offset: int, n: int, where: str,
               copiers=COPIERS) -> None:
    """Copies n bytes from file descriptor `src` at `src_offset` to `dst` at `dst_offset`, in the
    kernel where it can (no pass through this process's memory). `where` names the source."""
    done = 0
    for copy in copiers:
        try:
            while done < n:
                k = copy(src, dst, n - done, src_offset + done, dst_offset + done)
                if k == 0:
                    raise SharkportError(f"{where}: the file ended {n - done} bytes early (was it changed "
                                         "while being read?); re-download it")
                done += k
            return
        except (OSError, AttributeError) as e:  # AttributeError: this os has no such call
            if isinstance(e, OSError) and e.errno not in _UNSUPPORTED:
                raise
    raise SharkportError(f"{where}: no way to copy from this file worked")  # pread/pwrite never refuses


def read_at(fd: int, out: np.ndarray, offset: int, where: str) -> None:
    """Fills the contiguous 1-D uint8 array `out` from `fd` at `offset`."""
    view = memoryview(out)
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise SharkportError(f"{where}: the file ended {len(view)} bytes early (was it changed while "
                                 "being read?); re-download it")
        view, offset = view[n:], offset + n


PLANE_CHUNK_BYTES = 2 << 20  # GGUF blocks split per step: fits in cache, and memory stays flat


def copy_planes(src: int, src_offset: int, n_bytes: int, block: BlockType, dst: int, dst_offsets: list[int], where: str) -> None:
    """Splits the `n_bytes` of blocks at `src_offset` in file `src` into their planes, written at
    `dst_offsets` (one per field, in struct order) in file `dst`: a bounded chunk of blocks at a
    time, read with a plain read (mapped pages would stay resident) into reused buffers."""
    struct_ = block.struct
    per = max(1, PLANE_CHUNK_BYTES // struct_.itemsize)
    raw = np.empty(per * struct_.itemsize, np.uint8)
    widths = [np.dtype(dt).itemsize * count for _, dt, count in block.fields]
    outs = [np.empty(per * w, np.uint8) for w in widths]
    n_blocks = n_bytes // struct_.itemsize
    for start in range(0, n_blocks, per):
        k = min(per, n_blocks - start)
        chunk = raw[:k * struct_.itemsize]
        read_at(src, chunk, src_offset + start * struct_.itemsize, where)
        blocks = chunk.view(struct_)
        for (field, dt, count), w, out, dst_offset in zip(block.fields, widths, outs, dst_offsets):
            plane = out[:k * w].view(dt)
            np.copyto(plane.reshape(k, count) if count > 1 else plane, blocks[field])
            write_at(dst, out[:k * w], dst_offset + start * w)


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
        blob = json.dumps(metadata).encode()

        def fill(fd: int, offsets: tuple[int, ...]) -> None:
            for (src, offset, where), slot, dst in zip(sources, slots, offsets):
                copy_range(src, offset, fd, dst, slot.length, where)
            write_at(fd, blob, offsets[-1])

        write_slots(path, [*slots, Slot(METADATA_KEY, b"", len(blob))], fill)


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
