"""GGUF → parameter archive (.irpa), without torch or IREE (so `dump_gguf --output-irpa` starts in a
fraction of a second): plain tensors are copied in the kernel from the GGUF's file ranges,
quantized ones split into their planes a bounded chunk of blocks at a time, straight into their
place in the archive. `sharkport.archive` re-exports `import_gguf` and `gguf_archive_metadata`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..errors import SharkportError
from ..quant import BLOCK_TYPES, PLAIN_TYPES, check_supported, interleaves
from .gguf import GgufFile, read_gguf
from .irpa import (ARCHIVE_VERSION, NUMPY_DTYPE_NAMES, Slot, copy_planes, copy_range, plane_keys, tensor_layout,
                   tensor_metadata, with_metadata, write_at, write_slots)
from .names import gguf_rope_layout


def gguf_archive_metadata(gg: GgufFile) -> dict[str, Any]:
    """The archive metadata of a GGUF file; checks every tensor's type first, so an unsupported
    file fails before anything is written."""
    for t in gg.tensors:
        check_supported(t.type_name, f"{gg.path}: tensor {t.name}")
    hparams = {k: v for k, v in gg.metadata.items() if not k.startswith("tokenizer.")}
    arch = hparams.get("general.architecture")
    embd = next((t for t in gg.tensors if t.name == "token_embd.weight"), None)
    if arch and f"{arch}.vocab_size" not in hparams and embd is not None:
        hparams[f"{arch}.vocab_size"] = embd.shape[0]
    return {
        "sharkport_archive": ARCHIVE_VERSION,
        "source": gg.path.name,
        "hparams": hparams,
        "tokenizer": {k: v for k, v in gg.metadata.items() if k.startswith("tokenizer.")},
        # llama.cpp's converter permutes llama's Q/K so that rotary pairs are adjacent (interleaved).
        "rope_layout": gguf_rope_layout(arch or ""),
        "tensors": {t.name: tensor_layout(t.type_name, t.shape) for t in gg.tensors},
    }


def gguf_slots(gg: GgufFile) -> list[Slot]:
    """The archive entries of a GGUF's tensors, in file order: a plain tensor under its name, a
    quantized one as its planes in block-struct order (keys from `plane_keys`, shapes from
    `plane_shapes`)."""
    slots = []
    for t in gg.tensors:
        if t.type_name in PLAIN_TYPES:
            slots.append(Slot(t.name, tensor_metadata(PLAIN_TYPES[t.type_name][1], t.shape).encode(), t.n_bytes))
            continue
        keys = plane_keys(t.name, tensor_layout(t.type_name, t.shape))
        for key, (shape, dt) in zip(keys, BLOCK_TYPES[t.type_name].plane_shapes(t.shape).values()):
            n_bytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            slots.append(Slot(key, tensor_metadata(NUMPY_DTYPE_NAMES[dt], shape).encode(), n_bytes))
    return slots


def import_gguf(gguf_file: str | os.PathLike | GgufFile, irpa_path: str | os.PathLike,
                progress: bool = True) -> dict[str, Any]:
    """GGUF → .irpa, tensor by tensor, written atomically (a kill leaves the old file or none).
    Returns the metadata. `gguf_file` is a path, or a file already read (`read_gguf`, maybe cut
    with `first_blocks`). Memory: a few MiB of buffers, whatever the tensor sizes."""
    gg = gguf_file if isinstance(gguf_file, GgufFile) else read_gguf(gguf_file)
    irpa_path = Path(irpa_path)
    if irpa_path.exists() and irpa_path.resolve() == gg.path.resolve():
        raise SharkportError(f"{irpa_path}: refusing to overwrite the input file; choose another --output-irpa path")
    metadata = gguf_archive_metadata(gg)
    slots, blobs = with_metadata(gguf_slots(gg), metadata)

    def fill(fd: int, offsets: tuple[int, ...]) -> None:
        at = iter(offsets)
        with open(gg.path, "rb") as f, tqdm(total=sum(t.n_bytes for t in gg.tensors), unit="B", unit_scale=True,
                                            desc=f"import {gg.path.name}", disable=not progress) as bar:
            for t in gg.tensors:
                where = f"{gg.path}: tensor {t.name}"
                if t.type_name in PLAIN_TYPES:  # copied in the kernel, not through this process's memory
                    copy_range(f.fileno(), t.offset, fd, next(at), t.n_bytes, where)
                else:
                    block = BLOCK_TYPES[t.type_name]
                    rows_of = t.shape[-1] // block.block_size if interleaves(t.type_name, t.shape) else 0
                    copy_planes(f.fileno(), t.offset, t.n_bytes, block, fd, [next(at) for _ in block.fields], where,
                                rows_of)
                bar.update(t.n_bytes)
        for blob in blobs:
            write_at(fd, blob, next(at))

    write_slots(irpa_path, slots, fill)
    return metadata
