// A barrier whose threads wait spinning, as IREE's workers wait for the next dispatch
// (sharkport.runtime.session.SPIN_US), for tools/matvec_harness.c and tools/attention_harness.c: a
// futex barrier's sleep and wake would cost a small product or a layer's attention more than its
// arithmetic. spin_barrier_init before the threads start; one barrier at a time.
#pragma once
#include <stdatomic.h>

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
