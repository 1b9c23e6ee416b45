// What tools/matvec_harness.c and tools/attention_harness.c share: memory on 2 MiB pages and a
// spinning barrier, as a session has them.
#pragma once
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>

// bytes (rounded up to 2 MiB) on 2 MiB pages where Linux gives them, as a session holds the archive
// and the KV cache (sharkport/runtime/hugepages.py): on 4 KiB pages they read slower.
static void *huge_pages(size_t bytes) {
  const size_t huge = (size_t)2 << 20;
  bytes = (bytes + huge - 1) / huge * huge;
  void *p = aligned_alloc(huge, bytes);
  if (p) madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

// A barrier whose threads wait spinning, as IREE's workers wait for the next dispatch
// (sharkport.runtime.session.SPIN_US): a futex barrier's sleep and wake would cost a small product
// or a layer's attention more than its arithmetic. spin_barrier_init before the threads start.

static struct {
  atomic_int arrived, round;
  int threads;
} spin_barrier;

static void spin_barrier_init(int threads) {
  spin_barrier.arrived = 0;
  spin_barrier.threads = threads;
}

static void spin_barrier_wait(void) {
  int round = spin_barrier.round;
  if (++spin_barrier.arrived == spin_barrier.threads) {
    spin_barrier.arrived = 0;
    ++spin_barrier.round;
  } else {
    while (spin_barrier.round == round) __builtin_ia32_pause();
  }
}
