"""Tensor-parallel archives: one `.irpa` per rank plus a root that ties them together.

    x.irpa        the root: metadata only (hyperparameters, tokenizer, rotary layout, and under
                  `tensor_parallelism` the size, the rank file names and each tensor's split
                  rule, type and full shape). It holds no tensor.
    x.rank{r}.irpa  rank r's pieces, named `<gguf name>.shard.{r}` (quantized ones as planes
                  `<gguf name>.shard.{r}:<plane>`), with a metadata entry of their own layouts.

Every tensor the program reads lives in a rank file, under a name no other rank uses, so
`iree-run-module --parameters=model=x.rank0.irpa --parameters=model=x.rank1.irpa` loads them all
into the one scope `model`. Rank files are written first and the root last, each atomically, so
a root on disk always has its rank files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tqdm import tqdm

from ..archive import ArchiveMetadata, Dataset, QuantizedTensor, Theta, Weight, entries_of
from ..archive.irpa import ARCHIVE_VERSION, index_metadata, read_archive, write_archive
from ..errors import SharkportError
from ..formats.irpa import tensor_layout
from ..formats.keys import LlamaHParams
from ..quant import PLAIN_TYPES
from .sharding import check_shardable, rule, shard_name, split_weight

METADATA_FIELD = "tensor_parallelism"
_PLAIN_TYPE_OF = {torch_name: ggml for ggml, (_, torch_name) in PLAIN_TYPES.items()}


def rank_path(root: str | os.PathLike, rank: int) -> Path:
    """x.irpa → x.rank{rank}.irpa, beside the root."""
    root = Path(root)
    return root.with_name(f"{root.stem}.rank{rank}{root.suffix or '.irpa'}")


def parameter_files(root: str | os.PathLike, size: int) -> tuple[list[Path], int]:
    """The rank files a module for `size` devices loads, and the vocabulary size, from the root
    archive `root` (checked to be a tensor-parallel root of `size` ranks, its rank files present)."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.load(str(root), mmap=True)
    tp = (index_metadata(index, root) or {}).get(METADATA_FIELD, {})
    if tp.get("size") != size or "rank" in tp:
        raise SharkportError(f"{root}: the module runs on {size} devices, so pass the root archive written "
                             f"with it by --tensor-parallelism-size {size} (--output-irpa)")
    paths = [Path(root).with_name(name) for name in tp["ranks"]]
    for r, path in enumerate(paths):
        if not path.is_file():
            raise SharkportError(f"{path}: rank {r} of {root} is missing; it is written beside the root")
    return paths, int(tp["tensors"]["token_embd.weight"]["shape"][0])


def is_sharded(metadata: dict[str, Any]) -> bool:
    """Whether archive metadata is that of a tensor-parallel root (or rank) archive."""
    return METADATA_FIELD in metadata


@dataclass
class ShardedDataset(ArchiveMetadata):
    """A model split over `size` ranks: the root's metadata and each rank's weights under their
    GGUF names (`ranks[r]["blk.0.attn_q.weight"]` is rank r's rows of that matrix)."""

    path: Path
    metadata: dict[str, Any]
    ranks: list[Theta]
    _keepalive: Any = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def load(cls, root: str | os.PathLike) -> "ShardedDataset":
        """Opens a root archive and its rank files (memory-mapped)."""
        return cls.from_root(Dataset.load(root))

    @classmethod
    def from_root(cls, root: Dataset) -> "ShardedDataset":
        """The sharded dataset whose root archive is already open as `root`."""
        tp = root.metadata.get(METADATA_FIELD)
        if tp is None or "rank" in tp:
            what = f"rank {tp['rank']} of a tensor-parallel archive; pass its root" if tp else \
                "not a tensor-parallel root archive"
            raise SharkportError(f"{root.path}: {what}")
        ranks, keep = [], []
        for r, file_name in enumerate(tp["ranks"]):
            path = Path(root.path).with_name(file_name)
            if not path.is_file():
                raise SharkportError(f"{path}: rank {r} of {root.path} is missing; re-create the archives "
                                     "with `python -m sharkport.export --tensor-parallelism-size ...`")
            meta, weights, archive = read_archive(path)
            if meta.get(METADATA_FIELD, {}).get("rank") != r or meta[METADATA_FIELD].get("size") != tp["size"]:
                raise SharkportError(f"{path}: is not rank {r} of {tp['size']} for {root.path}; re-create the archives")
            suffix = f".shard.{r}"
            ranks.append(Theta({name.removesuffix(suffix): w for name, w in weights.items()}))
            keep.append(archive)
        return cls(Path(root.path), root.metadata, ranks, (root, keep))


def open_or_shard(dataset: Dataset, size: int | None, output: Path | None, log=print) -> ShardedDataset | None:
    """What `python -m sharkport.export` exports for --tensor-parallelism-size `size` and
    --output-irpa `output`: a tensor-parallel root as it is, `dataset` sharded into new archives
    at `output`, or None (unsharded)."""
    if size is not None and size < 1:
        raise SharkportError(f"--tensor-parallelism-size must be at least 1, got {size}")
    if is_sharded(dataset.metadata):
        sharded = ShardedDataset.from_root(dataset)
        if size not in (None, sharded.size):
            raise SharkportError(f"{dataset.path}: is sharded for {sharded.size} devices, not "
                                 f"--tensor-parallelism-size {size}; shard the unsharded archive again")
        if output is not None:
            raise SharkportError(f"--output-irpa: {dataset.path} is sharded already; drop --output-irpa")
        return sharded
    if size is None or size == 1:
        if output is not None:
            raise SharkportError("--output-irpa writes tensor-parallel archives: give --tensor-parallelism-size N (N > 1)")
        return None
    if output is None:
        raise SharkportError(f"--tensor-parallelism-size {size} writes the sharded archives: give --output-irpa "
                             "x.irpa (rank r goes to x.rank{r}.irpa)")
    _check(dataset, size)  # before the log line: a refusal is the only line printed
    log(f"sharding {Path(dataset.path).name} over {size} devices into {output} and its rank files")
    return save_sharded(dataset, size, output)


def shard_weights(dataset: Dataset, size: int) -> Iterator[tuple[str, str, list[Weight | None]]]:
    """(name, rule, rank pieces) of every tensor the llama recipe reads, one tensor at a time."""
    for name in dataset.metadata["tensors"]:
        how = rule(name)
        if how is not None:
            yield name, how, split_weight(name, dataset.theta[name], how, size)


def shard_in_memory(dataset: Dataset, size: int) -> ShardedDataset:
    """The sharded view of a dataset without writing files (each rank's pieces are views, and
    replicated tensors are shared): for running the sharded model eagerly. To export, write the
    archives with `save_sharded` and load them, so that every rank's tensors are its own."""
    _check(dataset, size)
    ranks: list[dict[str, Weight]] = [{} for _ in range(size)]
    for name, _, pieces in shard_weights(dataset, size):
        for r, piece in enumerate(pieces):
            if piece is not None:
                ranks[r][name] = piece
    metadata = {**dataset.metadata, "tensors": {}, METADATA_FIELD: _root_field(dataset, size, Path(dataset.path))}
    return ShardedDataset(Path(dataset.path), metadata, [Theta(t) for t in ranks], dataset)


def save_sharded(dataset: Dataset, size: int, root: str | os.PathLike, progress: bool = True) -> ShardedDataset:
    """Writes `root` and its `size` rank archives (see the module docstring) and opens them.
    Streams: one tensor's pieces are in memory at a time, once per rank."""
    root = Path(root)
    _check(dataset, size)
    sources = {Path(dataset.path).resolve()}
    for path in [root] + [rank_path(root, r) for r in range(size)]:
        if path.exists() and path.resolve() in sources:
            raise SharkportError(f"{path}: refusing to overwrite the input file; choose another --output-irpa")
    for r in range(size):
        layouts: dict[str, Any] = {}  # filled as the entries stream; written after them
        metadata = {"sharkport_archive": ARCHIVE_VERSION, "source": root.name, "hparams": dataset.hparams,
                    "tensors": layouts, METADATA_FIELD: {"size": size, "rank": r, "root": root.name}}
        with tqdm(total=len(dataset.metadata["tensors"]), unit="tensor", desc=f"write {rank_path(root, r).name}",
                  disable=not progress) as bar:
            write_archive(rank_path(root, r), _rank_entries(dataset, size, r, layouts, bar), metadata)
    metadata = {**dataset.metadata, "source": dataset.metadata.get("source", Path(dataset.path).name),
                "tensors": {}, METADATA_FIELD: _root_field(dataset, size, root)}
    write_archive(root, iter(()), metadata)
    return ShardedDataset.load(root)


def _rank_entries(dataset: Dataset, size: int, rank: int, layouts: dict[str, Any], bar) -> Iterator:
    for name, _, pieces in shard_weights(dataset, size):
        piece = pieces[rank]
        if piece is not None:
            layouts[shard_name(name, rank)] = _layout(piece)
            yield from entries_of(shard_name(name, rank), piece)
        bar.update(1)


def _check(dataset: Dataset, size: int) -> None:
    if is_sharded(dataset.metadata):
        raise SharkportError(f"{dataset.path}: is already a tensor-parallel archive; export it as it is")
    check_shardable(LlamaHParams.from_metadata(dataset.hparams), size, str(dataset.path))


def _root_field(dataset: Dataset, size: int, root: Path) -> dict[str, Any]:
    tensors = {name: {"split": how, **{k: v for k, v in dataset.metadata["tensors"][name].items()
                                       if k in ("type", "shape")}}
               for name in dataset.metadata["tensors"] if (how := rule(name)) is not None}
    return {"size": size, "ranks": [rank_path(root, r).name for r in range(size)], "tensors": tensors}


def _layout(w: Weight) -> dict[str, Any]:
    """A piece's entry in its rank file's `tensors` metadata (as read_archive expects)."""
    if isinstance(w, QuantizedTensor):  # its rows interleaved as entries_of writes them
        return tensor_layout(w.type_name, w.shape)
    return {"type": _PLAIN_TYPE_OF[str(w.dtype).removeprefix("torch.")], "shape": list(w.shape)}
