"""The parameter archive file (.irpa) as bytes: laid out and written without torch or IREE.

IREE's parameter archive v0 (iree/schemas/parameter_archive.h), laid out exactly as IREE's own
builder (`iree_io_build_parameter_archive`, behind `ParameterIndex.create_archive_file`) lays it
out; tests compare the bytes. sharkport writes the file itself because IREE's builder copies
every entry through 32 KiB read/write pairs and then fsyncs the whole file, which makes large
imports slow. Here plain data moves by in-kernel file-range copies and quantized blocks are
split into planes a bounded chunk at a time, straight into their place.

Entries (docs/archive.md): plain tensors under their GGUF name, quantized ones as planes
`<name>:<plane>` (`<name>:<plane>:x8` with rows interleaved), each carrying turbine's `PYTORCH:`
tensor description, then the JSON entries of `metadata_blobs`: ours (`METADATA_KEY`) and
sharktank's dataset properties and tensor table.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import SharkportError
from ..fileio import atomic_output
from ..quant import BLOCK_TYPES, INTERLEAVED_ROWS, BlockType, interleave_planes, interleaves, plane_key

METADATA_KEY = "__sharkport__"
ARCHIVE_VERSION = 1
# sharktank's dataset entries (what sharktank.types.Dataset.load reads): its properties, and its
# table of the archive's tensors
SHARKTANK_PROPERTIES_KEY = "__SHARK_DATASET__"
SHARKTANK_TENSORS_KEY = "__SHARK_INFERENCE_TENSORS__"

# torch's description of each dtype an archive holds (what turbine's `as_tensor` reads back).
# (is_floating_point, is_signed, itemsize); tests check these against torch itself.
DTYPES = {
    "float32": (True, True, 4), "float16": (True, True, 2), "bfloat16": (True, True, 2),
    "int8": (False, True, 1), "uint8": (False, False, 1), "int16": (False, True, 2), "int32": (False, True, 4),
}
NUMPY_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int8): "int8",
                     np.dtype(np.uint8): "uint8", np.dtype(np.int16): "int16", np.dtype(np.int32): "int32"}


def tensor_metadata(dtype: str, shape: tuple[int, ...]) -> str:
    """turbine's per-entry tensor description of a tensor of torch dtype name `dtype` (a key of
    DTYPES) and `shape`, as `iree.turbine.aot.ParameterArchiveEntry.as_tensor` reads it."""
    floating, signed, itemsize = DTYPES[dtype]
    desc = {
        "type": "Tensor",
        "dtype": dtype,
        "shape": list(shape),
        "dtype_desc": {
            "class_name": "dtype",
            "is_complex": False,
            "is_floating_point": floating,
            "is_signed": signed,
            "itemsize": itemsize,
        },
    }
    return "PYTORCH:" + json.dumps(desc)


_MAGIC = 0x41505249  # "IRPA"
_HEADER = struct.Struct("<IHHQQQQ6Q")  # magic, version 0.0, header size, next header, flags; entry count; 3 ranges
_DATA_ENTRY = struct.Struct("<QIQ4QQ2Q")  # entry size, type, flags, name ref, metadata ref, min alignment, storage ref
_TYPE_DATA = 2
_ENTRY_ALIGN, _DATA_ALIGN, _FILE_ALIGN = 16, 64, 4096


def metadata_blobs(metadata: dict, keys: Sequence[str]) -> list[tuple[str, bytes]]:
    """The archive's JSON entries, after its tensor entries `keys`: sharkport's metadata, and
    sharktank's dataset properties (the GGUF hyperparameters) and tensor table. The table holds
    the plain tensors; quantized ones are left out of it, as sharktank's block layouts shape and
    order their planes otherwise, so sharktank sees the whole model only in an unquantized archive."""
    properties = {**metadata.get("hparams", {}), "SHARK_DATASET_VERSION": 1}
    tensors = {key: {"type_name": "PrimitiveTensor", "raw_tensors": {"": key}} for key in keys if ":" not in key}
    return [(METADATA_KEY, json.dumps(metadata).encode()),
            (SHARKTANK_PROPERTIES_KEY, json.dumps(properties).encode()),
            (SHARKTANK_TENSORS_KEY, json.dumps(tensors).encode())]


def with_metadata(slots: Sequence[Slot], metadata: dict) -> tuple[list[Slot], list[bytes]]:
    """`slots` followed by the slots of `metadata_blobs`, and those blobs (to write last)."""
    blobs = metadata_blobs(metadata, [s.key for s in slots])
    return [*slots, *(Slot(key, b"", len(blob)) for key, blob in blobs)], [blob for _, blob in blobs]


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
    the rename makes it appear whole, and a kill leaves only the hidden temporary file. An
    existing archive is swapped out, not renamed over (`fileio.swap_in`)."""
    layout = archive_layout(slots)
    with atomic_output(path, swap=True) as tmp:
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


def copy_planes(src: int, src_offset: int, n_bytes: int, block: BlockType, dst: int, dst_offsets: list[int],
                where: str, rows_of: int = 0) -> None:
    """Splits the `n_bytes` of blocks at `src_offset` in file `src` into their planes, written at
    `dst_offsets` (one per field, in struct order) in file `dst`: a bounded chunk of blocks at a
    time, read with a plain read (mapped pages would stay resident) into reused buffers. With
    `rows_of` (the blocks of a row), a matrix's rows are interleaved (interleave_planes) on the
    way, each chunk whole groups of eight rows."""
    struct_ = block.struct
    group = INTERLEAVED_ROWS * rows_of if rows_of else 1
    per = max(1, PLANE_CHUNK_BYTES // struct_.itemsize // group) * group
    raw = np.empty(per * struct_.itemsize, np.uint8)
    widths = [np.dtype(dt).itemsize * count for _, dt, count in block.fields]
    outs = [np.empty(per * w, np.uint8) for w in widths]
    n_blocks = n_bytes // struct_.itemsize
    for start in range(0, n_blocks, per):
        k = min(per, n_blocks - start)
        chunk = raw[:k * struct_.itemsize]
        read_at(src, chunk, src_offset + start * struct_.itemsize, where)
        blocks = chunk.view(struct_)
        planes = {field: blocks[field] for field, _, _ in block.fields}
        if rows_of:
            planes = interleave_planes(block.name, {f: p.reshape(k // rows_of, rows_of, *p.shape[1:]) for f, p in planes.items()})
        for (field, dt, count), w, out, dst_offset in zip(block.fields, widths, outs, dst_offsets):
            np.copyto(out[:k * w].view(dt).reshape(k, count), planes[field].reshape(k, count))
            write_at(dst, out[:k * w], dst_offset + start * w)


def tensor_layout(type_name: str, shape: tuple[int, ...]) -> dict:
    """A tensor's entry in the archive metadata's `tensors`: ggml type, shape, and for a
    quantized type its planes in block-struct order and, where its rows are interleaved
    (quant.interleaves), `interleaved_rows`."""
    layout: dict = {"type": type_name, "shape": list(shape)}
    if type_name in BLOCK_TYPES:
        layout["planes"] = [f for f, _, _ in BLOCK_TYPES[type_name].fields]
        if interleaves(type_name, shape):
            layout["interleaved_rows"] = INTERLEAVED_ROWS
    return layout


def plane_keys(name: str, layout: dict) -> list[str]:
    """The archive entries of tensor `name` of `layout` (tensor_layout): itself, or its planes."""
    if "planes" not in layout:
        return [name]
    return [plane_key(name, p, "interleaved_rows" in layout, layout["type"]) for p in layout["planes"]]
