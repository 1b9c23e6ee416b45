"""Export a tensor-parallel llama as one multi-device program.

    prefill_bs{B}(tokens, seq_lens, seq_block_ids, cache_state_0, ..., cache_state_{N-1})
    decode_bs{B}(tokens, seq_lens, start_positions, seq_block_ids, cache_state_0, ..., cache_state_{N-1})

The first arguments and the logits are on device 0 (`iree.abi.affinity` `__device_0`), and
cache_state_r [pages, page_elems / N] on device r. Rank r's weights are the parameters
`model::<gguf name>.shard.{r}`, placed on device r.
"""

from __future__ import annotations

from dataclasses import replace

from iree.turbine import aot
from iree.turbine.aot import DeviceAffinity, DeviceTensorTrait, ExternalTensorTrait

from ..archive import QuantizedTensor
from ..quant import plane_key
from ..export.abi import DECODE_ARGS, PREFILL_ARGS, ExportConfig, ServiceConfig, dynamic_shapes, example_args
from ..export.exporter import PARAMETER_SCOPE, service_config, trace_programs
from ..models import ModelConfig
from .archive import ShardedDataset
from .llama import ShardedLlama
from .sharding import shard_name


def externalize_ranks(sharded: ShardedDataset) -> None:
    """Marks rank r's weights (and planes) as parameters `model::<name>.shard.{r}[:<plane>]` on
    device r. Each rank's tensors must be its own objects (load the archives; see
    `save_sharded`), since a tensor carries one name and one device."""
    for r, theta in enumerate(sharded.ranks):
        for name, w in theta.items():
            keyed = ([(plane_key(shard_name(name, r), p, w.interleaved, w.type_name), t) for p, t in w.planes.items()]
                     if isinstance(w, QuantizedTensor) else [(shard_name(name, r), w)])
            for key, t in keyed:
                ExternalTensorTrait(PARAMETER_SCOPE, key).set(t)
                DeviceTensorTrait(r).set(t)


def _sharded_args(config: ExportConfig, kind: str, batch: int, model: ShardedLlama):
    """Example args, dynamic shapes and argument devices: the ABI's, with cache_state a list of
    one cache per device (flattened by the exporter into N arguments)."""
    *inputs, cache = example_args(config, kind, batch, model.cache.page_elems, model.config.kv_cache_dtype)
    shapes = dynamic_shapes(config, kind)
    shapes["cache_state"] = [shapes["cache_state"]] * model.n  # one Dim: every device has the same pages
    devices = {i: DeviceAffinity(0) for i in range(len(inputs))}
    devices.update({len(inputs) + r: DeviceAffinity(r) for r in range(model.n)})
    return (*inputs, [cache.clone() for _ in range(model.n)]), shapes, devices


def export_sharded(sharded: ShardedDataset, config: ExportConfig,
                   model_config: ModelConfig | None = None) -> tuple[aot.ExportOutput, ServiceConfig]:
    """Traces the tensor-parallel llama into one MLIR module for `sharded.size` devices, with a
    prefill and a decode function per batch size. Returns turbine's export output and the
    service config (one page size per device)."""
    model_config = model_config or ModelConfig(block_seq_stride=config.block_seq_stride)
    model = ShardedLlama(sharded, model_config)
    externalize_ranks(sharded)
    assert PREFILL_ARGS[-1] == DECODE_ARGS[-1] == "cache_state"
    output = trace_programs(model, config, lambda kind, bs: _sharded_args(config, kind, bs, model))
    # The config counts the model's kv heads; each device's cache holds Hkv/N of them.
    service = replace(service_config(model, config), attention_head_count_kv=model.hp.head_count_kv,
                      tensor_parallelism_size=model.n)
    return output, service
