// How many AVX2 operations of each kind a core completes per nanosecond, as the matvec kernels use
// them (tools/bench_kernels.py builds and runs it): 12 independent chains of one operation, so that
// its throughput, not its latency, is timed. THREADS threads run the same loops at once (2 on 2
// CPUs: whether the CPUs share a core's pipes). Prints per operation the slowest thread's rate.
//
//   vector_ops THREADS
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ITERATIONS 50000000L
#define CHAINS 12
enum { MADDUBS, MADD, ADD16, UNPACK, HADD, FMA, KINDS };
static const char *NAMES[KINDS] = {"maddubs", "madd", "add16", "unpack", "hadd", "fma"};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// Keeps the twelve chains in registers and their results live.
#define KEEP(v)                                                                                            \
  __asm__ volatile("" : "+x"(v##0), "+x"(v##1), "+x"(v##2), "+x"(v##3), "+x"(v##4), "+x"(v##5), "+x"(v##6), \
                   "+x"(v##7), "+x"(v##8), "+x"(v##9), "+x"(v##10), "+x"(v##11))
#define ALL(OP, v) \
  OP(v##0); OP(v##1); OP(v##2); OP(v##3); OP(v##4); OP(v##5); OP(v##6); OP(v##7); OP(v##8); OP(v##9); OP(v##10); OP(v##11)

static double integer_rate(int kind) {
  __m256i c = _mm256_set1_epi8(3), a0 = _mm256_set1_epi8(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
          a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
#define STEP_MADDUBS(a) a = _mm256_maddubs_epi16(c, a)
#define STEP_MADD(a) a = _mm256_madd_epi16(c, a)
#define STEP_ADD16(a) a = _mm256_add_epi16(c, a)
#define STEP_UNPACK(a) a = _mm256_unpacklo_epi16(c, a)
#define STEP_HADD(a) a = _mm256_hadd_epi16(c, a)
  double t0 = now();
  for (long i = 0; i < ITERATIONS; ++i) {
    switch (kind) {
      case MADDUBS: ALL(STEP_MADDUBS, a); break;
      case MADD: ALL(STEP_MADD, a); break;
      case ADD16: ALL(STEP_ADD16, a); break;
      case UNPACK: ALL(STEP_UNPACK, a); break;
      default: ALL(STEP_HADD, a); break;
    }
    KEEP(a);
  }
  return CHAINS * (double)ITERATIONS / (now() - t0) / 1e9;
}

static double fma_rate(void) {
  __m256 g = _mm256_set1_ps(0.999f), f0 = _mm256_set1_ps(1.0f), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0,
         f6 = f0, f7 = f0, f8 = f0, f9 = f0, f10 = f0, f11 = f0;
#define STEP_FMA(f) f = _mm256_fmadd_ps(g, f, g)
  double t0 = now();
  for (long i = 0; i < ITERATIONS; ++i) {
    ALL(STEP_FMA, f);
    KEEP(f);
  }
  return CHAINS * (double)ITERATIONS / (now() - t0) / 1e9;
}

static pthread_barrier_t barrier;

static void *worker(void *arg) {
  double *rates = arg;
  for (int kind = 0; kind < KINDS; ++kind) {
    pthread_barrier_wait(&barrier);  // the threads time each operation at the same time
    rates[kind] = kind == FMA ? fma_rate() : integer_rate(kind);
  }
  return 0;
}

int main(int argc, char **argv) {
  int threads = argc == 2 ? atoi(argv[1]) : 0;
  if (threads < 1 || threads > 64) {
    fprintf(stderr, "usage: %s THREADS (1 to 64)\n", argv[0]);
    return 2;
  }
  pthread_t t[64];
  double rates[64][KINDS];
  pthread_barrier_init(&barrier, 0, threads);
  for (int i = 0; i < threads; ++i) pthread_create(&t[i], 0, worker, rates[i]);
  for (int i = 0; i < threads; ++i) pthread_join(t[i], 0);
  for (int kind = 0; kind < KINDS; ++kind) {
    double slowest = rates[0][kind];
    for (int i = 1; i < threads; ++i) slowest = rates[i][kind] < slowest ? rates[i][kind] : slowest;
    printf("%s %.2f\n", NAMES[kind], slowest);
  }
  return 0;
}
