"""Registered models: names in `datasets.yaml` → a Hugging Face repo, a revision and its files,
fetched with `huggingface_hub` into the standard Hugging Face cache.

    python -m sharkport.datasets list
    python -m sharkport.datasets fetch NAME [--local-dir D]

Every tool that takes a model also takes `--hf-dataset NAME` (see sharkport/tools/_cli.py).
Downloads go through `hf_hub_download` (progress bars, resumable, `HF_HOME` / `HF_HUB_CACHE`,
`HF_ENDPOINT`); once fetched, `HF_HUB_OFFLINE=1` serves everything from the cache. The
registry file is `datasets.yaml` in this package (installed with it), or the file named by
`SHARKPORT_DATASETS`. The command line is `__main__.py`.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SharkportError

__all__ = ["FILE_KINDS", "RegisteredDataset", "Fetched", "dataset_archive", "dataset_model_path",
           "fetch", "get_dataset", "load_registry", "registry_path"]

# What each kind of file is for. A dataset has either `gguf` or `safetensors` (+ `config`).
FILE_KINDS = ("gguf", "config", "safetensors", "tokenizer")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class RegisteredDataset:
    """One entry of datasets.yaml."""

    name: str
    repo_id: str
    revision: str
    files: dict[str, tuple[str, ...]]  # kind → file names in the repo
    aliases: tuple[str, ...] = ()
    description: str = ""

    @property
    def pinned(self) -> bool:
        """True when `revision` is a commit hash (a branch or tag name can move)."""
        return bool(_COMMIT.fullmatch(self.revision))

    @property
    def filenames(self) -> list[str]:
        return [f for kind in FILE_KINDS for f in self.files.get(kind, ())]


@dataclass(frozen=True)
class Fetched:
    """A fetched dataset: the local path of every file, by kind."""

    dataset: RegisteredDataset
    paths: dict[str, list[Path]]

    @property
    def model_path(self) -> Path:
        """The GGUF file, or the checkpoint folder (where config.json is) of a safetensors model."""
        if "gguf" in self.paths:
            return self.paths["gguf"][0]
        return self.paths["config"][0].parent


def registry_path() -> Path:
    env = os.environ.get("SHARKPORT_DATASETS")
    return Path(env) if env else Path(__file__).resolve().parent / "datasets.yaml"


def load_registry(path: str | os.PathLike | None = None) -> dict[str, RegisteredDataset]:
    """Name and every alias → its dataset. Raises SharkportError naming the file and entry when
    the registry is malformed."""
    import yaml

    path = Path(path) if path else registry_path()
    if not path.is_file():
        raise SharkportError(f"{path}: dataset registry not found; set SHARKPORT_DATASETS to a datasets.yaml")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise SharkportError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise SharkportError(f"{path}: expected a mapping of dataset names to entries")
    registry: dict[str, RegisteredDataset] = {}
    for name, entry in raw.items():
        ds = _parse_entry(path, str(name), entry)
        for key in (ds.name, *ds.aliases):
            if key in registry:
                raise SharkportError(f"{path}: name {key!r} is used twice (entry {name!r})")
            registry[key] = ds
    return registry


def _parse_entry(path: Path, name: str, entry: Any) -> RegisteredDataset:
    where = f"{path}: dataset {name!r}"
    if not isinstance(entry, dict) or not entry.get("repo_id") or not entry.get("revision"):
        raise SharkportError(f"{where} needs repo_id, revision and files")
    files_raw = entry.get("files")
    if not isinstance(files_raw, dict) or not files_raw:
        raise SharkportError(f"{where} needs files: a mapping of kind ({', '.join(FILE_KINDS)}) to file names")
    files: dict[str, tuple[str, ...]] = {}
    for kind, names in files_raw.items():
        if kind not in FILE_KINDS:
            raise SharkportError(f"{where} has an unknown file kind {kind!r} (known: {', '.join(FILE_KINDS)})")
        files[kind] = (names,) if isinstance(names, str) else tuple(str(n) for n in names)
    if "gguf" not in files and not {"config", "safetensors"} <= set(files):
        raise SharkportError(f"{where} needs a gguf file, or config and safetensors files")
    aliases = entry.get("aliases") or []
    return RegisteredDataset(name, str(entry["repo_id"]), str(entry["revision"]), files,
                             tuple(str(a) for a in aliases), str(entry.get("description", "")))


def get_dataset(name: str) -> RegisteredDataset:
    """The registered dataset called `name` (or with that alias); an unknown name is a
    SharkportError that lists the known ones."""
    registry = load_registry()
    if name not in registry:
        known = sorted({d.name for d in registry.values()})
        raise SharkportError(
            f"unknown dataset {name!r}; known datasets: {', '.join(known)} "
            f"(see `python -m sharkport.datasets list` or {registry_path()})"
        )
    return registry[name]


def fetch(name: str, local_dir: str | os.PathLike | None = None) -> Fetched:
    """Downloads every file of the dataset with `hf_hub_download` (into the Hugging Face cache,
    or into `local_dir`), or finds it already there; with HF_HUB_OFFLINE=1 only the cache is used."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    ds = get_dataset(name)
    paths: dict[str, list[Path]] = {}
    for kind in FILE_KINDS:
        for filename in ds.files.get(kind, ()):
            try:
                local = hf_hub_download(ds.repo_id, filename, revision=ds.revision,
                                        local_dir=str(local_dir) if local_dir else None)
            except LocalEntryNotFoundError:
                raise SharkportError(
                    f"dataset {ds.name}: {filename} is not in the Hugging Face cache and cannot be "
                    f"downloaded (offline, HF_HUB_OFFLINE=1, or the hub is unreachable); fetch it once "
                    f"online with `python -m sharkport.datasets fetch {ds.name}`"
                ) from None
            except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as e:
                raise SharkportError(
                    f"dataset {ds.name}: {ds.repo_id}@{ds.revision} has no {filename} "
                    f"({type(e).__name__}); fix its entry in {registry_path()}"
                ) from None
            paths.setdefault(kind, []).append(Path(local))
    return Fetched(ds, paths)


def dataset_model_path(name: str) -> Path:
    """Fetches the dataset; returns its GGUF file or checkpoint folder (what Dataset.load opens)."""
    return fetch(name).model_path


def cache_dir() -> Path:
    """Where sharkport keeps archives imported from fetched datasets (SHARKPORT_CACHE, default
    ~/.cache/sharkport)."""
    env = os.environ.get("SHARKPORT_CACHE")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sharkport"


def dataset_archive(name: str, progress: bool = True) -> Path:
    """The .irpa of a fetched dataset, imported once into cache_dir() and reused afterwards.
    The file name includes a hash of the fetched model's path, which names its commit."""
    fetched = fetch(name)
    model = fetched.model_path.resolve()
    key = hashlib.sha256(str(model).encode()).hexdigest()[:12]
    irpa = cache_dir() / f"{fetched.dataset.name}-{key}.irpa"
    if not irpa.is_file():
        from ..archive import import_gguf, import_hf  # an HF import needs torch; reuse does not

        print(f"importing {fetched.dataset.name} into {irpa}", file=sys.stderr)
        (import_hf if model.is_dir() else import_gguf)(model, irpa, progress=progress)
    return irpa
