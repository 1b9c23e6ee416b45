#!/usr/bin/env python
"""Where a decode or prefill call of tools/bench.py's modules spends its time: `perf` samples of
this process calling it in a loop, each sample named by the module function (IREE dispatch or
hand-written kernel) or library it fell in. Shares are of all the process's samples (IREE's
workers and the calling thread):

    python tools/profile_step.py [--model smollm2] [--type q4_1] [--function decode|prefill] [--batch 1]
                                 [--kv-cache-dtype float16] [--seconds 6] [--work-dir artifacts/bench]
                                 [--mlir edited-copy-of-the-bench-module.mlir]

Needs the module and archive tools/bench.py writes (run it first, with the same --model and
`--types TYPE`), Linux `perf` and binutils (`readelf`, `nm`). Decode runs at positions 128 to 163,
as the bench's.

IREE loads a module's executable (an ELF) into anonymous memory, where perf cannot name the
functions. So the bench MLIR is compiled again with the same flags and
--iree-hal-dump-executable-binaries-to (the same code, and a copy of the ELF); the image base is
the anonymous executable mapping in /proc/self/maps that holds the samples less the copy's address
of its executable segment, and functions are named from the copy: the kernels by their symbols,
IREE's dispatches by their debug info.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import KV_SUFFIX, MODELS, Subject

from sharkport.compile import compile_mlir
from sharkport.kernels import object_name, object_path, objects_named_by


def functions(elf: Path) -> list[tuple[int, int, str]]:
    """(address, size, name) of the ELF's functions: DWARF subprograms (IREE's dispatches) and
    symbols (the kernels), sorted."""
    found = {}
    info = subprocess.run(["readelf", "--debug-dump=info", str(elf)], capture_output=True, text=True,
                          check=True).stdout
    for entry in info.split("DW_TAG_subprogram")[1:]:
        low = re.search(r"DW_AT_low_pc\s*:\s*(0x[0-9a-f]+)", entry)
        size = re.search(r"DW_AT_high_pc\s*:\s*(0x[0-9a-f]+)", entry)
        name = re.search(r"DW_AT_linkage_name\s*:.*?: (\S+)\n", entry)
        if low and size and name and int(low.group(1), 16):
            found[int(low.group(1), 16)] = (int(size.group(1), 16), name.group(1))
    for address, size, _, name in code_symbols(elf):
        found[address] = (size, name)
    return sorted((a, s, n) for a, (s, n) in found.items())


def code_symbols(path: Path) -> list[tuple[int, int, bool, str]]:
    """(address, size, global, name) of the functions in an ELF file's symbol table (`nm`)."""
    out = []
    for line in subprocess.run(["nm", "-S", "--defined-only", str(path)], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "Tt":
            out.append((int(parts[0], 16), int(parts[1], 16), parts[2] == "T", parts[3]))
    return out


def static_helpers(obj: Path, table: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """(address, size, name) in the linked executable whose functions are `table` of the kernels
    object's local functions (the loops' static helpers, e.g. q4_x8_4), whose symbols the link
    drops: the object's one .text section is linked whole, so a global kernel's address in both
    gives the offset."""
    at_elf = {n: a for a, _, n in table}
    symbols = code_symbols(obj)
    offset = next((at_elf[n] - a for a, _, is_global, n in symbols if is_global and n in at_elf), None)
    if offset is None:
        return []
    return [(a + offset, s, n.split(".")[0]) for a, s, is_global, n in symbols if not is_global]


def anonymous_mappings() -> list[tuple[int, int, str]]:
    """(start, end, permissions) of this process's anonymous mappings."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) == 5 or (len(parts) > 5 and not parts[5].startswith(("/", "["))):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[1]))
    return out


def text_page(elf: Path) -> int:
    """The address, in the ELF, of the page its executable segment starts on."""
    headers = subprocess.run(["readelf", "-lW", str(elf)], capture_output=True, text=True, check=True).stdout
    for line in headers.splitlines():
        parts = line.split()
        if parts[:1] == ["LOAD"] and "E" in parts[6:-1]:
            return int(parts[2], 16) & ~0xFFF
    raise SystemExit(f"profile_step: {elf} has no executable segment")


def image_of(ips: list[int], mappings, text: int) -> tuple[int, int, int]:
    """(image base, start, end) of the anonymous executable mapping holding the most samples: the
    ELF's executable segment, whose first page is at `text` in the ELF. (Anonymous memory mapped
    next to the image, as a module's gathered weights may be, is not the image's.)"""
    counts = collections.Counter()
    for ip in ips:
        for lo, hi, perm in mappings:
            if "x" in perm and lo <= ip < hi:
                counts[lo, hi] += 1
                break
    if not counts:
        raise SystemExit("profile_step: no samples fell in an anonymous executable mapping (the module's code)")
    (lo, hi), _ = counts.most_common(1)[0]
    return lo - text, lo, hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("artifacts/bench"))
    parser.add_argument("--model", choices=list(MODELS), default="smollm2", help="the bench's model (default smollm2)")
    parser.add_argument("--type", default="q4_1", help="one of the types the bench measured (default q4_1)")
    parser.add_argument("--function", default="decode", choices=["decode", "prefill"])
    parser.add_argument("--batch", type=int, default=1, choices=[1, 4], help="decode's batch size (default 1)")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_SUFFIX), default="float16",
                        help="which of the bench's modules (default float16, the bench's default)")
    parser.add_argument("--mlir", type=Path, help="profile this MLIR instead of the bench's (an edited copy of it)")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long to sample (default 6)")
    parser.add_argument("--top", type=int, default=25, help="rows to print (default 25)")
    args = parser.parse_args()
    for tool in ("perf", "readelf", "nm"):
        if not shutil.which(tool):
            raise SystemExit(f"profile_step: `{tool}` is not on PATH; install linux perf and binutils")
    kv = KV_SUFFIX[args.kv_cache_dtype]
    stem = args.work_dir / f"{args.model}-{args.type}"
    mlir, cfg, irpa = args.mlir or Path(f"{stem}{kv}.mlir"), Path(f"{stem}{kv}.json"), Path(f"{stem}.irpa")
    for f in (mlir, cfg, irpa):
        if not f.exists():
            raise SystemExit(f"profile_step: {f} does not exist; make it with "
                             f"`python tools/bench.py --model {args.model} --types {args.type} "
                             f"--kv-cache-dtype {args.kv_cache_dtype}`")

    linked = objects_named_by(mlir)  # the MLIR names the kernels object it was exported with
    if linked and object_name() not in linked:
        print(f"profile_step: note: {mlir} links {', '.join(sorted(linked))}, the kernels of the matvec.c it was "
              f"exported with, not the current one's ({object_name()}); export it again to profile the current "
              "kernels", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"compiling {mlir} with its executable dumped ...", file=sys.stderr)
        compile_mlir(mlir, tmp / "module.vmfb", extra_flags=[f"--iree-hal-dump-executable-binaries-to={tmp}"])
        elf = next(tmp.glob("*.so"))
        subject = Subject(tmp / "module.vmfb", irpa, cfg)

        def call() -> float:
            if args.function == "prefill":
                return subject.prefill()
            if subject.position[args.batch] >= subject.start + 36:  # positions 128 to 163, as the bench
                subject.position[args.batch] = subject.start
            return subject.decode(args.batch)

        for _ in range(10):
            call()
        data = tmp / "perf.data"
        perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-p", str(os.getpid()), "-o", str(data)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # perf attaches
        times, start = [], time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            times.append(call())
        mappings = anonymous_mappings()
        perf.send_signal(signal.SIGINT)  # perf writes its data, then dies of the signal
        if perf.wait() not in (0, -signal.SIGINT) or not data.exists():
            raise SystemExit("profile_step: perf record failed (is perf_event_paranoid above 1? "
                             "try `sysctl kernel.perf_event_paranoid=1`)")
        script = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,dso"], capture_output=True, text=True,
                                check=True).stdout
        samples = []
        for line in script.splitlines():
            parts = line.split(None, 1)
            if len(parts) == 2:
                samples.append((int(parts[0], 16), parts[1].strip("() ")))
        base, lo, hi = image_of([ip for ip, _ in samples], mappings, text_page(elf))
        table = functions(elf)
        if linked == {object_name()}:  # compiled just now, so its object is in the cache
            table = sorted(table + static_helpers(object_path(), table))

    counts = collections.Counter()
    for ip, dso in samples:
        if lo <= ip < hi:
            off = ip - base
            name = next((n for a, s, n in table if a <= off < a + s), "module: code without a symbol (static helpers)")
        else:
            name = f"[{Path(dso).name}]"
        counts[name] += 1
    what = f"{args.function} bs{args.batch}" if args.function == "decode" else "prefill of 128 tokens"
    print(f"{args.type}{kv} {what}: median {statistics.median(times) * 1e3:.2f} ms over {len(times)} calls; "
          f"{len(samples)} samples; share of the process's samples by function (module) or library [...]:")
    shown = 0.0
    for name, n in counts.most_common(args.top):
        share = 100 * n / len(samples)
        shown += share
        print(f"{share:5.1f}%  {name}")
    print(f"{100 - shown:5.1f}%  (the rest)")


if __name__ == "__main__":
    main()
