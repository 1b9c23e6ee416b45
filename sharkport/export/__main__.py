"""python -m sharkport.export: trace prefill/decode to MLIR, write the service config, and
optionally compile to a .vmfb. Any `--iree-*` flag is passed through to iree-compile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..compile import GPU_BACKENDS, resolve_target
from ..compile.build import export_files
from ..errors import SharkportError, cli_main, prog
from ..tools._cli import add_model_source, add_verbose, batch_sizes, model_path


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("sharkport.export"),
        description="Export a model's paged-KV-cache prefill_bs{N}/decode_bs{N} functions to MLIR "
                    "with external parameters (scope 'model'), plus the service config JSON. "
                    "Unrecognised --iree-* flags (as --iree-flag=value) are passed to iree-compile.")
    add_model_source(parser)
    parser.add_argument("--output-mlir", type=Path, required=True, help="where to write the MLIR")
    parser.add_argument("--output-config", type=Path, required=True, help="where to write the service config JSON")
    parser.add_argument("--output-vmfb", type=Path, help="also compile the MLIR to this .vmfb")
    parser.add_argument("--output-tokenizer-dir", type=Path, metavar="DIR", help="also write the model's tokenizer.json"
                        " and tokenizer_config.json here (what shortfin's LLM server reads; see docs/serving.md)")
    for kind in ("prefill", "decode"):
        parser.add_argument(f"--bs-{kind}", type=batch_sizes, default=(1, 4), metavar="1,4",
                            help=f"{kind} batch sizes (default 1,4)")
    parser.add_argument("--block-seq-stride", type=int, default=32, help="tokens per cache page (default 32)")
    parser.add_argument("--device-block-count", type=int, default=256,
                        help="pages a server should allocate (recorded in the config; default 256)")
    parser.add_argument("--max-seq-len", type=int, help="longest sequence served (default: the model's context length)")
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
                             "memory and twice the bytes decode attention reads")
    parser.add_argument("--prefill-final-logits", action="store_true", help="prefill returns only each sequence's last "
                        "logits [N, 1, V], skipping the output projection of the other positions")
    parser.add_argument("--matvec-kernels", action=argparse.BooleanOptionalAction, default=None,
                        help="hand-written x86-64 kernels (AVX2; AVX-512 VNNI where the exporting CPU has it, "
                             "unless SHARKPORT_KERNEL_ISA=avx2), built by the system C compiler and linked by "
                             "iree-compile, for decode and prefill: products with Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q2_K/"
                             "Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS/F16/BF16 weights read as stored (with quantized weights x is "
                             "quantized to 8 bits per block of 32 or 256, as llama.cpp does), so the module holds no float32 copy of them; "
                             "in decode a llama layer in one dispatch with its norms, rotary, the cache write and "
                             "attention over the pages; prefill's causal attention. Several times faster decode, "
                             "faster prefill with quantized weights, a faster compile and about half the memory "
                             "(docs/performance.md); the "
                             "MLIR then compiles only for x86-64 CPUs. Default: on for a CPU target on one device "
                             "where the exporting host is x86-64 with a C compiler on PATH, else off; --no-matvec-kernels: IREE's code only")
    parser.add_argument("--target", type=_target, default="llvm-cpu", metavar="TARGET",
                        help="what the export and --output-vmfb are for (default llvm-cpu: the host CPU; weights that IREE's "
                             "own code multiplies by (all of them with --no-matvec-kernels) are dequantized and "
                             "packed at load, 4 bytes each in memory, where llvm-cpu-lean keeps them as stored, "
                             "slower). "
                             "GPUs: BACKEND or BACKEND:CHIP, " + ", ".join(
                                 f"{b}[:{g.default_chip}]" for b, g in GPU_BACKENDS.items())
                             + " (the chip in brackets is the default; docs/devices.md); weights stay as stored "
                               "in device memory and are dequantized in each call. For llvm-cpu-lean and the GPUs, "
                               "decode's products of one row by Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 weights dequantize inside "
                               "the product, one dispatch each")
    add_verbose(parser)
    args, extra = parser.parse_known_args(argv)
    unknown = [f for f in extra if not f.startswith("--iree-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra and not args.output_vmfb:
        raise SharkportError(f"{extra[0]} is an iree-compile flag; it needs --output-vmfb")

    export_files(model_path(args), args.output_mlir, args.output_config, args.output_vmfb, bs_prefill=args.bs_prefill,
                 bs_decode=args.bs_decode, block_seq_stride=args.block_seq_stride, max_seq_len=args.max_seq_len,
                 device_block_count=args.device_block_count, tensor_parallelism_size=args.tensor_parallelism_size,
                 output_irpa=args.output_irpa, output_tokenizer_dir=args.output_tokenizer_dir,
                 activation_dtype=args.activation_dtype, kv_cache_dtype=args.kv_cache_dtype,
                 prefill_final_logits=args.prefill_final_logits, matvec_kernels=args.matvec_kernels,
                 target=args.target.name, iree_flags=extra)
    return 0


def _target(spec: str):
    """argparse type of --target: the resolved target, or the reason it is not one."""
    try:
        return resolve_target(spec)
    except SharkportError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--target {spec}: ")) from None


if __name__ == "__main__":
    sys.exit(main())
