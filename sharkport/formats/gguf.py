"""GGUF on disk → plain records over memory-mapped views, read with bounds checks.

Model files come from strangers, so the header is walked field by field (`_HeaderWalker`):
every count and length is weighed against the bytes left, so a hostile length can neither
allocate nor loop for long, and every tensor's type, row size, alignment and data range is
checked before its data is touched. The same walk decodes the metadata, so the file is parsed
once. (gguf.GGUFReader, which we used before, hangs on some hostile lengths and builds a numpy
view per vocabulary string: 5.7 s for SmolLM2's 49,152 tokens. The gguf package still supplies
the format's constants, and tests check this reader against GGUFReader.)
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from ..errors import SharkportError

# numpy dtype and byte size of each scalar metadata type, from the gguf reader's own table.
_SCALAR_DTYPES = {t: np.dtype(np_t) for t, np_t in gguf.GGUFReader.gguf_scalar_to_np.items()}
_SCALAR_SIZES = {t: dt.itemsize for t, dt in _SCALAR_DTYPES.items()}
_MAX_DIMS = 4  # GGML_MAX_DIMS
_HEADER_BYTES = 24  # magic, version, tensor count, kv count
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_REDOWNLOAD = "the file is truncated or corrupt; re-download or re-convert it"


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

    def first_blocks(self, n: int) -> "GgufFile":
        """The same file cut to its first `n` transformer blocks: tensors `blk.{i}.*` with
        i >= n are dropped and `{arch}.block_count` says n (a small model for tests)."""
        key = f"{self.architecture}.block_count"
        count = self.metadata.get(key)
        if not isinstance(count, int):
            raise SharkportError(f"{self.path}: has no {key}, so --num-blocks cannot apply")
        if not 1 <= n <= count:
            raise SharkportError(f"--num-blocks {n}: {self.path} has {count} blocks; pass 1..{count}")
        kept = [t for t in self.tensors if (m := _BLOCK_TENSOR.match(t.name)) is None or int(m[1]) < n]
        return dataclasses.replace(self, metadata={**self.metadata, key: n}, tensors=kept)


_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")


def read_gguf(path: str | os.PathLike) -> GgufFile:
    """Opens a GGUF file memory-mapped. Raises SharkportError naming the file (and the offset or
    tensor) when it is not a well-formed GGUF: bad magic or version, a header or tensor data
    cut short, absurd counts or lengths, unknown tensor types, rows that do not fill whole
    quantization blocks, tensors outside the file or overlapping one another."""
    path = Path(path)
    if not path.is_file():
        raise SharkportError(f"{path}: no such file; pass the path of a .gguf model file")
    metadata, infos, data_start, alignment = _read_header(path)
    spans = _check_tensor_data(path, path.stat().st_size, infos, data_start, alignment)
    data = np.memmap(path, mode="r")  # one map; each tensor is a view of it
    tensors = [
        GgufTensor(name=t.name, type_name=t.type.name, shape=tuple(reversed(t.ne)),
                   data=data[start:start + n_bytes], offset=start, n_bytes=n_bytes)
        for t, (start, n_bytes) in zip(infos, spans)
    ]
    return GgufFile(path=path, metadata=metadata, tensors=tensors)


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    info_offset: int  # where the tensor's header entry starts
    ne: tuple[int, ...]  # ggml order, innermost first
    type: gguf.GGMLQuantizationType
    rel_offset: int  # data offset relative to the data section


def _read_header(path: Path) -> tuple[dict[str, Any], list["_TensorInfo"], int, int]:
    """Walks the header with bounds checks: (metadata, tensor infos, data start, alignment)."""
    size = path.stat().st_size
    if size < _HEADER_BYTES:
        with open(path, "rb") as f:
            head = f.read(4)
        if head != b"GGUF"[: len(head)]:
            raise SharkportError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
        raise SharkportError(f"{path}: the {size}-byte file is shorter than a GGUF header "
                             f"({_HEADER_BYTES} bytes); {_REDOWNLOAD}")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        walker = _HeaderWalker(path, buf)
        infos, data_start = walker.walk()
    return walker.metadata, infos, data_start, walker.alignment


class _HeaderWalker:
    """Reads the GGUF header (KV metadata and tensor infos) field by field, never trusting a
    count or length beyond what the rest of the file could hold."""

    def __init__(self, path: Path, buf: mmap.mmap):
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0
        self.order = "<"
        self.alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        self.metadata: dict[str, Any] = {}

    def fail(self, at: int, what: str, fix: str = _REDOWNLOAD) -> SharkportError:
        return SharkportError(f"{self.path}: at offset {at}: {what}; {fix}")

    def take(self, n: int, what: str) -> int:
        """Advances over n bytes; returns where they start."""
        start = self.pos
        if n > self.size - start:
            raise self.fail(start, f"{what} needs {n} bytes but the file ends at {self.size}")
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> int:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(self.order + fmt, self.buf, start)[0]

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count of items that each need at least `min_item_bytes` bytes."""
        at = self.pos
        n = self.unpack("Q", f"the {what}")
        if n * min_item_bytes > self.size - self.pos:
            raise self.fail(at, f"the {what} is {n}, more than the {self.size - self.pos} bytes "
                                f"left before the end of the file at {self.size} can hold")
        return n

    def string(self, what: str) -> str:
        at = self.pos
        n = self.count(f"length of {what}", 1)
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(at, f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def value_type(self, what: str) -> gguf.GGUFValueType:
        at = self.pos
        raw = self.unpack("I", what)
        try:
            return gguf.GGUFValueType(raw)
        except ValueError:
            raise self.fail(at, f"{what} is {raw}, not a GGUF value type") from None

    def value(self, key: str, vtype: gguf.GGUFValueType) -> Any:
        """One metadata value as Python data: str, int, float, bool, or a list of them."""
        if vtype == gguf.GGUFValueType.STRING:
            return self.string(f"the string value of {key}")
        if vtype in _SCALAR_SIZES:
            start = self.take(_SCALAR_SIZES[vtype], f"the value of {key}")
            return self.scalars(vtype, start, 1)[0]
        at = self.pos
        item = self.value_type(f"the item type of array {key}")
        if item == gguf.GGUFValueType.ARRAY:
            raise self.fail(at, f"{key} is an array of arrays, which GGUF readers do not support")
        if item == gguf.GGUFValueType.STRING:
            return self.strings(key, self.count(f"item count of array {key}", 8))
        n = self.count(f"item count of array {key}", _SCALAR_SIZES[item])
        return self.scalars(item, self.take(n * _SCALAR_SIZES[item], f"the items of {key}"), n)

    def scalars(self, vtype: gguf.GGUFValueType, start: int, n: int) -> list:
        dtype = _SCALAR_DTYPES[vtype].newbyteorder(self.order)
        values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=start)
        try:
            return values.tolist()
        finally:
            del values  # release the mmap export, so the map can close

    def strings(self, key: str, n: int) -> list[str]:
        """n length-prefixed strings (a vocabulary: one tight loop, not one call per string)."""
        buf, end, pos, fmt = self.buf, self.size, self.pos, self.order + "Q"
        out = []
        for i in range(n):
            if end - pos < 8:
                raise self.fail(pos, f"the length of item {i} of {key} needs 8 bytes but the file ends at {end}")
            (length,) = struct.unpack_from(fmt, buf, pos)
            if length > end - pos - 8:
                raise self.fail(pos, f"the length of item {i} of {key} is {length}, more than the "
                                     f"{end - pos - 8} bytes left before the end of the file at {end} can hold")
            try:
                out.append(buf[pos + 8:pos + 8 + length].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(pos, f"item {i} of {key} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
            pos += 8 + length
        self.pos = pos
        return out

    def walk(self) -> tuple[list[_TensorInfo], int]:
        if self.buf[:4] != b"GGUF":
            raise self.fail(0, f"the magic is {bytes(self.buf[:4])!r}, not b'GGUF'",
                            "this is not a GGUF file; pass a .gguf model file")
        version = struct.unpack_from("<I", self.buf, 4)[0]
        if version & 0xFFFF == 0:  # written on a big-endian machine, as GGUFReader reads it
            self.order = ">"
            version = struct.unpack_from(">I", self.buf, 4)[0]
        if version not in READER_SUPPORTED_VERSIONS:
            raise self.fail(4, f"GGUF version {version} is not supported (supported: "
                               f"{', '.join(map(str, READER_SUPPORTED_VERSIONS))})",
                            "convert the model again with a current llama.cpp")
        self.pos = 8
        tensor_count = self.unpack("Q", "the tensor count")
        kv_count = self.unpack("Q", "the metadata key count")
        for what, n, least in (("tensor count", tensor_count, _MIN_TENSOR_INFO_BYTES),
                               ("metadata key count", kv_count, _MIN_KV_BYTES)):
            if n * least > self.size - self.pos:
                raise self.fail(8 if what == "tensor count" else 16,
                                f"the {what} is {n}, more than the {self.size}-byte file can hold")
        keys: set[str] = set()
        for i in range(kv_count):
            at = self.pos
            key = self.string(f"the name of metadata key {i}")
            if key in keys:
                raise self.fail(at, f"metadata key {key} appears twice")
            keys.add(key)
            vtype = self.value_type(f"the value type of {key}")
            value = self.metadata[key] = self.value(key, vtype)
            if key == "general.alignment":
                self._set_alignment(at, vtype, value)
        infos = [self._tensor_info(i) for i in range(tensor_count)]
        names: set[str] = set()
        for t in infos:
            if t.name in names:
                raise self.fail(t.info_offset, f"tensor {t.name} appears twice")
            names.add(t.name)
        data_start = -(-self.pos // self.alignment) * self.alignment
        return infos, data_start

    def _set_alignment(self, at: int, vtype: gguf.GGUFValueType, alignment: Any) -> None:
        if vtype != gguf.GGUFValueType.UINT32:
            raise self.fail(at, f"general.alignment has type {vtype.name}, not UINT32")
        if alignment == 0 or alignment & (alignment - 1):
            raise self.fail(at, f"general.alignment is {alignment}, not a power of two")
        self.alignment = alignment

    def _tensor_info(self, i: int) -> _TensorInfo:
        at = self.pos
        name = self.string(f"the name of tensor {i}")
        n_dims = self.unpack("I", f"the dimension count of tensor {name}")
        if n_dims > _MAX_DIMS:
            raise self.fail(at, f"tensor {name} has {n_dims} dimensions; GGUF allows at most {_MAX_DIMS}")
        ne = tuple(self.unpack("Q", f"dimension {d} of tensor {name}") for d in range(n_dims))
        type_at = self.pos
        raw_type = self.unpack("I", f"the type of tensor {name}")
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.fail(type_at, f"tensor {name} has ggml type {raw_type}, which no known ggml "
                                     f"type has (gguf {_gguf_version()})",
                            "the file is corrupt, or newer than this gguf package: upgrade gguf") from None
        offset = self.unpack("Q", f"the data offset of tensor {name}")
        return _TensorInfo(name, at, ne, ggml_type, offset)


def _check_tensor_data(path: Path, size: int, infos: list[_TensorInfo], data_start: int,
                       alignment: int) -> list[tuple[int, int]]:
    """Every tensor's rows fill whole blocks of its type, and its bytes lie inside the file,
    aligned, overlapping no other tensor. Returns each tensor's (file offset, byte count)."""
    spans, placed = [], []
    for t in infos:
        where = f"{path}: tensor {t.name} (header entry at offset {t.info_offset})"
        block, type_size = gguf.GGML_QUANT_SIZES[t.type]
        row = t.ne[0] if t.ne else 1  # a 0-d tensor is one value
        if row % block:
            raise SharkportError(
                f"{where}: rows of {row} values are not a whole number of {t.type.name} "
                f"blocks of {block}; the shape and the type disagree, so the file is corrupt")
        n_elements = int(np.prod(t.ne, dtype=object)) if t.ne else 1
        if n_elements == 0:
            raise SharkportError(f"{where}: its shape {list(t.ne)} holds no values; {_REDOWNLOAD}")
        n_bytes = n_elements // block * type_size
        start = data_start + t.rel_offset
        if t.rel_offset % alignment:
            raise SharkportError(
                f"{where}: its data offset {t.rel_offset} is not a multiple of the file's "
                f"alignment {alignment}; {_REDOWNLOAD}")
        end = start + n_bytes
        if end > size:
            raise SharkportError(
                f"{where}: its {n_bytes} bytes at offset {start} end at {end}, past the end of the "
                f"{size}-byte file; {_REDOWNLOAD}")
        placed.append((start, n_bytes))
        if n_bytes:
            spans.append((start, end, t.name))
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise SharkportError(
                f"{path}: tensors {n0} (offset {s0}..{e0}) and {n1} (offset {s1}..{e1}) overlap; "
                "the file is corrupt; re-download or re-convert it")
    return placed


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")
