"""Compile exported MLIR to a .vmfb with IREE, for a target named `backend` or `backend:chip`.

CPU targets (`llvm-cpu`, `llvm-cpu-lean`) compile for the host; GPU targets (`cuda`, `rocm`,
`vulkan`, each with an optional chip) compile on any machine and run where that GPU is
(docs/devices.md). `extra_flags` passes anything else straight to iree-compile.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

from ..errors import SharkportError
from ..fileio import atomic_output

# IREE's discrete memory model gathers the weights into one buffer as the module loads, so a
# dispatch binds that buffer once rather than a buffer for each weight plane (28 for a SmolLM2
# layer): IREE records every call's command buffer anew, a cost per binding (docs/performance.md).
# Buffers of at most 1 GiB keep each weight's offset in its buffer within a 32-bit push constant
# (an 8B model's weights gather into five).
MAX_ALLOCATION = 1 << 30
# Weights as stored (llvm-cpu-lean, GPU targets): by default IREE hoists every expression of
# weights alone (unpacking a plane's bits, reordering its rows) into an initializer that keeps its
# result from load on, thousands of them for a K-quant model (docs/devices.md). llvm-cpu keeps
# the default: it packs the weights at load on purpose.
_AS_STORED = "--iree-opt-const-expr-hoisting=false"
_LLVM_CPU_HOST = (
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",
    "--iree-stream-resource-memory-model=discrete",
    f"--iree-stream-resource-max-allocation-size={MAX_ALLOCATION}",
)
CPU_TARGETS: dict[str, tuple[str, ...]] = {
    # Fast on CPU: weights are dequantized (or widened from f16) and packed for the matmul
    # microkernels once, when the module loads, at 4 bytes of memory per weight.
    # Data tiling from global optimization: IREE 3.9's dispatch-creation path (what
    # --iree-opt-data-tiling picks) fails on attention's batched matmuls with small head dims
    # ('affine.delinearize_index' op no basis element may be statically non-positive).
    "llvm-cpu": _LLVM_CPU_HOST + (
        "--iree-global-opt-data-tiling",
        "--iree-llvmcpu-enable-ukernels=all",
        "--iree-opt-const-expr-max-size-increase-threshold=1099511627776",
    ),
    # Lean on memory: weights stay as stored (quantized planes, f16) and are dequantized inside
    # every call.
    "llvm-cpu-lean": _LLVM_CPU_HOST + (_AS_STORED,),
}

# IREE 3.9 has no description of Hopper (sm_90) in its table of CUDA chips, and without one it
# cannot configure any dispatch ("missing GPU target in #hal.executable.target"). The device is
# then given whole: Ampere's features, which Hopper has, with Hopper's 227 KiB of shared memory
# a workgroup, code generated for sm_90 in PTX 8.0.
_SM90_DEVICE = (
    '#hal.device.target<"cuda", [#hal.executable.target<"cuda", "cuda-nvptx-fb", {iree_codegen.target_info = '
    '#iree_gpu.target<arch = "sm_90", features = "+ptx80", wgp = <compute = fp64|fp32|fp16|int64|int32|int16|int8, '
    'storage = b64|b32|b16|b8, subgroup = shuffle|arithmetic, dot = dp4xi8toi32, '
    'mma = [<NV_WMMA_F32_16x16x16_F16>, <NV_WMMA_F16_16x16x16_F16>], subgroup_size_choices = [32], '
    'max_workgroup_sizes = [1024, 1024, 1024], max_thread_count_per_workgroup = 1024, '
    'max_workgroup_memory_bytes = 232448, max_workgroup_counts = [2147483647, 65535, 65535]>>}>]> : !hal.device')


@dataclass(frozen=True)
class GpuBackend:
    device: str        # iree-compile's device name, and the runtime driver's
    chip_flag: str     # iree-compile's flag naming the chip
    default_chip: str
    chips: tuple[str, ...]  # compiled in the tests; others the backend knows are passed on
    chip_pattern: str  # the names iree-compile's backend accepts, as far as checked here


GPU_BACKENDS: dict[str, GpuBackend] = {
    # sm_80 PTX runs on every NVIDIA GPU from Ampere on: the driver compiles it for the chip it finds.
    "cuda": GpuBackend("cuda", "--iree-cuda-target", "sm_80", ("sm_80", "sm_86", "sm_90"),
                       r"sm_(60|61|62|70|72|75|80|86|87|90)"),
    "rocm": GpuBackend("hip", "--iree-hip-target", "gfx942", ("gfx942", "gfx90a", "gfx1100"),
                       r"gfx[0-9a-f]{3,4}"),
    # Vulkan targets name the SPIR-V features a driver offers: an architecture (rdna3, ampere,
    # valhall4, ...), a chip in the other backends' names, or a product.
    "vulkan": GpuBackend("vulkan", "--iree-vulkan-target", "ampere", ("ampere", "rdna3"),
                         r"[a-z][a-z0-9_-]*"),
}


@dataclass(frozen=True)
class Target:
    """A resolved --target: its name (`llvm-cpu`, `cuda:sm_90`), backend, chip and flags."""

    name: str
    backend: str
    chip: str | None
    flags: tuple[str, ...]

    @property
    def gpu(self) -> bool:
        return self.backend in GPU_BACKENDS

    @property
    def as_stored(self) -> bool:
        """Whether the module keeps the weights as stored (llvm-cpu-lean, the GPU presets)."""
        return _AS_STORED in self.flags


TARGET_NAMES = (*CPU_TARGETS, *(f"{b}[:chip]" for b in GPU_BACKENDS))


def resolve_target(spec: str) -> Target:
    """`llvm-cpu`, `llvm-cpu-lean`, or a GPU backend with an optional chip (`cuda`, `cuda:sm_90`,
    `rocm:gfx942`, `vulkan:rdna3`); a bare backend picks its default chip."""
    if spec in CPU_TARGETS:
        return Target(spec, spec, None, CPU_TARGETS[spec])
    backend, _, chip = spec.partition(":")
    gpu = GPU_BACKENDS.get(backend)
    if gpu is None:
        raise SharkportError(f"--target {spec}: unknown target (known: {', '.join(TARGET_NAMES)}; "
                             "docs/devices.md lists the chips)")
    chip = chip or gpu.default_chip
    if not re.fullmatch(gpu.chip_pattern, chip):
        raise SharkportError(f"--target {spec}: {backend} does not know the chip {chip!r} (tested: "
                             f"{', '.join(gpu.chips)}; docs/devices.md)")
    if backend == "cuda" and chip == "sm_90":
        flags: tuple[str, ...] = (f"--iree-hal-target-device={_SM90_DEVICE}",)
    else:
        flags = (f"--iree-hal-target-device={gpu.device}", f"{gpu.chip_flag}={chip}")
    return Target(f"{backend}:{chip}", backend, chip, flags + (_AS_STORED,))


def compile_flags(target: str = "llvm-cpu", extra_flags: list[str] | None = None, devices: int = 1) -> list[str]:
    """The target's flags plus `extra_flags`. With `devices` > 1 (a tensor-parallel module) the
    target device is declared once per logical device: `--iree-hal-target-device=local[0]`,
    `local[1]`, ... (the module's `__device_0`, `__device_1`, ...)."""
    resolved = resolve_target(target)
    flags = []
    for f in resolved.flags:
        if devices > 1 and f.startswith("--iree-hal-target-device="):
            if f.endswith("!hal.device"):
                raise SharkportError(f"--target {resolved.name} compiles for one device; tensor parallelism over "
                                     f"{devices} needs a chip iree-compile names itself (docs/devices.md)")
            flags += [f"{f}[{i}]" for i in range(devices)]
        else:
            flags.append(f)
    return flags + list(extra_flags or [])


def compile_mlir(mlir_path: str | os.PathLike, vmfb_path: str | os.PathLike,
                 target: str = "llvm-cpu", extra_flags: list[str] | None = None, devices: int = 1,
                 name: str | None = None) -> list[str]:
    """iree-compile mlir → vmfb (written atomically), for `devices` logical devices. Returns the
    flags used. `name` is what errors call the MLIR (default its path)."""
    import iree.compiler  # loaded on use, so importing this module stays cheap

    from ..kernels import compile_flags_for, referenced_by

    resolved = resolve_target(target)
    if resolved.gpu and referenced_by(mlir_path):
        raise SharkportError(f"{name or mlir_path}: exported with --matvec-kernels, which are x86-64 CPU code; "
                             f"export it again without them to compile for {resolved.name}")
    flags = compile_flags(target, extra_flags, devices) + compile_flags_for(mlir_path)
    with atomic_output(vmfb_path) as tmp:
        try:
            _iree_compile(mlir_path, tmp, flags)
        except iree.compiler.CompilerToolError as e:
            raise SharkportError(f"{name or mlir_path}: iree-compile failed for {resolved.name} "
                                 f"({_first_error(str(e))}); rerun with --verbose for the full compiler output") from e
    return flags


def _iree_compile(mlir_path, vmfb_path, flags: list[str]) -> None:
    """iree-compile as iree.compiler.compile_file runs it, but as a child that dies with this
    process: a killed export leaves no compiler running on."""
    from iree.compiler.tools.binaries import CompilerToolError
    from iree.compiler.tools.core import CompilerOptions, TempFileSaver, build_compile_command_line

    with TempFileSaver.implicit() as tfs:
        command = build_compile_command_line(str(mlir_path), tfs, CompilerOptions(output_file=str(vmfb_path),
                                                                                  extra_args=flags))
        proc = subprocess.run(command, capture_output=True, preexec_fn=_die_with_parent)
    if proc.returncode != 0:
        raise CompilerToolError(proc)
    if proc.stderr:  # its warnings, as compile_file shows them
        sys.stderr.write(proc.stderr.decode(errors="replace"))


def _die_with_parent() -> None:
    """In the child before it runs: Linux sends it SIGKILL when its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl (not Linux): the child outlives a killed parent
        pass


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
