"""python -m sharkport.export: trace prefill/decode to MLIR, write the service config, and
optionally compile to a .vmfb. Any `--iree-*` flag is passed through to iree-compile."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..compile import GPU_BACKENDS, resolve_target
from ..errors import SharkportError, cli_main, prog
from ..fileio import atomic_outputs
from ..tools._cli import add_model_source, add_verbose, batch_sizes, load_dataset


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.export"),
        description="Export a model's paged-KV-cache prefill_bs{N}/decode_bs{N} functions to MLIR "
                    "with external parameters (scope 'model'), plus the service config JSON. "
                    "Unrecognised --iree-* flags are passed to iree-compile.")
    add_model_source(parser)
    parser.add_argument("--output-mlir", type=Path, required=True, help="where to write the MLIR")
    parser.add_argument("--output-config", type=Path, required=True, help="where to write the service config JSON")
    parser.add_argument("--output-vmfb", type=Path, help="also compile the MLIR to this .vmfb")
    parser.add_argument("--output-tokenizer-dir", type=Path, metavar="DIR",
                        help="also write the model's tokenizer.json and tokenizer_config.json here "
                             "(what shortfin's LLM server reads; see docs/serving.md)")
    parser.add_argument("--bs-prefill", type=batch_sizes, default=(1, 4), metavar="1,4",
                        help="prefill batch sizes (default 1,4)")
    parser.add_argument("--bs-decode", type=batch_sizes, default=(1, 4), metavar="1,4",
                        help="decode batch sizes (default 1,4)")
    parser.add_argument("--block-seq-stride", type=int, default=32, help="tokens per cache page (default 32)")
    parser.add_argument("--device-block-count", type=int, default=256,
                        help="pages a server should allocate (recorded in the config; default 256)")
    parser.add_argument("--max-seq-len", type=int,
                        help="longest sequence served (default: the model's context length)")
    parser.add_argument("--tensor-parallelism-size", type=int, metavar="N",
                        help="split the model over N devices (attention heads, FFN columns, vocabulary; "
                             "docs/parallel.md): shards it into --output-irpa and N rank files, exports "
                             "functions with one cache_state per device and, with --output-vmfb, compiles for N "
                             "devices. Default: 1, or the size of a tensor-parallel --irpa-file")
    parser.add_argument("--output-irpa", type=Path, metavar="x.irpa",
                        help="with --tensor-parallelism-size N > 1: the root archive to write; rank r's "
                             "weights go to x.rank{r}.irpa beside it")
    parser.add_argument("--activation-dtype", choices=["float32"], default="float32",
                        help="dtype of activations: float32 (float16 and bfloat16 are not offered: "
                             "their llvm-cpu modules exceed the stack limit and crash at run time with IREE 3.9)")
    parser.add_argument("--kv-cache-dtype", choices=["float32", "float16"], default="float16",
                        help="element type of the KV cache (cache_state; default float16, as llama.cpp's "
                             "default cache: K and V rounded to float16). float32 keeps them exact at twice the "
                             "memory and twice the bytes decode attention reads (SmolLM2 Q4_1 with "
                             "--matvec-kernels: decode bs4 1.10x slower over positions 128 to 400; "
                             "docs/performance.md)")
    parser.add_argument("--prefill-final-logits", action="store_true",
                        help="prefill returns only each sequence's last logits [N, 1, V], skipping the "
                             "output projection of the other positions")
    parser.add_argument("--matvec-kernels", action="store_true",
                        help="decode runs hand-written x86-64 kernels (AVX2; AVX-512 VNNI where this machine has it, "
                             "unless SHARKPORT_KERNEL_ISA=avx2), built by the system C compiler "
                             "and linked by iree-compile: products with Q8_0/Q4_0/Q4_1/F16 weights read as "
                             "stored (Q8_0/Q4 through a copy with rows interleaved eight at a time, which the "
                             "module makes as it loads; with quantized weights x is quantized to 8 bits per "
                             "block of 32, as llama.cpp does), q/k/v and gate/up each in one dispatch with the "
                             "RMSNorm before them, the residual adds in the products before them, rotary, "
                             "the cache write and attention over the pages in place; prefill's causal attention too. "
                             "About 3x faster decode on llvm-cpu (SmolLM2 Q4_1 bs1 22.7 -> 6.8 ms) and 1.1 to "
                             "1.25x faster prefill (docs/performance.md). The MLIR then compiles only for x86-64 CPUs")
    parser.add_argument("--target", type=_target, default="llvm-cpu", metavar="TARGET",
                        help="what --output-vmfb runs on (default llvm-cpu: the host CPU, weights dequantized and "
                             "packed at load, 4 bytes each in memory; llvm-cpu-lean keeps them as stored, slower). "
                             "GPUs: BACKEND or BACKEND:CHIP, " + ", ".join(
                                 f"{b}[:{g.default_chip}]" for b, g in GPU_BACKENDS.items())
                             + " (the chip in brackets is the default; docs/devices.md); weights stay as stored "
                               "in device memory and are dequantized in each call")
    add_verbose(parser)
    args, extra = parser.parse_known_args(argv)
    unknown = [f for f in extra if not f.startswith("--iree-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra and not args.output_vmfb:
        raise SharkportError(f"{extra[0]} is an iree-compile flag; it needs --output-vmfb")
    if args.matvec_kernels and args.target.gpu:
        raise SharkportError(f"--matvec-kernels are x86-64 CPU code; leave them out for --target {args.target.name}")

    import torch

    from ..compile import compile_mlir
    from ..formats.keys import LlamaHParams
    from ..models import ModelConfig
    from ..parallel.archive import open_or_shard
    from . import export_model, save_export
    from .abi import ExportConfig

    if args.matvec_kernels:  # builds the kernels' object now: a missing C compiler fails before the export
        from ..kernels import object_path

        object_path()
    dataset = load_dataset(args)
    sharded = open_or_shard(dataset, args.tensor_parallelism_size, args.output_irpa, _log)  # None: unsharded
    if args.output_tokenizer_dir:  # first: it is quick and fails before the slow export does
        from ..tokenizer import write_hf_tokenizer

        written = write_hf_tokenizer(dataset.tokenizer(), args.output_tokenizer_dir)
        _log(f"wrote {' and '.join(str(p) for p in written)}")
    stride = args.block_seq_stride
    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        max_seq_len = LlamaHParams.from_metadata(dataset.hparams).context_length // stride * stride
    config = ExportConfig(bs_prefill=args.bs_prefill, bs_decode=args.bs_decode, block_seq_stride=stride,
                          device_block_count=args.device_block_count, max_seq_len=max_seq_len,
                          matvec_kernels=args.matvec_kernels)
    model_config = ModelConfig(block_seq_stride=stride, dtype=getattr(torch, args.activation_dtype),
                               kv_cache_dtype=getattr(torch, args.kv_cache_dtype),
                               prefill_final_logits=args.prefill_final_logits)
    t0 = time.perf_counter()
    _log(f"exporting {dataset.path.name}: prefill {list(config.bs_prefill)}, decode {list(config.bs_decode)}")
    if sharded is None:
        output, service = export_model(dataset, config, model_config)
    else:
        from ..parallel.export import export_sharded

        output, service = export_sharded(sharded, config, model_config)
    # The outputs are one set: all appear when everything is done, or none (a module beside a
    # config it was not made with would not run).
    outputs = [args.output_mlir, args.output_config] + ([args.output_vmfb] if args.output_vmfb else [])
    with atomic_outputs(*outputs) as temporaries:
        mlir, config_json = temporaries[:2]
        save_export(output, service, mlir, config_json)
        _log(f"exported in {time.perf_counter() - t0:.1f} s")
        if args.output_vmfb:
            t0 = time.perf_counter()
            _log(f"compiling for {args.target.name} ...")
            compile_mlir(mlir, temporaries[2], args.target.name, extra, devices=service.tensor_parallelism_size,
                         name=str(args.output_mlir))
            _log(f"compiled in {time.perf_counter() - t0:.1f} s")
    _log(f"wrote {', '.join(str(p) for p in outputs)}")
    return 0


def _target(spec: str):
    """argparse type of --target: the resolved target, or the reason it is not one."""
    try:
        return resolve_target(spec)
    except SharkportError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--target {spec}: ")) from None


if __name__ == "__main__":
    sys.exit(main())
