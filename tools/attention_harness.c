// Times sharkport/kernels/matvec.c's decode attention (with its write of the new position) outside
// IREE: SmolLM2-135M's shapes (9 query heads, 3 kv heads, head_dim 64, 30 layers, 32 positions a
// page), B sequences of LEN positions each (the last one written anew), every layer of a step in
// turn (a barrier after each, as IREE's dispatches), its workgroups (a sequence and as many of its
// kv heads as the exporter gives one for THREADS CPUs: kernels.kv_heads_per_workgroup) shared
// round robin among THREADS threads. CACHES distinct caches are used in turn (1: small ones stay
// in the caches; 4 at 480 positions, 88 MB: read from memory, as in decode, where a step's weights
// evict the cache between layers); `f16` at the end: a float16 cache
// (sharkport_decode_attention_f16). Prints the best of 5 trials.
//
// Built with the kernels' object as exports link it (built once, then cached):
//   cc -O2 -mf16c tools/attention_harness.c -o /tmp/attention_harness -lpthread $(python -c
//      "from sharkport.kernels import object_path; print(object_path())")      (one line)
//   /tmp/attention_harness B LEN CACHES THREADS REPS [f16]        (e.g. 1 480 4 2 3)
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>

#include "harness.h"

// A memref argument: (base, aligned, offset, size, stride).
#define MEMREF(T) T *, T *, size_t, size_t, size_t
#define ARG(p) (p), (p), (size_t)0, (size_t)1, (size_t)1
#define ATTENTION_ARGS(T)                                                                                   \
  MEMREF(const float), MEMREF(const float), MEMREF(const float), MEMREF(T), MEMREF(const int64_t),          \
      MEMREF(const int64_t), MEMREF(const int64_t), MEMREF(const int64_t), MEMREF(const float),             \
      MEMREF(const float), MEMREF(float), size_t blocks, size_t H, size_t Hkv, size_t D, size_t L,          \
      size_t stride, size_t R, size_t interleaved, size_t hpw, float scale, size_t window, size_t wg
void sharkport_decode_attention(ATTENTION_ARGS(float));
void sharkport_decode_attention_f16(ATTENTION_ARGS(uint16_t));

enum { H = 9, HKV = 3, D = 64, L = 30, STRIDE = 32 };
static int F16;
static size_t B, LEN, CACHES, THREADS, REPS, BLOCKS, HPW;
static void **caches;
static float *q, *knew, *vnew, *out, *rcos, *rsin;
static int64_t *pages, *starts, *lens;

static void *worker(void *arg) {
  size_t t = (size_t)arg;
  for (size_t r = 0; r < REPS; ++r)
    for (size_t c = 0; c < CACHES; ++c)
      for (size_t l = 0; l < L; ++l) {
        int64_t layer[2] = {(int64_t)l, L};
        for (size_t wg = t; wg < B * (HKV / HPW); wg += THREADS)
          if (F16)
            sharkport_decode_attention_f16(ARG(q), ARG(knew), ARG(vnew), ARG((uint16_t *)caches[c]), ARG(pages),
                                           ARG(starts), ARG(lens), ARG(layer), ARG(rcos), ARG(rsin), ARG(out), BLOCKS,
                                           H, HKV, D, L, STRIDE, D, 1, HPW, 0.125f, 0, wg);
          else
            sharkport_decode_attention(ARG(q), ARG(knew), ARG(vnew), ARG((float *)caches[c]), ARG(pages),
                                       ARG(starts), ARG(lens), ARG(layer), ARG(rcos), ARG(rsin), ARG(out), BLOCKS, H,
                                       HKV, D, L, STRIDE, D, 1, HPW, 0.125f, 0, wg);
        spin_barrier_wait();
      }
  return 0;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  if (argc != 6 && !(argc == 7 && !strcmp(argv[6], "f16"))) {
    fprintf(stderr, "usage: %s B LEN CACHES THREADS REPS [f16]\n", argv[0]);
    return 2;
  }
  F16 = argc == 7;
  B = atoi(argv[1]), LEN = atoi(argv[2]), CACHES = atoi(argv[3]), THREADS = atoi(argv[4]), REPS = atoi(argv[5]);
  if (!B || !LEN || !CACHES || !THREADS || THREADS > 64 || !REPS) {
    fprintf(stderr, "%s: B, LEN, CACHES, THREADS (at most 64) and REPS must be positive\n", argv[0]);
    return 2;
  }
  BLOCKS = (LEN + STRIDE - 1) / STRIDE;
  for (HPW = HKV; HPW > 1 && (HKV % HPW || B * (HKV / HPW) < THREADS); --HPW) {
  }  // kv heads a workgroup takes, as kernels.kv_heads_per_workgroup chooses for THREADS CPUs
  size_t page_count = B * BLOCKS, page_elems = (size_t)L * 2 * STRIDE * HKV * D;
  caches = malloc(CACHES * sizeof *caches);
  for (size_t c = 0; c < CACHES; ++c) {
    caches[c] = huge_pages(page_count * page_elems * (F16 ? 2 : 4));
    for (size_t i = 0; i < page_count * page_elems; ++i) {
      float x = (float)((i * 2654435761u) % 1000) / 1000 - 0.5f;
      if (F16)
        ((uint16_t *)caches[c])[i] = _cvtss_sh(x, 0);
      else
        ((float *)caches[c])[i] = x;
    }
  }
  pages = malloc(page_count * sizeof *pages), starts = malloc(B * sizeof *starts), lens = malloc(B * sizeof *lens);
  for (size_t i = 0; i < page_count; ++i) pages[i] = (int64_t)i;
  for (size_t b = 0; b < B; ++b) starts[b] = (int64_t)LEN - 1, lens[b] = (int64_t)LEN;
  q = malloc(B * H * D * sizeof(float)), out = malloc(B * H * D * sizeof(float));
  knew = malloc(B * HKV * D * sizeof(float)), vnew = malloc(B * HKV * D * sizeof(float));
  for (size_t i = 0; i < B * HKV * D; ++i) knew[i] = (float)(i % 5) / 5 - 0.4f, vnew[i] = (float)(i % 3) / 3 - 0.3f;
  rcos = malloc(B * D / 2 * sizeof(float)), rsin = malloc(B * D / 2 * sizeof(float));
  for (size_t i = 0; i < B * H * D; ++i) q[i] = (float)(i % 7) / 7 - 0.3f;
  for (size_t i = 0; i < B * D / 2; ++i) rcos[i] = 0.8f, rsin[i] = 0.6f;
  double best = 1e30;
  for (int trial = 0; trial < 5; ++trial) {
    pthread_t threads[64];
    spin_barrier_init((int)THREADS);
    double t0 = now();
    for (size_t t = 0; t < THREADS; ++t) pthread_create(&threads[t], 0, worker, (void *)t);
    for (size_t t = 0; t < THREADS; ++t) pthread_join(threads[t], 0);
    double step = (now() - t0) / (REPS * CACHES);
    best = step < best ? step : best;
  }
  double bytes = (double)B * L * 2 * HKV * D * (F16 ? 2 : 4) * LEN, sum = 0;
  for (size_t i = 0; i < B * H * D; ++i) sum += out[i];
  printf("%s cache, B %zu, %zu positions, %zu caches, %zu threads, %zu kv heads a workgroup: %.1f us a step (30 layers),"
         " %.1f GB/s of K and V (output sum %.6f)\n",
         F16 ? "float16" : "float32", B, LEN, CACHES, THREADS, HPW, best * 1e6, bytes / best / 1e9, sum);
  return 0;
}
