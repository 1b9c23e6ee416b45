"""A model's prefill/decode exported to MLIR with its service config, and optionally compiled to
a .vmfb: the files `python -m sharkport.export` writes."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from ..errors import SharkportError
from ..fileio import atomic_outputs
from . import compile_mlir, resolve_target


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def kernels_apply(target: str, one_device: bool) -> bool:
    """Whether an export takes the x86-64 kernels when not told: for a CPU target, on one device
    (tensor-parallel exports keep IREE's code), where this machine builds them (an x86-64 host with
    a C compiler)."""
    from ..kernels import available

    return not resolve_target(target).gpu and one_device and available()


def export_files(source: Path, output_mlir: Path, output_config: Path, output_vmfb: Path | None = None, *,
                 bs_prefill: tuple[int, ...] = (1, 4), bs_decode: tuple[int, ...] = (1, 4),
                 block_seq_stride: int = 32, device_block_count: int = 256, max_seq_len: int | None = None,
                 tensor_parallelism_size: int | None = None, output_irpa: Path | None = None,
                 output_tokenizer_dir: Path | None = None, activation_dtype: str = "float32",
                 kv_cache_dtype: str = "float16", prefill_final_logits: bool = False,
                 matvec_kernels: bool | None = None,
                 target: str = "llvm-cpu", iree_flags: Sequence[str] = (),
                 log: Callable[[str], None] = _log) -> list[Path]:
    """Exports the model at `source` (a GGUF file, archive or checkpoint folder) to `output_mlir`
    and `output_config` and, with `output_vmfb`, compiles it for `target` (with `iree_flags`
    passed to iree-compile). `max_seq_len` defaults to the model's context length. With
    `tensor_parallelism_size` N > 1 the model is sharded into `output_irpa` and its rank files.
    `matvec_kernels` None: the kernels where they apply (kernels_apply). Returns the files written:
    all of them once everything is done, or none."""
    if matvec_kernels and resolve_target(target).gpu:
        raise SharkportError(f"--matvec-kernels are x86-64 CPU code; leave them out for --target {target}")

    import torch

    from ..archive import Dataset
    from ..export import export_model, save_export
    from ..export.abi import ExportConfig
    from ..formats.keys import LlamaHParams
    from ..models import ModelConfig
    from ..parallel.archive import open_or_shard

    from ..kernels import object_path

    dataset = Dataset.load(source)
    if output_tokenizer_dir:  # first: it is quick and fails before the slow work (kernels, sharding, export)
        from ..tokenizer import write_hf_tokenizer

        written = write_hf_tokenizer(dataset.tokenizer(), output_tokenizer_dir)
        log(f"wrote {' and '.join(str(p) for p in written)}")
    if matvec_kernels:  # builds the kernels' object now: a missing C compiler fails before the export
        object_path(log)
    sharded = open_or_shard(dataset, tensor_parallelism_size, output_irpa, log)  # None: unsharded
    if matvec_kernels is None:
        matvec_kernels = kernels_apply(target, sharded is None)
        if matvec_kernels:
            object_path(log)
    stride = block_seq_stride
    if max_seq_len is None:
        max_seq_len = LlamaHParams.from_metadata(dataset.hparams).context_length // stride * stride
    config = ExportConfig(bs_prefill=bs_prefill, bs_decode=bs_decode, block_seq_stride=stride,
                          device_block_count=device_block_count, max_seq_len=max_seq_len,
                          matvec_kernels=matvec_kernels, dequant_in_products=resolve_target(target).as_stored)
    model_config = ModelConfig(block_seq_stride=stride, dtype=getattr(torch, activation_dtype),
                               kv_cache_dtype=getattr(torch, kv_cache_dtype),
                               prefill_final_logits=prefill_final_logits)
    t0 = time.perf_counter()
    log(f"exporting {dataset.path.name}: prefill {list(config.bs_prefill)}, decode {list(config.bs_decode)}"
        + (" with the x86-64 kernels" if matvec_kernels else ""))
    if sharded is None:
        output, service = export_model(dataset, config, model_config)
    else:
        from ..parallel.export import export_sharded

        output, service = export_sharded(sharded, config, model_config)
    # The outputs are one set: all appear when everything is done, or none (a module beside a
    # config it was not made with would not run).
    outputs = [output_mlir, output_config] + ([output_vmfb] if output_vmfb else [])
    with atomic_outputs(*outputs) as temporaries:
        mlir, config_json = temporaries[:2]
        save_export(output, service, mlir, config_json)
        log(f"exported in {time.perf_counter() - t0:.1f} s")
        if output_vmfb:
            t0 = time.perf_counter()
            log(f"compiling for {target} ...")
            compile_mlir(mlir, temporaries[2], target, list(iree_flags), devices=service.tensor_parallelism_size,
                         name=str(output_mlir))
            log(f"compiled in {time.perf_counter() - t0:.1f} s")
    log(f"wrote {', '.join(str(p) for p in outputs)}")
    return outputs
