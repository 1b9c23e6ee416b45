"""python -m sharkport.datasets (also `sharkport datasets`): list or fetch the registered models.

    python -m sharkport.datasets list
    python -m sharkport.datasets fetch NAME [--local-dir D]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import cli_main, prog
from . import FILE_KINDS, RegisteredDataset, fetch, load_registry, registry_path


def _list(registry: dict[str, RegisteredDataset]) -> None:
    for ds in sorted({d.name: d for d in registry.values()}.values(), key=lambda d: d.name):
        revision = ds.revision if ds.pinned else f"{ds.revision} (not pinned)"
        print(ds.name)
        if ds.aliases:
            print(f"  aliases:  {', '.join(ds.aliases)}")
        print(f"  repo:     {ds.repo_id} @ {revision}")
        for kind in FILE_KINDS:
            if kind in ds.files:
                print(f"  {kind + ':':<9} {', '.join(ds.files[kind])}")
        if ds.description:
            print(f"  about:    {ds.description}")


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.datasets"),
        description=f"Registered models (from {registry_path()}, or SHARKPORT_DATASETS). Files are "
                    "fetched with huggingface_hub into the Hugging Face cache (HF_HOME / HF_HUB_CACHE); "
                    "HF_HUB_OFFLINE=1 uses only the cache.")
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print every registered dataset with its repo, revision and files")
    fetch_p = sub.add_parser("fetch", help="download a dataset's files (or find them in the cache)")
    fetch_p.add_argument("name", help="a dataset name or alias from `list`")
    fetch_p.add_argument("--local-dir", type=Path, metavar="D",
                         help="put the files in D instead of the Hugging Face cache")
    fetch_p.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    args = parser.parse_args(argv)

    if args.command == "list":
        _list(load_registry())
        return 0
    fetched = fetch(args.name, args.local_dir)
    for kind, paths in fetched.paths.items():
        for p in paths:
            print(f"{kind}: {p}")
    print(f"model: {fetched.model_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
