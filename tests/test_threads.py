"""Threads on one session (docs/generation.md): runs share the cache's pages, a run short of
pages waits for another to finish, and every run's tokens are what it gives alone."""

from __future__ import annotations

import threading
import time

import pytest

from sharkport.errors import SharkportError
from sharkport.runtime.generate import PageAllocator, generate
from sharkport.runtime.session import IreeSession


def test_threads_wait_for_pages_and_agree_with_runs_alone(compiled_of):
    vmfb, irpa, config = compiled_of("gqa-untied")
    # 4 pages of 16 positions: a run takes a scratch page and 2 for its 10 + 20 tokens, so two
    # runs never fit at once and each thread waits for the one before.
    session = IreeSession(vmfb, irpa, config, pages=4)
    prompts = [[7 * i + j for j in range(1, 11)] for i in range(4)]
    alone = [generate(session, [p], 20)[0] for p in prompts]
    results, errors = [None] * 4, []

    def work(i: int) -> None:
        try:
            results[i] = generate(session, [prompts[i]], 20)[0]
        except Exception as e:  # noqa: BLE001 - the assertion below shows it
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and results == alone
    assert session._page_allocator.free_count == 4


def test_allocator_waits_for_other_threads_only():
    allocator = PageAllocator(3, wait_s=0.2)
    held: list[int] = []
    holder = threading.Thread(target=lambda: held.extend(allocator.alloc(2)))  # pages another thread holds
    holder.start()
    holder.join()
    with pytest.raises(SharkportError, match="the KV cache has 3 free pages but 4"):
        PageAllocator(3).alloc(4, wait=True)  # more than the cache has: no waiting
    t0 = time.monotonic()
    with pytest.raises(SharkportError, match="waited 0.2 s for 2 free KV cache pages"):
        allocator.alloc(2, wait=True)
    assert time.monotonic() - t0 >= 0.2
    mine = allocator.alloc(1)
    with pytest.raises(SharkportError, match="the KV cache has 0 free pages but 3"):
        allocator.alloc(3, wait=True)  # its own page would never come back while it waited
    allocator.free(mine)
    threading.Timer(0.05, allocator.free, args=(held,)).start()
    allocator.wait_s = 5
    assert len(allocator.alloc(2, wait=True)) == 2
