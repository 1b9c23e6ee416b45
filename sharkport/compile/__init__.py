"""Compile exported MLIR to a .vmfb with IREE, from target presets."""

from __future__ import annotations

import os

from ..errors import SharkportError
from ..fileio import atomic_output

# Presets name whole flag sets; `extra_flags` passes anything else straight to iree-compile.
_LLVM_CPU_HOST = [
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",
]
TARGETS: dict[str, list[str]] = {
    # Fast on CPU: weights are dequantized (or widened from f16) and packed for the matmul
    # microkernels once, when the module loads, so every call reads float32 weights in the
    # layout the kernels want. Costs 4 bytes of memory per weight. Measured on a 4-layer cut of
    # SmolLM2 Q4_1 (docs/performance.md): decode 58 -> 13 ms, prefill of 128 tokens 287 -> 113 ms.
    # Data tiling from global optimization: IREE 3.9's dispatch-creation path (what
    # --iree-opt-data-tiling picks) fails on attention's batched matmuls with small head dims
    # ('affine.delinearize_index' op no basis element may be statically non-positive).
    "llvm-cpu": _LLVM_CPU_HOST + [
        "--iree-global-opt-data-tiling",
        "--iree-llvmcpu-enable-ukernels=all",
        "--iree-opt-const-expr-max-size-increase-threshold=1099511627776",
    ],
    # Lean on memory: weights stay as stored (quantized planes, f16) and are dequantized inside
    # every call; about 4.5x slower decode.
    "llvm-cpu-lean": list(_LLVM_CPU_HOST),
    "cuda": ["--iree-hal-target-device=cuda"],
    "rocm": ["--iree-hal-target-device=hip"],
    "vulkan": ["--iree-hal-target-device=vulkan"],
}


def compile_flags(target: str = "llvm-cpu", extra_flags: list[str] | None = None, devices: int = 1) -> list[str]:
    """The preset's flags plus `extra_flags`. With `devices` > 1 (a tensor-parallel module) the
    target device is declared once per logical device: `--iree-hal-target-device=local[0]`,
    `local[1]`, ... (the module's `__device_0`, `__device_1`, ...)."""
    if target not in TARGETS:
        raise SharkportError(f"unknown --target {target!r} (known: {', '.join(TARGETS)})")
    flags = []
    for f in TARGETS[target]:
        per_device = devices > 1 and f.startswith("--iree-hal-target-device=")
        flags += [f"{f}[{i}]" for i in range(devices)] if per_device else [f]
    return flags + list(extra_flags or [])


def compile_mlir(mlir_path: str | os.PathLike, vmfb_path: str | os.PathLike,
                 target: str = "llvm-cpu", extra_flags: list[str] | None = None, devices: int = 1) -> list[str]:
    """iree-compile mlir → vmfb (written atomically), for `devices` logical devices. Returns the
    flags used."""
    import iree.compiler  # loaded on use, so importing TARGETS stays cheap

    from ..kernels import compile_flags_for

    flags = compile_flags(target, extra_flags, devices) + compile_flags_for(mlir_path)
    with atomic_output(vmfb_path) as tmp:
        try:
            iree.compiler.compile_file(str(mlir_path), output_file=str(tmp), extra_args=flags)
        except iree.compiler.CompilerToolError as e:
            raise SharkportError(f"{mlir_path}: iree-compile failed ({_first_error(str(e))}); "
                                 "rerun with --verbose for the full compiler output") from e
    return flags


def _first_error(output: str) -> str:
    """The first `error:` line of iree-compile's output (the rest is context and notes)."""
    for line in output.splitlines():
        if "error:" in line:
            return line.split("error:", 1)[1].strip()
    for line in output.splitlines():
        if line.startswith("Error code:"):
            return f"the compiler crashed, {line.strip()}"
    lines = output.strip().splitlines()
    return lines[-1] if lines else "no output"
