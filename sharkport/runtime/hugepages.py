"""Backing a session's large buffers with transparent huge pages (Linux).

The kernels read a module's weights from its archive as stored, streaming all of them every
decode step; the KV cache and the buffers the module's initializer writes sit beside them.
Mapped from the file, or allocated by glibc, they are on 4 KiB pages, and Linux backs memory with
huge pages only where asked (`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on most
distributions; a mapped file's pages stay 4 KiB). Streaming the weights then takes a TLB miss
every 4 KiB; in a virtual machine each walks the guest's and the host's page tables. On 2 MiB
pages decode takes fewer (docs/performance.md).

`snapshot()` before the context starts and `back_new_mappings(before, ranges)` after its buffers
exist (the weights its initializer read from the archive among them): the whole 2 MiB pages of
every anonymous mapping that appeared or grew meanwhile, and of the given buffers' ranges (the
caches: below glibc's mmap threshold malloc may place them in memory mapped before), are advised
MADV_HUGEPAGE and collapsed into huge pages now (MADV_COLLAPSE, Linux 6.1; elsewhere khugepaged
does it over time). Nothing changes where Linux says no (THP `never`, other systems).
SHARKPORT_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable

HUGE = 2 << 20  # x86-64's and arm64's (4 KiB granule) PMD page
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25

Mappings = dict[int, int]  # start -> end of each private anonymous writable mapping (and the heap)


def enabled() -> bool:
    """Whether sessions back their buffers with huge pages (Linux; SHARKPORT_HUGE_PAGES unset or 1)."""
    return sys.platform.startswith("linux") and os.environ.get("SHARKPORT_HUGE_PAGES", "1") != "0"


def snapshot() -> Mappings:
    """This process's private anonymous writable mappings, glibc's heap among them (malloc serves
    blocks below its mmap threshold, up to 32 MiB, from there); none where /proc is missing."""
    found = {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                anonymous = len(fields) == 5 or (len(fields) == 6 and fields[5] == "[heap]")
                if anonymous and fields[1].startswith("rw") and fields[1][3] == "p":
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    found[start] = end
    except OSError:
        pass
    return found


def back_new_mappings(before: Mappings, ranges: Iterable[tuple[int, int]] = ()) -> int:
    """Advises huge pages for, and collapses, the whole 2 MiB spans of what is new since `before`
    (new anonymous mappings, and the part a mapping grew by) and of `ranges` ((address, bytes):
    buffers malloc may have placed in memory the process mapped earlier, as glibc's heap);
    returns the bytes advised (0 where nothing was, or could be)."""
    extents = [(max(start, min(before.get(start, start), end)), end) for start, end in snapshot().items()]
    extents += [(address, address + size) for address, size in ranges]
    spans = set()  # the 2 MiB pages wholly inside them
    for lo, hi in extents:
        spans.update(range((lo + HUGE - 1) // HUGE * HUGE, hi // HUGE * HUGE, HUGE))
    if not spans:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    advised = 0
    for start, size in _runs(sorted(spans)):
        if madvise(start, size, MADV_HUGEPAGE) == 0:  # fails where THP is `never`: nothing to do
            advised += size
            madvise(start, size, MADV_COLLAPSE)  # best effort: without it khugepaged collapses later
    return advised


def _runs(starts: list[int]) -> list[tuple[int, int]]:
    """Sorted 2 MiB page addresses as (address, bytes) runs of adjacent pages."""
    runs = []
    for start in starts:
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + HUGE)
        else:
            runs.append((start, HUGE))
    return runs
