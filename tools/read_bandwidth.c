// Memory read bandwidth of this machine, for tools/bench.py's decode limits: THREADS threads
// (default: every CPU this process may use) each sum their share of a BYTES buffer (default
// 512 MiB, far beyond the caches) with independent vector accumulators, REPEAT times; prints the
// median rate and the best in bytes/s (the median is what decode's median steps are set against:
// on a shared host the best read catches a moment of quiet that a step rarely sees). The buffer
// is on 2 MiB pages where Linux gives them (MADV_HUGEPAGE), as a session's weights are
// (sharkport/runtime/hugepages.py), unless SHARKPORT_HUGE_PAGES=0: in a virtual machine 4 KiB
// pages read about 10% slower. Built and run by
// tools/bench.py with the system C compiler:
//
//     cc -O2 -march=native -pthread tools/read_bandwidth.c -o read_bandwidth && ./read_bandwidth [BYTES [THREADS [REPEAT]]]
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define MAX_REPEAT 1000

typedef float v8 __attribute__((vector_size(32), aligned(32)));

typedef struct {
  const v8 *p;
  size_t n;  // vectors
  float sum;
} share;

static void *sum(void *arg) {
  share *s = arg;
  v8 a = {0}, b = {0}, c = {0}, d = {0};
  for (size_t i = 0; i + 4 <= s->n; i += 4) a += s->p[i], b += s->p[i + 1], c += s->p[i + 2], d += s->p[i + 3];
  v8 t = a + b + c + d;
  s->sum = t[0] + t[7];  // kept, so the loop is not optimised away
  return NULL;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int ascending(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  cpu_set_t cpus;
  sched_getaffinity(0, sizeof cpus, &cpus);
  size_t bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)512 << 20;
  int threads = argc > 2 ? atoi(argv[2]) : CPU_COUNT(&cpus), repeat = argc > 3 ? atoi(argv[3]) : 10;
  if (threads < 1 || threads > 256 || bytes < (size_t)threads * 128 || repeat < 1 || repeat > MAX_REPEAT) {
    fprintf(stderr, "read_bandwidth: bad arguments (BYTES >= 128 * THREADS, 1 <= THREADS <= 256, "
                    "1 <= REPEAT <= 1000)\n");
    return 2;
  }
  size_t vectors = bytes / sizeof(v8) / threads / 4 * 4 * threads, huge = (size_t)2 << 20;
  size_t size = (vectors * sizeof(v8) + huge - 1) / huge * huge;  // whole 2 MiB pages
  v8 *buffer = aligned_alloc(huge, size);
  if (!buffer) {
    fprintf(stderr, "read_bandwidth: cannot allocate %zu bytes\n", bytes);
    return 1;
  }
  const char *pages = getenv("SHARKPORT_HUGE_PAGES");
#ifdef MADV_HUGEPAGE
  if (!pages || strcmp(pages, "0")) madvise(buffer, size, MADV_HUGEPAGE);  // before the first touch
#endif
  memset(buffer, 1, vectors * sizeof(v8));  // touch every page before timing
  pthread_t tid[256];
  share shares[256];
  double rates[MAX_REPEAT];
  for (int r = 0; r < repeat; ++r) {
    double t0 = now();
    for (int t = 0; t < threads; ++t) {
      shares[t] = (share){buffer + t * (vectors / threads), vectors / threads, 0};
      pthread_create(&tid[t], NULL, sum, &shares[t]);
    }
    for (int t = 0; t < threads; ++t) pthread_join(tid[t], NULL);
    rates[r] = vectors * sizeof(v8) / (now() - t0);
  }
  qsort(rates, repeat, sizeof *rates, ascending);
  double median = repeat % 2 ? rates[repeat / 2] : (rates[repeat / 2 - 1] + rates[repeat / 2]) / 2;
  printf("%.0f %.0f\n", median, rates[repeat - 1]);
  free(buffer);
  return 0;
}
