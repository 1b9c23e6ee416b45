"""Checks of a compiled module file before IREE loads it.

A `.vmfb` is a ZIP archive (stored, not compressed) of the module's flatbuffer (`module.fb`,
file identifier `IREE`) and the files it embeds: its executables (x86 ELF, PTX, HSACO, SPIR-V)
and large constants. IREE's loader verifies the flatbuffer, but maps and runs the executables as
they are, so a damaged executable crashes the process that runs it. Every ZIP member carries a
CRC-32: `check_file` finds damage anywhere in the file in milliseconds, before anything loads.
A CRC finds damage, not intent: a module is native code, to be run only from a source one trusts.

    python -m sharkport.runtime.vmfb MODULE [CONFIG]

loads MODULE in this process and prints its functions (and the problems with CONFIG) as JSON;
`sharkport check --vmfb` runs it as a child, so that a module that crashes IREE ends the child.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import SharkportError
from ..export.abi import MODULE_FACTS, REFLECTION_KEY, ServiceConfig

_FIX = "compile it again with `sharkport export --output-vmfb`"
IDENTIFIER = b"IREE"  # the flatbuffer file identifier: bytes 4..8, or 8..12 after a size prefix
# The calling convention IREE prints in a function's repr: "(0rrrr_r)" is 4 refs in, 1 ref out.
_CONVENTION = re.compile(r"\((\d?)([a-zA-Z]*)_([a-zA-Z]*)\)")


def check_file(path: str | os.PathLike) -> None:
    """One SharkportError naming `path` unless it is a whole compiled module: a ZIP whose every
    member matches its CRC-32 and whose `module.fb` is an IREE flatbuffer (or, from an older
    compiler, a bare IREE flatbuffer)."""
    path = Path(path)
    if not path.is_file():
        raise SharkportError(f"{path}: no such file")
    with open(path, "rb") as f:
        head = f.read(12)
    if _is_flatbuffer(head):  # a bare flatbuffer carries no checksums: IREE's verifier decides
        return
    if head[:4] != b"PK\x03\x04":
        raise SharkportError(f"{path}: not a compiled IREE module (it starts with {head[:8]!r}); {_FIX}")
    try:
        with zipfile.ZipFile(path) as z:
            if "module.fb" not in z.namelist():
                raise SharkportError(f"{path}: a ZIP file without module.fb, not a compiled IREE module; {_FIX}")
            with z.open("module.fb") as fb:
                if not _is_flatbuffer(fb.read(12)):
                    raise SharkportError(f"{path}: its module.fb is not an IREE flatbuffer; {_FIX}")
            damaged = z.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as e:
        raise SharkportError(f"{path}: damaged ({e}); {_FIX}") from None
    if damaged is not None:
        raise SharkportError(f"{path}: its member {damaged} is damaged (CRC-32 mismatch); {_FIX}")


def _is_flatbuffer(head: bytes) -> bool:
    return IDENTIFIER in (head[4:8], head[8:12])


def arity(function) -> tuple[int, int] | None:
    """(arguments, results) of an `iree.runtime.VmFunction`, from the calling convention IREE
    prints in its repr; None when the repr does not show one."""
    m = _CONVENTION.search(repr(function))
    return (len(m.group(2)), len(m.group(3))) if m else None


def describe(main) -> list[dict[str, Any]]:
    """The public functions of a loaded module: name, (arguments, results), reflection."""
    out = []
    for name in main.function_names:
        fn = main.lookup_function(name)
        out.append({"name": name, "arity": arity(fn), "reflection": dict(fn.reflection)})
    return out


def check_module(vmfb: str | Path, config: str | Path | None = None) -> tuple[list[str], list[str]]:
    """(problems, notes) of a compiled module, and of `config` against it: the file's CRCs
    (runtime/vmfb.py), then IREE's own reading of it in a child process, so that a module that
    crashes IREE is reported instead of ending this one. Raises SharkportError when the file is
    not a whole module."""
    from ..export.abi import REFLECTION_KEY

    check_file(vmfb)
    command = [sys.executable, "-m", "sharkport.runtime.vmfb", str(vmfb)] + ([str(config)] if config else [])
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return ["IREE did not finish loading the module in 600 s; do not run it"], []
    if proc.returncode < 0:
        return [f"IREE crashed ({signal.Signals(-proc.returncode).name}) loading the module: do not run it; "
                "compile it again with `sharkport export --output-vmfb`"], []
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"IREE could not read the module ({tail})"], []
    if "error" in result:
        raise SharkportError(f"{vmfb}: not a module IREE can load ({result['error']}); compile it again "
                             "with `sharkport export --output-vmfb`")
    functions = {f["name"]: f for f in result["functions"] if "$" not in f["name"]}
    problems, notes = list(result["problems"]), []
    for kind in ("prefill", "decode"):
        if not any(re.fullmatch(rf"{kind}_bs\d+", name) for name in functions):
            problems.append(f"has no {kind}_bs<N> function; it was not exported by sharkport (docs/abi.md)")
    notes.append(f"functions: {', '.join(sorted(n for n in functions if not n.startswith('__')))}")
    facts = next((f["reflection"][REFLECTION_KEY] for f in functions.values() if REFLECTION_KEY in f["reflection"]),
                 None)
    notes.append(f"ABI facts: {facts}" if facts else
                 "carries no ABI facts (compiled before modules carried them): a config is checked against "
                 "its functions only")
    return problems, notes


def checked_against_module(main, config: ServiceConfig, vmfb, source: str) -> ServiceConfig:
    """`config` if the module has a function for each of its batch sizes and carries the same
    ABI facts (export.abi.MODULE_FACTS, in the functions' reflection), with the module's
    vocabulary; else one line naming both values. Modules exported before they carried their
    facts are checked for their functions only."""
    facts = None
    for kind, sizes in (("prefill", config.prefill_batch_sizes), ("decode", config.decode_batch_sizes)):
        for bs in sizes:
            fn = main.lookup_function(f"{kind}_bs{bs}")
            if fn is None:
                have = sorted(f for f in main.function_names if f.startswith(f"{kind}_bs") and "$" not in f)
                raise SharkportError(f"{source}: {kind} batch size {bs} is not in {vmfb} (it has "
                                     f"{', '.join(have) or 'none'}); use the config exported with the module")
            inputs = (3 if kind == "prefill" else 4) + config.tensor_parallelism_size  # + a cache per device
            have = arity(fn)
            if have is not None and have != (inputs, 1):
                raise SharkportError(f"{vmfb}: {kind}_bs{bs} takes {have[0]} arguments and gives {have[1]} "
                                     f"results; sharkport's ABI (docs/abi.md) has {inputs} and 1 for "
                                     f"{config.tensor_parallelism_size} device(s); use the config exported "
                                     "with the module")
            raw = fn.reflection.get(REFLECTION_KEY)
            if raw is not None and facts is None:
                try:
                    facts = json.loads(raw)
                except ValueError:
                    raise SharkportError(f"{vmfb}: its {REFLECTION_KEY} reflection is not JSON; compile the "
                                         "module again") from None
    if not isinstance(facts, dict):
        return config
    for name in MODULE_FACTS:
        value = getattr(config, name)
        if name == "vocab_size" and value is None:
            continue
        if facts.get(name) != value:
            raise SharkportError(f"{source}: {name} is {value!r}, but {vmfb} was exported with {facts.get(name)!r}; "
                                 "use the config exported with the module")
    return replace(config, vocab_size=facts.get("vocab_size"))


# The executable formats iree-compile writes for each GPU driver (a CPU module's are ELF or VMVX).
_GPU_FORMATS = {b"cuda-nvptx-fb": "cuda", b"rocm-hsaco-fb": "hip", b"vulkan-spirv-fb": "vulkan"}


def module_driver(vmfb: str | os.PathLike) -> str | None:
    """The GPU driver a compiled module's executables are for (`cuda`, `hip`, `vulkan`), or None
    for a CPU module: read from the executable formats the module names."""
    import mmap

    with open(vmfb, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for fmt, driver in _GPU_FORMATS.items():
                if m.find(fmt) >= 0:
                    return driver
    return None


def _main(argv: list[str]) -> int:
    import iree.runtime as rt


    vmfb = argv[0]
    instance = rt.VmInstance()
    try:
        main = rt.VmModule.mmap(instance, vmfb)
    except (RuntimeError, ValueError) as e:
        print(json.dumps({"error": " ".join(str(e).split())[:300]}))
        return 0
    result: dict[str, Any] = {"functions": describe(main), "problems": []}
    if len(argv) > 1:
        try:
            checked_against_module(main, ServiceConfig.load(argv[1]), vmfb, argv[1])
        except SharkportError as e:
            result["problems"].append(str(e))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
