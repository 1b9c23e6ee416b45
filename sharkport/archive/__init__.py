"""Datasets: a model's weights (Theta) with its metadata, from an .irpa or straight from a GGUF
or a Hugging Face checkpoint folder; ArchiveInfo, the metadata alone, read without torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
from tqdm import tqdm

from ..errors import SharkportError
from ..quant import plane_key
from ..formats.gguf import GgufFile, GgufTensor, read_gguf
from ..formats.gguf_import import gguf_archive_metadata, import_gguf
from ..formats.irpa import tensor_layout
from .irpa import ARCHIVE_VERSION, Entry, read_archive, read_metadata, write_archive
from .tensors import QuantizedTensor, Theta, Weight, weight_from_raw

if TYPE_CHECKING:  # torch loads only where tensors are made, so reading metadata runs without it
    import torch

    from ..formats.hf import HfCheckpoint, PlannedTensor

__all__ = ["ArchiveInfo", "Dataset", "QuantizedTensor", "Theta", "Weight", "entries_of", "import_gguf", "import_hf",
           "save_dataset", "gguf_archive_metadata", "hf_archive_metadata"]


class ArchiveMetadata:
    """Readers of the archive metadata shared by a Dataset, its metadata alone (ArchiveInfo) and a
    tensor-parallel ShardedDataset."""

    path: Path
    metadata: dict[str, Any]

    @property
    def hparams(self) -> dict[str, Any]:
        return self.metadata["hparams"]

    @property
    def architecture(self) -> str:
        return self.hparams.get("general.architecture", "")

    @property
    def rope_layout(self) -> str:
        return self.metadata.get("rope_layout", "interleaved")

    @property
    def has_tokenizer(self) -> bool:
        """Whether the archive carries tokenizer metadata (which may still be broken: tokenizer())."""
        return bool(self.metadata.get("tokenizer"))

    def tokenizer(self):
        """The model's tokenizer (raises SharkportError when the archive carries none)."""
        from ..tokenizer import Tokenizer

        if not self.has_tokenizer:
            raise SharkportError(f"{self.path}: carries no tokenizer; pass token ids instead of text")
        try:
            tokenizer = Tokenizer.from_gguf_metadata(self.metadata["tokenizer"])
        except SharkportError as e:
            raise SharkportError(f"{self.path}: its tokenizer metadata is broken ({e}); re-import the model "
                                 "from its GGUF or Hugging Face folder") from None
        tokenizer.source = str(self.path)
        return tokenizer


@dataclass
class ArchiveInfo(ArchiveMetadata):
    """An archive's metadata without its weights: what running a compiled module needs of it
    (the tokenizer, the hyperparameters), read without torch."""

    path: Path
    metadata: dict[str, Any]

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ArchiveInfo":
        """The metadata Dataset.load gives, the file checked as it checks it, without the weights:
        an .irpa's or a GGUF's read without torch (an HF folder is converted as Dataset.load does)."""
        path = Path(path)
        if path.is_dir():
            return cls(path, Dataset.load(path).metadata)
        if _is_gguf(path):
            return cls(path, gguf_archive_metadata(read_gguf(path)))
        return cls(path, read_metadata(path))


@dataclass
class Dataset(ArchiveMetadata):
    """Everything needed to build, export and tokenize a model.

    `metadata` has `hparams` (GGUF keys such as `llama.block_count`), `tokenizer`
    (`tokenizer.ggml.*` keys), `rope_layout` (`interleaved` for GGUF-sourced Q/K, `half` for HF)
    and `tensors` (name → type, shape, planes)."""

    path: Path
    metadata: dict[str, Any]
    theta: Theta
    _keepalive: Any = field(default=None, repr=False)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Dataset":
        """Opens an .irpa (memory-mapped), or a .gguf or an HF checkpoint folder (converted in memory)."""
        path = Path(path)
        if path.is_dir():
            from ..formats.hf import read_hf

            ckpt = read_hf(path)
            plan = ckpt.plan()
            weights = {p.name: t for p, t in ckpt.tensors(plan)}
            return cls(path, hf_archive_metadata(ckpt, plan), Theta(weights))
        if _is_gguf(path):
            gg = read_gguf(path)
            return cls(path, gguf_archive_metadata(gg), Theta(_gguf_weights(gg)), gg)
        metadata, weights, archive = read_archive(path)
        return cls(path, metadata, Theta(weights), archive)


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        raise SharkportError(f"{path}: no such file")
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _raw_bytes(t: GgufTensor) -> np.ndarray:
    return t.data.reshape(-1).view(np.uint8)


def _gguf_weights(gg: GgufFile) -> dict[str, Weight]:
    return {t.name: weight_from_raw(t.type_name, t.shape, _raw_bytes(t)) for t in gg.tensors}


def save_dataset(dataset: Dataset, irpa_path: str | os.PathLike, progress: bool = True) -> dict[str, Any]:
    """Writes any Dataset (e.g. a requantized view of one) as an .irpa, reading one weight at a
    time from its theta, atomically. Returns the metadata written."""
    irpa_path = Path(irpa_path)
    if irpa_path.exists() and irpa_path.resolve() == Path(dataset.path).resolve():
        raise SharkportError(f"{irpa_path}: refusing to overwrite the input file; choose another output path")
    metadata = {**dataset.metadata, "source": dataset.metadata.get("source", Path(dataset.path).name),
                "tensors": dict(dataset.metadata["tensors"])}

    def entries(bar) -> Iterator[Entry]:
        for name in metadata["tensors"]:
            w = dataset.theta[name]
            yield from entries_of(name, w)
            if isinstance(w, QuantizedTensor):  # its rows interleaved as entries_of wrote them
                metadata["tensors"][name] = tensor_layout(w.type_name, w.shape)
            bar.update(1)

    with tqdm(total=len(metadata["tensors"]), unit="tensor", desc=f"write {irpa_path.name}",
              disable=not progress) as bar:
        write_archive(irpa_path, entries(bar), metadata)
    return metadata


def entries_of(name: str, w: Weight) -> list[Entry]:
    """The archive entries of one weight held in memory: itself, or its planes (quant.plane_key),
    rows interleaved where quant.interleaves says so."""
    import torch

    if isinstance(w, QuantizedTensor):
        if not w.interleaved:
            w = QuantizedTensor.held(w.type_name, w.shape, w.planes)
        return [Entry(plane_key(name, plane, w.interleaved, w.type_name), t.dtype, tuple(t.shape), data=t.contiguous().numpy())
                for plane, t in w.planes.items()]
    bits = w.view(torch.int16) if w.dtype == torch.bfloat16 else w  # numpy has no bfloat16
    return [Entry(name, w.dtype, tuple(w.shape), data=bits.contiguous().numpy())]


def hf_archive_metadata(ckpt: HfCheckpoint, plan: list[PlannedTensor]) -> dict[str, Any]:
    """The archive metadata of an HF checkpoint: the same hparams keys a GGUF import carries,
    the tokenizer under GGUF keys, and the HF ("half") rotary layout of Q/K."""
    from ..formats.hf import hf_tokenizer_files
    from ..tokenizer import tokenizer_metadata_from_hf

    return {
        "sharkport_archive": ARCHIVE_VERSION,
        "source": ckpt.path.name,
        "hparams": ckpt.hparams_metadata(),
        "tokenizer": tokenizer_metadata_from_hf(hf_tokenizer_files(ckpt.path), ckpt.path),
        # HF llama checkpoints rotate (i, i + D/2) pairs; their Q/K rows are not permuted here.
        "rope_layout": "half",
        "tensors": {p.name: tensor_layout(p.type_name, p.shape) for p in plan},
    }


def import_hf(model_dir: str | os.PathLike, irpa_path: str | os.PathLike, dtype: torch.dtype | None = None,
              progress: bool = True) -> dict[str, Any]:
    """HF checkpoint folder → .irpa, one tensor in memory at a time, written atomically.

    Matrices are stored in `dtype` (default: as in the checkpoint), vectors in float32.
    Every name and shape is checked before anything is written. Returns the metadata."""
    import torch

    from ..formats.hf import read_hf

    ckpt = read_hf(model_dir)
    plan = ckpt.plan(dtype)
    metadata = hf_archive_metadata(ckpt, plan)

    def entries() -> Iterator[Entry]:
        for p, t in ckpt.tensors(plan):
            data = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
            yield Entry(p.name, t.dtype, p.shape, data=data.numpy())

    with tqdm(total=sum(p.n_bytes for p in plan), unit="B", unit_scale=True,
              desc=f"import {ckpt.path.name}", disable=not progress) as bar:
        write_archive(irpa_path, entries(), metadata, progress=bar)
    return metadata
