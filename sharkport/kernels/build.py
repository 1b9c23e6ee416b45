"""matvec.c compiled for x86-64 by the system C compiler (`$CC`, else `cc`) with AVX2, FMA and
F16C, plus AVX-512 with VNNI where the exporting machine has it (`isa`), into `cache_dir()`: in
matvec.c's SHARKPORT_PARTS parts at once, one on each CPU, combined into one object (`cc -r`); the
MLIR names the object (`matvec-<hash of the C file and flags>.o`, so an MLIR compiles with the
kernels it was exported with), and iree-compile links it into the .vmfb from there
(`compile_flags_for`), so iree-run-module, the runner and shortfin need nothing more."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from ..errors import SharkportError
from .layout import MAX_GD, MAX_K, MAX_NORMED, MAX_STRIDE, cpus

SOURCE = Path(__file__).with_name("matvec.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffreestanding", "-fPIC", "-fno-stack-protector",
          "-fno-asynchronous-unwind-tables", "-fno-plt", "-fvisibility=hidden", "-std=c11",
          f"-DMAX_BLOCKS={MAX_K // 32}", f"-DXQ_BYTES={MAX_K}",
          f"-DXN_FLOATS={MAX_NORMED}", f"-DMAX_GD={MAX_GD}", f"-DMAX_STRIDE={MAX_STRIDE}"]
# Instruction sets the object is built for (isa()): "avx2" runs on any x86-64 CPU of the last
# decade; "avx512" adds AVX-512 with VNNI, for which matvec.c's interleaved products run 64-byte
# vectors and `vpdpbusd` (q4_x8_zmm, q8_x8_zmm). /proc/cpuinfo's names of the features it needs.
ISA_FLAGS = {"avx2": [], "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]}
AVX512_FEATURES = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
ISA_ENV = "SHARKPORT_KERNEL_ISA"
# A measuring aid (tools/bench_bounds.py): $SHARKPORT_KERNEL_PRODUCTS=loads builds kernels whose
# products only read their weights, =none kernels whose products read nothing; both give zeros.
PRODUCTS_ENV = "SHARKPORT_KERNEL_PRODUCTS"
PRODUCTS = {"full": 0, "loads": 1, "none": 2}  # matvec.c's SHARKPORT_PRODUCTS
# matvec.c compiles as this many objects, each with its share of the exported kernels: they build
# in parallel, and gcc takes far longer and far more memory over the whole file than over its parts
PARTS = int(re.search(rb"#define SHARKPORT_PARTS (\d+)", SOURCE.read_bytes()).group(1))


def cache_dir() -> Path:
    """Where compiled kernel objects live: iree-compile finds them here by name."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sharkport" / "kernels"


def isa() -> str:
    """The instruction set the kernels are built for (a key of ISA_FLAGS): $SHARKPORT_KERNEL_ISA if
    set, else "avx512" where this machine has AVX-512 with VNNI, else "avx2". As IREE's
    `--iree-llvmcpu-target-cpu=host`, a module exported on an AVX-512 machine needs one to run;
    SHARKPORT_KERNEL_ISA=avx2 exports kernels that run on any x86-64 CPU with AVX2."""
    chosen = os.environ.get(ISA_ENV, "").strip().lower()
    if chosen:
        if chosen not in ISA_FLAGS:
            raise SharkportError(f"{ISA_ENV}={chosen!r}: choose one of {', '.join(ISA_FLAGS)} (or unset it to "
                                 "build for this machine)")
        return chosen
    return "avx512" if AVX512_FEATURES <= _cpu_features() else "avx2"


@cache
def _cpu_features() -> frozenset[str]:
    """This machine's CPU feature flags (/proc/cpuinfo's; none where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cflags() -> list[str]:
    """The compiler flags the object is built with: CFLAGS, those of isa() and, for
    $SHARKPORT_KERNEL_PRODUCTS other than "full", the measuring aid's define (PRODUCTS)."""
    aid = PRODUCTS[products()]
    return CFLAGS + ISA_FLAGS[isa()] + ([f"-DSHARKPORT_PRODUCTS={aid}"] if aid else [])


def products() -> str:
    """What the kernels' products do (a key of PRODUCTS): $SHARKPORT_KERNEL_PRODUCTS, else "full".
    "loads" and "none" are a measuring aid, not a model: their products are zeros."""
    chosen = os.environ.get(PRODUCTS_ENV, "").strip().lower() or "full"
    if chosen not in PRODUCTS:
        raise SharkportError(f"{PRODUCTS_ENV}={chosen!r}: choose one of {', '.join(PRODUCTS)} (or unset it for the "
                             "products themselves)")
    return chosen


def object_name() -> str:
    """The object's file name, unique to matvec.c's text, the compiler and its flags."""
    return _object_name(_compiler(), tuple(cflags()))


@cache
def _object_name(cc: str, flags: tuple[str, ...]) -> str:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc,) + flags).encode()).hexdigest()[:16]
    return f"matvec-{key}.o"


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def available() -> bool:
    """Whether this machine can build the kernels (an x86-64 host with a C compiler on PATH)."""
    return platform.machine().lower() in ("x86_64", "amd64") and shutil.which(_compiler()) is not None


def object_path(log: Callable[[str], None] | None = None) -> Path:
    """matvec.c compiled for x86-64 into cache_dir() (built once per source and flags; `log`, where
    given, hears when a build starts and ends).

    The MLIR names the object and iree-compile links it from there
    (`--iree-hal-executable-object-search-path`, which `compile_mlir` adds): IREE 3.9 fails to
    link the same object embedded in the MLIR as data (undefined symbol)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise SharkportError(f"--matvec-kernels: the kernels are written for x86-64, not {platform.machine()}; "
                             "export without --matvec-kernels")
    cc = _compiler()
    if shutil.which(cc) is None:
        raise SharkportError(f"--matvec-kernels needs a C compiler to build {SOURCE.name}: {cc!r} is not on PATH "
                             "(install gcc or clang, set CC, or export without --matvec-kernels)")
    flags = tuple(cflags())
    obj = cache_dir() / _object_name(cc, flags)
    if obj.exists() or log is None:
        return _built(cc, flags, obj)
    jobs = _jobs()
    log(f"building the kernels ({SOURCE.name} for {isa()}, once per version: {PARTS} parts, {jobs} at a time) ...")
    t0 = time.perf_counter()
    _built(cc, flags, obj)
    log(f"built the kernels in {time.perf_counter() - t0:.0f} s: {obj}")
    return obj


def _jobs() -> int:
    """Compilers run at once: one for each CPU this process may use, at most PARTS."""
    return max(1, min(PARTS, cpus()))


@cache
def _built(cc: str, flags: tuple[str, ...], obj: Path) -> Path:
    """obj, matvec.c compiled by cc with flags unless the cache already holds it: its PARTS parts
    at once, then combined into one relocatable object. Processes needing it at once (a suite on
    two processes, exports side by side) build it once: the others wait on the build's lock."""
    if obj.exists():
        return obj
    obj.parent.mkdir(parents=True, exist_ok=True)
    with open(obj.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return obj if obj.exists() else _build(cc, flags, obj)


def _build(cc: str, flags: tuple[str, ...], obj: Path) -> Path:
    tmp = obj.with_suffix(f".{os.getpid()}.tmp")
    parts = [obj.with_suffix(f".{os.getpid()}.part{k}.o") for k in range(PARTS)]

    def compile_part(k: int) -> subprocess.CompletedProcess:
        return subprocess.run([cc, *flags, f"-DSHARKPORT_PART={k}", "-c", str(SOURCE), "-o", str(parts[k])],
                              capture_output=True, text=True)

    try:
        with ThreadPoolExecutor(_jobs()) as pool:
            for run in pool.map(compile_part, range(PARTS)):
                _check(run, cc, "compile", flags)
        _check(subprocess.run([cc, "-r", "-nostdlib", *map(str, parts), "-o", str(tmp)], capture_output=True,
                              text=True), cc, "combine the parts of", flags)
        os.replace(tmp, obj)
    finally:
        for leftover in (*parts, tmp):
            leftover.unlink(missing_ok=True)
    return obj


def _check(run: subprocess.CompletedProcess, cc: str, what: str, flags: tuple[str, ...]) -> None:
    """One line naming the compiler, what it failed to do and its first message, where it failed."""
    if run.returncode:
        first = (run.stderr.strip().splitlines() or ["no output"])[0]
        hint = f"; {ISA_ENV}=avx2 builds without AVX-512" if ISA_FLAGS["avx512"][0] in flags else ""
        raise SharkportError(f"--matvec-kernels: {cc} failed to {what} {SOURCE} ({first}{hint}; "
                             "--no-matvec-kernels exports without them)")


@contextlib.contextmanager
def _mapped(mlir_path: str | os.PathLike):
    """An MLIR file's bytes, memory-mapped (b"" for an empty file, which mmap refuses)."""
    import mmap

    with open(mlir_path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            yield m


def referenced_by(mlir_path: str | os.PathLike) -> bool:
    """Whether an MLIR file calls the kernels (so iree-compile needs their object), or a module
    compiled from one holds them (their names are in its executables')."""
    with _mapped(mlir_path) as m:
        return any(m.find(symbol) >= 0 for symbol in (b"sharkport_matvec_", b"sharkport_decode_", b"sharkport_prefill_",
                                                      b"sharkport_attention_block_", b"sharkport_ffn_block_",
                                                      b"sharkport_layer_block_"))


def objects_named_by(mlir_path: str | os.PathLike) -> set[str]:
    """The kernel objects an MLIR file links (object_name() of the matvec.c it was exported with)."""
    with _mapped(mlir_path) as m:
        return {name.decode() for name in re.findall(rb"matvec-[0-9a-f]{16}\.o", m)}


def compile_flags_for(mlir_path: str | os.PathLike) -> list[str]:
    """iree-compile flags an MLIR file needs for the kernels it calls (building their object).

    The MLIR names its object by the hash of the matvec.c it was exported with, so it compiles
    with those kernels, from cache_dir(), even after matvec.c changes; an object no longer there
    (another version's, in a fresh cache) is an error naming it."""
    if not referenced_by(mlir_path):
        return []
    current = object_path()
    for name in sorted(objects_named_by(mlir_path) - {current.name}):
        if not (current.parent / name).exists():
            raise SharkportError(f"{mlir_path}: it links the kernels object {name}, built from another version of "
                                 f"{SOURCE.name} and not in {current.parent}; export the model again (this version "
                                 f"builds {current.name})")
    return [f"--iree-hal-executable-object-search-path={current.parent}"]
