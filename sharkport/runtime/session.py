"""Sessions: the compiled module (IREE) and the eager recipe (PyTorch, runtime/eager.py) behind
one interface.

Both take numpy inputs in the ABI's shapes, keep their own cache_state, and return float32
numpy logits. Every input is checked against the exported ranges before the call: IREE does not
check dynamic dimensions at run time and would read out of bounds. This module needs no torch
(nor IREE's compiler), so running a compiled module loads neither.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import SharkportError
from ..export.abi import ServiceConfig
from . import hugepages
from .vmfb import check_file, checked_against_module, module_driver

# the GPU driver each device kind runs modules of (None: CPU modules)
_DRIVER_OF_DEVICE = {"local-task": None, "local-sync": None, "cuda": "cuda", "hip": "hip", "vulkan": "vulkan"}

_NP_CACHE_DTYPES = {"float32": np.float32, "float16": np.float16}


def _within(a: np.ndarray, end: int) -> bool:
    """Whether every element of the int64 array a lies in [0, end). A decode step's arrays (a few
    dozen values) go through Python's min and max: numpy's reductions, with the caches cold after
    a call, took most of the checks' time."""
    if a.size > 4096:
        return bool(a.min() >= 0 and a.max() < end)
    values = a.ravel().tolist()
    return not values or (min(values) >= 0 and max(values) < end)


def cache_pages(pages: int | None, config: ServiceConfig, weights: tuple[str, int] | None = None) -> int:
    """The cache pages to allocate: `pages`, or the config's device_block_count; refused when not
    a whole number >= 2 (one page is the padding rows' scratch) or when the cache would not fit
    in the memory the system has available, beside `weights` (the archive's name and bytes, where
    the weights are held in this machine's memory)."""
    pages = config.device_block_count if pages is None else pages
    if isinstance(pages, bool) or not isinstance(pages, (int, np.integer)) or pages < 2:
        raise SharkportError(f"--pages {pages}: give a whole number of KV cache pages, at least 2")
    itemsize = np.dtype(_NP_CACHE_DTYPES[config.kv_cache_dtype]).itemsize
    needed = int(pages) * config.page_elems * itemsize * config.tensor_parallelism_size
    free = _available_bytes()
    if free is not None and weights is not None and weights[1] + needed > free:
        raise SharkportError(
            f"{weights[0]}: the weights ({_gib(weights[1])}) and a KV cache of {pages} pages ({_gib(needed)}) need "
            f"{_gib(weights[1] + needed)} and the system has {_gib(free)} available; give fewer pages or free memory")
    if free is not None and needed > free:
        raise SharkportError(f"--pages {pages}: the KV cache needs {_gib(needed)} and the system has {_gib(free)} "
                             "available; give fewer pages")
    return int(pages)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


# IREE's CPU devices allocate a call's transient buffers (prefill's activations, the kernels'
# scratch) anew for each call, and every 4 KiB of them faults in again when touched; a caching
# allocator keeps up to 512 MiB of freed ones for the next call. SHARKPORT_IREE_CACHING=0 turns it
# off. Single-device sessions only: IREE 3.9 crashes tensor-parallel calls over devices that each
# have one. The sessions naming a device share it (devices made per session crashed IREE 3.9 as
# they were released), so each new session trims it: what it kept for other models' calls is freed.
CPU_ALLOCATOR = "caching:device_local=*;512mib;64"
_CPU_DEVICES: dict[str, object] = {}
_CPU_DEVICES_LOCK = threading.Lock()


def _device(rt, uri: str, shared: bool):
    """The device of `uri`: where `shared` (a single-device session), the one all such sessions
    naming it share, a CPU one with CPU_ALLOCATOR; else a device of its own."""
    try:
        if not (shared and uri.startswith("local")) or os.environ.get("SHARKPORT_IREE_CACHING", "1") == "0":
            return rt.get_device(uri, cache=shared)
        with _CPU_DEVICES_LOCK:
            if uri not in _CPU_DEVICES:
                _CPU_DEVICES[uri] = rt.get_driver(uri).create_device_by_uri(uri, allocators=[CPU_ALLOCATOR])
            _CPU_DEVICES[uri].allocator.trim()
            return _CPU_DEVICES[uri]
    except (ValueError, RuntimeError) as e:
        raise SharkportError(f"--device {uri}: not available here ({_one_line(e)}); the CPU devices are "
                             "local-task and local-sync, GPUs cuda://N, hip://N and vulkan://N") from None


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Session:
    """prefill / decode over a paged cache of `pages` pages (docs/abi.md). Thread-safe: calls from
    several threads take turns on the one cache."""

    config: ServiceConfig
    pages: int
    _calls = threading.Lock()  # replaced per session in __init__

    # -- checks shared by both sessions -------------------------------------------------------
    def _check(self, kind: str, tokens: np.ndarray, seq_lens: np.ndarray, seq_block_ids: np.ndarray,
               start_positions: np.ndarray | None = None) -> None:
        c = self.config
        sizes = c.prefill_batch_sizes if kind == "prefill" else c.decode_batch_sizes
        bs = tokens.shape[0]
        if bs not in sizes:
            raise SharkportError(f"{kind}: batch size {bs} was not exported (exported: {sizes})")
        for name, a in (("tokens", tokens), ("seq_lens", seq_lens), ("seq_block_ids", seq_block_ids),
                        ("start_positions", start_positions)):
            if a is not None and a.dtype != np.int64:
                raise SharkportError(f"{kind}: {name} must be int64, got {a.dtype}")
            if a is not None and a.shape[0] != bs:
                raise SharkportError(f"{kind}: {name} has batch {a.shape[0]}, tokens has {bs}")
        blocks = seq_block_ids.shape[1]
        stride = c.block_seq_stride
        if kind == "prefill" and tokens.shape[1] != blocks * stride:
            raise SharkportError(
                f"prefill: tokens length {tokens.shape[1]} must be seq_block_ids blocks ({blocks}) "
                f"x block_seq_stride ({stride})")
        if kind == "decode" and tokens.shape[1] != 1:
            raise SharkportError(f"decode: tokens must be [batch, 1], got {list(tokens.shape)}")
        if blocks * stride > c.max_seq_len:
            raise SharkportError(
                f"{kind}: {blocks * stride} positions exceed max_seq_len {c.max_seq_len} of the export")
        # As few numpy calls as will do: right after a decode call the caches hold the weights,
        # not this code, and each numpy call costs several us there.
        lens = seq_lens.tolist()
        if min(lens) < 1 or max(lens) > blocks * stride:
            raise SharkportError(f"{kind}: seq_lens {lens} must lie in 1..{blocks * stride}")
        if start_positions is not None and start_positions.tolist() != [n - 1 for n in lens]:
            raise SharkportError(f"{kind}: start_positions must equal seq_lens - 1")
        if not _within(seq_block_ids, self.pages):
            raise SharkportError(
                f"{kind}: seq_block_ids must be page indices in 0..{self.pages - 1}")
        if not _within(tokens, c.vocab_size):
            raise SharkportError(f"{kind}: token ids must lie in 0..{c.vocab_size - 1}")

    def prefill(self, tokens, seq_lens, seq_block_ids) -> np.ndarray:
        self._check("prefill", tokens, seq_lens, seq_block_ids)
        with self._calls:
            return self._prefill(tokens, seq_lens, seq_block_ids)

    def decode(self, tokens, seq_lens, start_positions, seq_block_ids) -> np.ndarray:
        self._check("decode", tokens, seq_lens, seq_block_ids, start_positions)
        with self._calls:
            return self._decode(tokens, seq_lens, start_positions, seq_block_ids)

    def cache_to_host(self) -> np.ndarray:
        raise NotImplementedError


_TUNED = False
SPIN_US = 20  # how long an idle local-task worker waits for the next dispatch before sleeping


def tune_local_task(rt) -> None:
    """Tunes local-task devices for decode latency, once per process (before its first device):
    - one worker per CPU this process may run on: IREE's default topology (`physical_cores`)
      makes one worker on a 2-vCPU virtual machine, which leaves half the CPUs idle;
    - workers spin SPIN_US microseconds for the next dispatch before sleeping
      (--task_worker_spin_us; IREE's default 0 puts them to sleep between a decode step's
      dependent dispatches, and waking them costs more than the spin).
      SHARKPORT_IREE_SPIN_US sets another value (0: none).
    Set IREE's own --task_* flags (`iree.runtime.flags.parse_flags`) and
    SHARKPORT_KEEP_IREE_TOPOLOGY=1 to choose otherwise."""
    global _TUNED
    if _TUNED or os.environ.get("SHARKPORT_KEEP_IREE_TOPOLOGY"):
        return
    _TUNED = True
    spin = os.environ.get("SHARKPORT_IREE_SPIN_US", str(SPIN_US))
    if not spin.isdigit():
        raise SharkportError(f"SHARKPORT_IREE_SPIN_US={spin!r}: give a whole number of microseconds (0: no spinning)")
    rt.flags.parse_flags(f"--task_topology_group_count={len(os.sched_getaffinity(0))}",
                         f"--task_worker_spin_us={spin}")


class _Logits(np.ndarray):
    """A module's result on the host: a view of its mapped memory, holding the result's buffer
    view (`result`), which owns that memory, so the view stays valid for as long as it (or any
    view of it) is alive."""


def _embedding_rows(irpa) -> int:
    """The vocabulary size of an archive: the rows of token_embd.weight in its metadata entry."""
    import iree.runtime as rt

    from ..archive.irpa import index_metadata

    index = rt.ParameterIndex()
    index.load(str(irpa), mmap=True)
    try:
        return int(index_metadata(index, irpa)["tensors"]["token_embd.weight"]["shape"][0])
    except (KeyError, IndexError, TypeError, ValueError):
        raise SharkportError(
            f"{irpa}: no token_embd.weight in the archive metadata, so the vocabulary size is "
            "unknown; re-import the model with `python -m sharkport.tools.dump_gguf --output-irpa`") from None


class IreeSession(Session):
    """A compiled module with its parameters, on an IREE device: by default `local-task` for a CPU
    module and the first GPU of its driver (`cuda`, `hip`, `vulkan`) for a GPU module
    (docs/devices.md); a device of the wrong kind is refused before the module loads.

    A tensor-parallel module (config `tensor_parallelism_size` N > 1, docs/parallel.md) runs on N
    devices: N of `device`'s kind (default `local-sync`: IREE 3.9's local-task fails deep
    N-device calls, see _MULTI_DEVICE_LOCAL_TASK), or the N comma-separated URIs it lists
    (`hip://0,hip://1`). `irpa` is then the root archive; rank r's file and cache_state go to
    device r.

    On CPU devices the context's initializer reads the weights from the archive's file into the
    buffers it allocates, and those and the caches go onto 2 MiB pages (runtime/hugepages.py;
    SHARKPORT_HUGE_PAGES=0 keeps them on 4 KiB pages); `huge_page_bytes` says how much was
    advised."""

    def __init__(self, vmfb: str | os.PathLike, irpa: str | os.PathLike, config: str | os.PathLike | ServiceConfig,
                 pages: int | None = None, device: str | None = None):
        import iree.runtime as rt

        from ..parallel.archive import parameter_files

        for p in (vmfb, irpa):
            if not Path(p).is_file():
                raise SharkportError(f"{p}: no such file")
        source = "the service config" if isinstance(config, ServiceConfig) else str(config)
        if not isinstance(config, ServiceConfig):
            config = ServiceConfig.load(config)
        check_file(vmfb)  # a damaged executable would crash this process once IREE runs it
        instance = rt.VmInstance()
        try:
            main = rt.VmModule.mmap(instance, str(vmfb))
        except (RuntimeError, ValueError) as e:
            raise SharkportError(f"{vmfb}: not a module IREE can load ({_one_line(e)}); compile it again with "
                                 "`sharkport export --output-vmfb`") from None
        config = checked_against_module(main, config, vmfb, source)
        n = config.tensor_parallelism_size
        driver = module_driver(vmfb)  # None: a CPU module
        files, vocab = parameter_files(irpa, n) if n > 1 else ([irpa], None)
        # a CPU module reads its weights into this process's memory (at least the archive's bytes)
        held = None if driver else (str(irpa), sum(Path(f).stat().st_size for f in files))
        self.pages = cache_pages(pages, config, held)
        self._calls = threading.Lock()
        self.device_name = device or driver or ("local-sync" if n > 1 else "local-task")
        uris = self.device_name.split(",") if "," in self.device_name else [self.device_name] * n
        if len(uris) != n:
            raise SharkportError(f"device {self.device_name!r} names {len(uris)} devices; the module runs on {n}")
        for uri in uris:
            kind = uri.split("://")[0]
            if kind in _DRIVER_OF_DEVICE and _DRIVER_OF_DEVICE[kind] != driver:
                raise SharkportError(f"--device {uri}: {vmfb} was compiled for "
                                     f"{driver + ' GPUs' if driver else 'the CPU'}; run it with --device "
                                     f"{driver or 'local-task'} (docs/devices.md)")
        if any(uri.startswith("local-task") for uri in uris):
            tune_local_task(rt)
        devices = [_device(rt, uri, n == 1) for uri in uris]  # N > 1: N devices, not one shared
        local = all(uri.startswith("local") for uri in uris)
        on_cpu = hugepages.enabled() and local
        index = rt.ParameterIndex()
        self._files = []  # the archives a CPU module's initializer reads its weights from
        for f in files:  # rank files' names are distinct (`.shard.{r}`): all load into scope "model"
            if local:
                # read through the file: a CPU module gathers its weights into one buffer as it
                # loads (sharkport.compile's CPU presets), which IREE 3.9 does from a file, not from a
                # mapping of one
                handle = open(f, "rb")
                self._files.append(handle)
                index.load_from_file_handle(rt.FileHandle.wrap_fd(handle.fileno(), readable=True, writable=False),
                                            Path(f).suffix.lstrip("."))
            else:
                index.load(str(f), mmap=True)
        rows = vocab or _embedding_rows(irpa)
        if config.vocab_size is None:  # an older module, and a config without it (as shortfin's)
            config = replace(config, vocab_size=rows)
        elif rows != config.vocab_size:
            raise SharkportError(f"{irpa}: token_embd.weight has {rows} rows, but {vmfb} was exported for a "
                                 f"vocabulary of {config.vocab_size}; give the archive it was exported from")
        self.config = config
        params = rt.create_io_parameters_module(instance, index.create_provider(scope="model"))
        hal = rt.create_hal_module(instance, devices=devices)
        # the inputs (and the logits) of a tensor-parallel module's functions are on device 0
        self._rt, self._devices, self._device = rt, devices, devices[0]
        self._float32 = int(rt.HalElementType.FLOAT_32)
        before = hugepages.snapshot() if on_cpu else {}
        self._context, self._main, self._functions = rt.VmContext(instance, modules=[params, hal, main]), main, {}
        dtype = _NP_CACHE_DTYPES[config.kv_cache_dtype]
        self._on_host = on_host = driver is None  # a CPU device's memory maps; a GPU's is copied back
        try:
            self._caches = [_uploader(rt, d, on_host)(np.zeros((self.pages, config.page_elems), dtype))
                            for d in devices]
        except RuntimeError as e:  # a GPU's memory is not the system's, which cache_pages checked
            raise SharkportError(f"--pages {self.pages}: the device could not hold the KV cache "
                                 f"({_one_line(e)}); give fewer pages") from None
        self._upload = _uploader(rt, devices[0], on_host)  # the inputs' copies, on device 0
        # the weights the context's initializer wrote and the caches, on 2 MiB pages (hugepages.py);
        # a cache below glibc's mmap threshold may sit in memory mapped before, so its own range too
        self.huge_page_bytes = (
            hugepages.back_new_mappings(before, [_host_range(c) for c in self._caches]) if on_cpu else 0)

    def _call(self, name: str, *args) -> np.ndarray:
        """The module's function `name` on the int64 inputs `args` and the caches: its logits.

        The inputs and the caches go straight into the VM's argument list, and the one result is
        mapped as it is: iree.runtime's FunctionInvoker, which converts each argument by the
        function's reflected ABI and wraps the result in a DeviceArray, costs tens of us a decode
        step."""
        rt = self._rt
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self._main.lookup_function(name)
            if fn is None:
                raise SharkportError(f"the module has no function {name}")
        arguments = rt.VmVariantList(len(args) + len(self._caches))
        upload = self._upload
        for a in args:
            arguments.push_ref(upload(a))
        for cache in self._caches:
            arguments.push_ref(cache)
        results = rt.VmVariantList(1)
        try:
            self._context.invoke(fn, arguments, results)
        except RuntimeError as e:
            if len(self._caches) > 1 and "local-task" in self.device_name and "ABORTED" in str(e):
                raise SharkportError(_MULTI_DEVICE_LOCAL_TASK.format(n=len(self._caches), error=_one_line(e))) from e
            raise
        result = results.get_as_object(0, rt.HalBufferView)
        if result.element_type != self._float32:
            raise SharkportError(f"{name} returned elements of HAL type {result.element_type}, not float32 logits: "
                                 "was the module exported by sharkport.export?")
        # A view of the result's mapped memory (a copy costs tens of us a decode step). It holds
        # the result too: with IREE 3.9
        # the mapping itself kept the buffer alive when tried, but views of DeviceArray.to_host()
        # once crashed on large outputs here, so the view does not depend on that
        # (tests/test_llama_tiny.py::test_compiled_logits_outlive_their_call).
        if not self._on_host:
            return _copy_to_host(rt, self._device, result, np.float32)
        logits = result.map().asarray(list(result.shape), np.dtype(np.float32)).view(_Logits)
        logits.result = result
        return logits

    def _prefill(self, tokens, seq_lens, seq_block_ids):
        return self._call(f"prefill_bs{tokens.shape[0]}", tokens, seq_lens, seq_block_ids)

    def _decode(self, tokens, seq_lens, start_positions, seq_block_ids):
        return self._call(f"decode_bs{tokens.shape[0]}", tokens, seq_lens, start_positions, seq_block_ids)

    def cache_to_host(self) -> np.ndarray:
        if len(self._caches) > 1:
            raise SharkportError(
                f"the module runs on {len(self._caches)} devices (tensor parallelism), each with its own "
                "cache_state: read them with caches_to_host(); tools that replay single calls handle "
                "one-device modules only")
        return self.caches_to_host()[0]

    def caches_to_host(self) -> list[np.ndarray]:
        """Each device's cache_state, in device order."""
        dtype = _NP_CACHE_DTYPES[self.config.kv_cache_dtype]
        return [np.array(c.map().asarray(list(c.shape), np.dtype(dtype)), copy=True) if _mappable(c)
                else _copy_to_host(self._rt, device, c, dtype) for c, device in zip(self._caches, self._devices)]


# Seen with IREE 3.9 (iree-run-module --task_abort_on_failure=true names the root cause,
# "wait_handle_poll.c:188: RESOURCE_EXHAUSTED; wait set capacity reached"): the host queues a whole
# call at once, each cross-device dependency is a system wait in the task executor's poller, and
# the poller holds about 63, so deep tensor-parallel models fail on local-task (some runs crash
# the process instead). local-sync devices run every queued operation inline, with no waits.
_MULTI_DEVICE_LOCAL_TASK = (
    "{error} -- on {n} local-task devices this is IREE 3.9's task executor running out of pending "
    "cross-device waits (about 63; deep models need more): run on local-sync devices instead "
    "(--device local-sync, or device='local-sync'); see docs/parallel.md")


def _one_line(e: BaseException) -> str:
    """IREE's error without its VM stack: 'Error invoking function: ABORTED; while invoking ...'."""
    return " ".join(str(e).split("; while calling import")[0].split())


_ELEMENT_TYPES = {np.dtype(np.int64): "SINT_64", np.dtype(np.float32): "FLOAT_32", np.dtype(np.float16): "FLOAT_16"}


def _host_range(view) -> tuple[int, int]:
    """(address, bytes) of a host-visible buffer view's memory, as mapped."""
    a = view.map().asarray([view.byte_length], np.dtype(np.uint8))
    return a.ctypes.data, a.nbytes


def _uploader(rt, device, mapped: bool = True):
    """A function of a host array: its copy in a buffer view on `device` (with `mapped`, host-visible
    so that it maps; a GPU's own memory otherwise). The allocator, memory type, usage and element
    types are looked up once here, not for each of a decode call's four inputs, which trims the
    host's part of a decode call."""
    usage = rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING if mapped else rt.BufferUsage.DEFAULT
    copy = functools.partial(device.allocator.allocate_buffer_copy, rt.MemoryType.DEVICE_LOCAL, usage, device)
    types = {dtype: getattr(rt.HalElementType, name) for dtype, name in _ELEMENT_TYPES.items()}
    return lambda a: copy(a, types[a.dtype])


def _mappable(view) -> bool:
    """Whether a buffer view's memory maps into this process (a CPU device's does; a GPU's need not)."""
    import iree.runtime as rt

    buffer = view.get_buffer()
    host_visible, scoped = int(rt.MemoryType.HOST_VISIBLE), int(rt.BufferUsage.MAPPING_SCOPED)
    return buffer.memory_type() & host_visible == host_visible and buffer.allowed_usage() & scoped == scoped


def _copy_to_host(rt, device, view, dtype) -> np.ndarray:
    """A numpy copy of a buffer view in device memory: a device-to-host copy on the device's queue
    into a host buffer, mapped and copied out (a view of the mapping would not outlive it)."""
    source = view.get_buffer()
    host = device.allocator.allocate_buffer(
        memory_type=rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE,
        allowed_usage=rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED,
        allocation_size=source.byte_length())
    semaphore = device.create_semaphore(0)
    device.queue_copy(source, host, wait_semaphores=rt.HalFence.create_at(semaphore, 0),
                      signal_semaphores=rt.HalFence.create_at(semaphore, 1))
    rt.HalFence.create_at(semaphore, 1).wait()
    return np.array(host.map().asarray(list(view.shape), np.dtype(dtype)), copy=True)
