"""Sessions back their large buffers (those the module's initializer reads the weights into, the
KV cache) with transparent huge pages: the kernel's own accounting (/proc/self/smaps) must show
them."""

import ctypes
import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from sharkport.runtime import hugepages
from sharkport.runtime.session import IreeSession, _host_range

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages not `never`")
MIB = 1 << 20


def huge_kib(start: int, end: int) -> int:
    """AnonHugePages (KiB) of this process's mappings overlapping [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            inside = lo < end and start < hi
        elif inside and fields[0] == "AnonHugePages:":
            total += int(fields[1])
    return total


def address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def test_a_new_mapping_is_collapsed_into_huge_pages():
    before = hugepages.snapshot()
    m = mmap.mmap(-1, 16 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(b"\1" * len(m))  # its pages exist, on 4 KiB pages (THP is `madvise` or `always`)
    start = address(m)
    advised = hugepages.back_new_mappings(before)
    assert advised >= 14 * MIB  # the whole 2 MiB spans inside it: 7 or 8 of them
    assert huge_kib(start, start + len(m)) >= 2048  # at least one huge page now backs it
    assert m[:4] == b"\1\1\1\1" and m[-1] == 1  # the data stayed
    m.close()


def test_mappings_seen_before_are_left_alone():
    m = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(b"\1" * len(m))
    start = address(m)
    assert hugepages.back_new_mappings(hugepages.snapshot()) == 0
    assert huge_kib(start, start + len(m)) == 0 or "[always]" in THP.read_text()
    m.close()


@pytest.mark.slow
def test_a_sessions_weights_and_cache_are_on_huge_pages_unless_turned_off(compiled_of, monkeypatch):
    vmfb, irpa, config = compiled_of("gqa-untied")
    on = IreeSession(vmfb, irpa, config, pages=4096)
    start, size = _host_range(on._caches[0])
    assert size >= 16 * MIB
    # the weights the initializer read from the archive into its buffers, and the cache
    assert on.huge_page_bytes >= Path(irpa).stat().st_size + size - 8 * MIB
    assert huge_kib(start, start + size) * 1024 >= size - 4 * MIB  # wherever malloc put it
    monkeypatch.setenv("SHARKPORT_HUGE_PAGES", "0")
    off = IreeSession(vmfb, irpa, config, pages=4096)
    assert off.huge_page_bytes == 0
    tokens = np.arange(1, 17, dtype=np.int64)[None]
    pages = np.array([[0]], np.int64)
    a, b = (np.array(s.prefill(tokens, np.array([16]), pages)) for s in (on, off))
    np.testing.assert_array_equal(a, b)  # the same module on other pages computes the same
