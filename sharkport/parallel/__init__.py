"""Tensor parallelism: a llama split over N devices (docs/parallel.md).

`save_sharded` writes the rank archives and their root, `ShardedDataset.load` opens them,
`ShardedLlama` runs them (eagerly or traced) and `export_sharded` traces the multi-device
program. The exporter needs torch and iree-turbine; names load on first use.
"""

_NAMES = {
    "ShardedDataset": "archive", "save_sharded": "archive", "shard_in_memory": "archive", "rank_path": "archive",
    "is_sharded": "archive", "ShardedLlama": "llama", "export_sharded": "export", "check_shardable": "sharding",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
