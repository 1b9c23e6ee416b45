"""The exporter: traces a recipe with iree-turbine's FxProgramsBuilder into one MLIR module."""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from pathlib import Path

import torch
from iree.turbine import aot
from iree.turbine.aot import ExternalTensorTrait, FxProgramsBuilder
from iree.turbine.aot.decompositions import current_aot_decompositions, extend_aot_decompositions

from .. import kernels
from ..archive import Dataset, QuantizedTensor
from ..fileio import atomic_output
from ..models import CausalLM, ModelConfig, build_model
from ..quant import plane_key
from .blocks import BlockTracer, export_block, programs
from .kernels import use_kernels
from .stored import use_stored_products
from .abi import (REFLECTION_KEY, ExportConfig, ServiceConfig, dtype_name, dynamic_shapes, example_args,
                  module_facts)

PARAMETER_SCOPE = "model"

__all__ = ["ExportConfig", "ServiceConfig", "export_model", "externalize", "save_export"]


def externalize(dataset: Dataset) -> None:
    """Marks every weight (and every plane of a quantized one) as the archive parameter
    `model::<gguf name>` (`model::<plane_key>`), so the traced program loads it by name instead of inlining it."""
    for name, w in dataset.theta.items():
        if isinstance(w, QuantizedTensor):
            for plane, t in w.planes.items():
                ExternalTensorTrait(PARAMETER_SCOPE, plane_key(name, plane, w.interleaved, w.type_name)).set(t)
        else:
            ExternalTensorTrait(PARAMETER_SCOPE, name).set(w)


def service_config(model: CausalLM, config: ExportConfig) -> ServiceConfig:
    cache = model.cache
    return ServiceConfig(
        max_seq_len=config.max_seq_len,
        attn_head_dim=cache.head_dim,
        prefill_batch_sizes=list(config.bs_prefill),
        decode_batch_sizes=list(config.bs_decode),
        transformer_block_count=cache.block_count,
        attention_head_count_kv=cache.kv_heads,
        block_seq_stride=cache.stride,
        device_block_count=config.device_block_count,
        kv_cache_dtype=dtype_name(model.config.kv_cache_dtype),
        page_elems=cache.page_elems,
        vocab_size=model.vocab_size,
    )


def export_model(dataset: Dataset, config: ExportConfig,
                 model_config: ModelConfig | None = None) -> tuple[aot.ExportOutput, ServiceConfig]:
    """Traces the dataset's recipe into one MLIR module with a prefill and a decode function per
    batch size. Returns turbine's export output (save_mlir / mlir_module) and the service config."""
    model_config = model_config or ModelConfig(block_seq_stride=config.block_seq_stride)
    model = build_model(dataset, model_config)
    externalize(dataset)
    page_elems, cache_dtype = model.cache.page_elems, model_config.kv_cache_dtype

    def program_args(kind: str, bs: int):
        return example_args(config, kind, bs, page_elems, cache_dtype), dynamic_shapes(config, kind), None

    return trace_programs(model, config, program_args), service_config(model, config)


def trace_programs(model: CausalLM, config: ExportConfig, program_args) -> aot.ExportOutput:
    """Traces `model`'s prefill_bs{N} and decode_bs{N} for the config's batch sizes into one MLIR
    module. `program_args(kind, bs)` gives each function's example args, dynamic shapes and
    argument devices (None: one device). With `config.matvec_kernels`, the model's layers are
    swapped for the kernels' (export.kernels.use_kernels); else with `config.dequant_in_products`,
    its products of one row (export.stored.use_stored_products).

    Unless `config.unroll_blocks`, the model's blocks are traced once per function and structure
    and called for every layer (sharkport.export.blocks)."""
    transform = (use_kernels if config.matvec_kernels else use_stored_products if config.dequant_in_products
                 else (lambda module: module))
    model = transform(model)
    tracer = None if config.unroll_blocks else BlockTracer(model, transform)
    fxb = FxProgramsBuilder(model)
    decompositions = current_aot_decompositions()

    def decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        with warnings.catch_warnings():
            # torch's own deepcopy of the call graph trips its LeafSpec deprecation; nothing to act on
            warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
            return without_dtype_asserts(program).run_decompositions(decompositions)

    # turbine decomposes each program right after tracing it when its table is not empty; with an
    # empty one it does not, and the dtype asserts are erased before decomposing (below).
    # Block calls update the cache in place: functionalized as auto_functionalized (v1), the form
    # turbine's importer knows.
    with (extend_aot_decompositions(from_current=False),
          torch._export.config.patch(enable_auto_functionalized_v2_for_export=False), _no_stack_traces()):
        _trace_all(fxb, config, program_args, tracer)
        blocks = {name: export_block(block, decompose) for name, block in tracer.blocks.items()} if tracer else {}
        for target in fxb.programs.values():
            target.target = decompose(target.target)
    with torch.no_grad(), programs(blocks, tracer.params if tracer else {}):
        output = aot.export(fxb)
    _verify(output.mlir_module)
    return output


def _verify(module) -> None:
    """Fails here, not in iree-compile, on a module that does not verify (MLIR would print it in
    the generic form without a word). Single-threaded: see sharkport.mlir_ops."""
    context = module.context
    context.enable_multithreading(False)
    try:
        module.verify()
    finally:
        context.enable_multithreading(True)


@contextlib.contextmanager
def _no_stack_traces():
    """torch.fx records the Python stack of every traced node (at a cost in tracing time) for
    turbine to make MLIR locations of, which the saved MLIR does not print."""
    before, torch.fx.config.do_not_emit_stack_traces = torch.fx.config.do_not_emit_stack_traces, True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def without_dtype_asserts(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Erases (in place) the `aten._assert_tensor_metadata` node torch.export puts before every
    `.to(dtype)`: a runtime check of the dtype the trace already knows, a large share of the
    exported ops, each costing decomposition and import time and computing nothing."""
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
    program.graph_module.recompile()
    return program


def _trace_all(fxb: FxProgramsBuilder, config: ExportConfig, program_args, tracer: BlockTracer | None) -> None:
    def prefill(module, tokens, seq_lens, seq_block_ids, cache_state):
        return module.prefill(tokens, seq_lens, seq_block_ids, cache_state)

    def decode(module, tokens, seq_lens, start_positions, seq_block_ids, cache_state):
        if config.matvec_kernels:
            seq_lens, start_positions, seq_block_ids = kernels.decode_indices(seq_lens, start_positions,
                                                                              seq_block_ids)
        return module.decode(tokens, seq_lens, start_positions, seq_block_ids, cache_state)

    for kind, sizes, fn in (("prefill", config.bs_prefill, prefill), ("decode", config.bs_decode, decode)):
        for bs in sizes:
            args, shapes, devices = program_args(kind, bs)
            name = f"{kind}_bs{bs}"
            if tracer is not None:
                tracer.program = name
            fxb.export_program(name=name, strict=False, args=args, dynamic_shapes=shapes, arg_device=devices)(fn)


def save_export(output: aot.ExportOutput, service: ServiceConfig,
                mlir_path: str | os.PathLike, config_path: str | os.PathLike) -> None:
    """Writes the MLIR, its functions carrying the ABI's facts (abi.MODULE_FACTS), and the service
    config JSON, each atomically."""
    _reflect(output, service)
    with atomic_output(mlir_path) as tmp:
        output.save_mlir(tmp)
        Path(tmp).write_text(share_constants(Path(tmp).read_text()))
    with atomic_output(config_path) as tmp:
        Path(tmp).write_text(json.dumps(service.to_json(), indent=2) + "\n")


_RESOURCE = re.compile(r'^\s*([\w.]+): "(0x[0-9A-Fa-f]*)",?$', re.M)


def share_constants(mlir: str) -> str:
    """The MLIR text with each distinct constant (`dense_resource` blob) held once. Every traced
    function gets its own copy of the dequantization's small tables from the importer, which
    makes each function's dequantization of a weight a different expression to IREE: llvm-cpu
    then packs every weight once per function rather than once (docs/performance.md)."""
    body, marker, resources = mlir.rpartition("{-#")
    if not marker:
        return mlir
    first: dict[str, str] = {}
    name_of = {name: first.setdefault(blob, name) for name, blob in _RESOURCE.findall(resources)}
    body = re.sub(r"dense_resource<([\w.]+)>", lambda m: f"dense_resource<{name_of.get(m[1], m[1])}>", body)
    kept = [f'      {name}: "{blob}"' for blob, name in first.items()]
    lines = resources.splitlines()
    entries = [i for i, line in enumerate(lines) if _RESOURCE.match(line)]
    if entries and entries[-1] - entries[0] + 1 == len(entries):  # one block of blobs: drop the copies
        lines[entries[0]:entries[-1] + 1] = [",\n".join(kept)]
    return body + marker + "\n".join(lines) + ("\n" if resources.endswith("\n") else "")


def _reflect(output: aot.ExportOutput, service: ServiceConfig) -> None:
    """Puts the module's facts into each prefill/decode function's `iree.reflection`, which IREE
    keeps in the .vmfb, so the runner checks a config against the module itself."""
    from iree.compiler import ir

    module = output.mlir_module
    facts = json.dumps(module_facts(service), sort_keys=True)
    with module.context:
        for op in module.regions[0].blocks[0].operations:
            if op.operation.name != "func.func" or "sym_name" not in op.attributes:
                continue
            if ir.StringAttr(op.attributes["sym_name"]).value.startswith(("prefill_bs", "decode_bs")):
                entries = {}
                if "iree.reflection" in op.attributes:
                    entries = {a.name: a.attr for a in ir.DictAttr(op.attributes["iree.reflection"])}
                entries[REFLECTION_KEY] = ir.StringAttr.get(facts)
                op.attributes["iree.reflection"] = ir.DictAttr.get(entries)
