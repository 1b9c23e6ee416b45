// Times sharkport/kernels/matvec.c's products outside IREE (tools/bench_kernels.py builds and runs
// it): y = x w^T for M rows of x and N x K weights of one type, `copies` distinct copies of w
// multiplied in turn (1: w stays in the caches; enough to pass the L3: read from memory), the
// workgroups of each product shared among T threads as IREE's workers share them (a barrier after
// each product). Prints the best of 5 trials: microseconds a product and GB/s of weights read.
//
//   matvec_harness TYPE M N K COPIES THREADS REPS
//
// TYPE: q4_1, q8_0, q5_0, q4_k, q6_k, q4_1-stored, q8_0-stored, f16 or f16-swiglu. q4_1, q8_0 and
// q5_0 multiply as an exported module does: the rows of w interleaved eight at a time
// (sharkport.kernels.interleave_rows; N a multiple of 8), by sharkport_matvec_q4_1x8, _q8_0x8 and
// _q5_0x8 (Q5_0's random fifth bits need no placing: they are as random in any order). q4_k and
// q6_k are Q4_KX8 and Q6_KX8 (_q4_kx8, _q6_kx8; K a multiple of 256), every byte of their planes
// random: a product's work does not depend on the values' order. The -stored types read w as stored, a
// row at a time (what modules do for matrices of other row counts). f16-swiglu is the gate and up
// projections' product, silu(x a^T) * (x b^T) (sharkport_matvec_swiglu_f16), b the copy of w half
// the copies on from a; its GB/s count both.
#define _GNU_SOURCE  // sched_getaffinity
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"

// A memref argument: (base, aligned, offset, size, stride).
#define MEMREF(T) T *, T *, size_t, size_t, size_t
#define ARG(p) (p), (p), (size_t)0, (size_t)1, (size_t)1
void sharkport_matvec_q4_1(MEMREF(const float), MEMREF(const uint8_t), MEMREF(const uint16_t),
                           MEMREF(const uint16_t), MEMREF(float), size_t, size_t, size_t, size_t, size_t);
void sharkport_matvec_q4_1x8(MEMREF(const float), MEMREF(const uint8_t), MEMREF(const uint16_t),
                             MEMREF(const uint16_t), MEMREF(float), size_t, size_t, size_t, size_t, size_t);
void sharkport_matvec_q5_0x8(MEMREF(const float), MEMREF(const uint8_t), MEMREF(const uint16_t),
                             MEMREF(const uint8_t), MEMREF(float), size_t, size_t, size_t, size_t, size_t);
void sharkport_matvec_q8_0x8(MEMREF(const float), MEMREF(const int8_t), MEMREF(const uint16_t), MEMREF(float),
                             size_t, size_t, size_t, size_t, size_t);
void sharkport_matvec_q8_0(MEMREF(const float), MEMREF(const int8_t), MEMREF(const uint16_t), MEMREF(float),
                           size_t, size_t, size_t, size_t, size_t);
void sharkport_matvec_q4_kx8(MEMREF(const float), MEMREF(const uint8_t), MEMREF(const uint16_t), MEMREF(const uint16_t),
                             MEMREF(const uint8_t), MEMREF(float), size_t, size_t, size_t, size_t, size_t);
void sharkport_matvec_q6_kx8(MEMREF(const float), MEMREF(const uint8_t), MEMREF(const uint16_t), MEMREF(const uint8_t),
                             MEMREF(const uint8_t), MEMREF(float), size_t, size_t, size_t, size_t, size_t);
void sharkport_matvec_f16(MEMREF(const float), MEMREF(const uint16_t), MEMREF(float), size_t, size_t, size_t,
                          size_t, size_t);
void sharkport_matvec_swiglu_f16(MEMREF(const float), MEMREF(const uint16_t), MEMREF(const uint16_t), MEMREF(float),
                                 size_t, size_t, size_t, size_t, size_t);

enum { Q4_1, Q8_0, F16, Q4_1_STORED, Q8_0_STORED, F16_SWIGLU, Q5_0, Q4_K, Q6_K };
typedef struct {
  int type, thread, threads, reps;
  size_t M, N, K, rows, workgroups, copies;
  uint8_t **qs, **sc;  // sc: the K-quants' scales
  uint16_t **d, **m;   // m: Q4_1's offsets, Q5_0's and Q6_K's high bits, Q4_K's dmin
  float *x, *y;
} job;

static void product(const job *j, size_t c) {
  for (size_t wg = j->thread; wg < j->workgroups; wg += j->threads) {
    if (j->type == Q4_1)
      sharkport_matvec_q4_1x8(ARG(j->x), ARG(j->qs[c]), ARG(j->d[c]), ARG(j->m[c]), ARG(j->y), j->M, j->N, j->K,
                              j->rows, wg);
    else if (j->type == Q5_0)
      sharkport_matvec_q5_0x8(ARG(j->x), ARG(j->qs[c]), ARG(j->d[c]), ARG((const uint8_t *)j->m[c]), ARG(j->y), j->M,
                              j->N, j->K, j->rows, wg);
    else if (j->type == Q4_K)
      sharkport_matvec_q4_kx8(ARG(j->x), ARG(j->qs[c]), ARG(j->d[c]), ARG(j->m[c]), ARG(j->sc[c]), ARG(j->y), j->M,
                              j->N, j->K, j->rows, wg);
    else if (j->type == Q6_K)
      sharkport_matvec_q6_kx8(ARG(j->x), ARG(j->qs[c]), ARG(j->d[c]), ARG((const uint8_t *)j->m[c]), ARG(j->sc[c]),
                              ARG(j->y), j->M, j->N, j->K, j->rows, wg);
    else if (j->type == Q4_1_STORED)
      sharkport_matvec_q4_1(ARG(j->x), ARG(j->qs[c]), ARG(j->d[c]), ARG(j->m[c]), ARG(j->y), j->M, j->N, j->K,
                            j->rows, wg);
    else if (j->type == Q8_0)
      sharkport_matvec_q8_0x8(ARG(j->x), ARG((const int8_t *)j->qs[c]), ARG(j->d[c]), ARG(j->y), j->M, j->N, j->K,
                              j->rows, wg);
    else if (j->type == Q8_0_STORED)
      sharkport_matvec_q8_0(ARG(j->x), ARG((const int8_t *)j->qs[c]), ARG(j->d[c]), ARG(j->y), j->M, j->N, j->K,
                            j->rows, wg);
    else if (j->type == F16_SWIGLU)  // the up projection: the copy half the copies on
      sharkport_matvec_swiglu_f16(ARG(j->x), ARG((const uint16_t *)j->qs[c]),
                                  ARG((const uint16_t *)j->qs[(c + j->copies / 2) % j->copies]), ARG(j->y), j->M,
                                  j->N, j->K, j->rows, wg);
    else
      sharkport_matvec_f16(ARG(j->x), ARG((const uint16_t *)j->qs[c]), ARG(j->y), j->M, j->N, j->K, j->rows, wg);
  }
}

static void *worker(void *arg) {
  const job *j = arg;
  for (int r = 0; r < j->reps; ++r)
    for (size_t c = 0; c < j->copies; ++c) {
      product(j, c);
      spin_barrier_wait();
    }
  return 0;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
  if (argc != 8) {
    fprintf(stderr, "usage: %s TYPE M N K COPIES THREADS REPS\n", argv[0]);
    return 2;
  }
  int type = !strcmp(argv[1], "q4_1") ? Q4_1 : !strcmp(argv[1], "q8_0") ? Q8_0 : !strcmp(argv[1], "f16") ? F16
             : !strcmp(argv[1], "q4_1-stored") ? Q4_1_STORED : !strcmp(argv[1], "q8_0-stored") ? Q8_0_STORED
             : !strcmp(argv[1], "f16-swiglu")  ? F16_SWIGLU : !strcmp(argv[1], "q5_0") ? Q5_0
             : !strcmp(argv[1], "q4_k")        ? Q4_K : !strcmp(argv[1], "q6_k") ? Q6_K : -1;
  size_t M = atol(argv[2]), N = atol(argv[3]), K = atol(argv[4]), copies = atol(argv[5]);
  int threads = atoi(argv[6]), reps = atoi(argv[7]);
  int kq = type == Q4_K || type == Q6_K;
  if (type < 0 || !M || M > 8 || !N || !K || K % (kq ? 256 : 32) || !copies || threads < 1 || threads > 64 ||
      reps < 1 || ((type == Q4_1 || type == Q8_0 || type == Q5_0 || kq) && N % 8)) {
    fprintf(stderr, "%s: bad arguments\n", argv[0]);
    return 2;
  }
  // as sharkport.kernels.ops exports for this machine: min(256, 32 ceil(N / (32 W))) outputs a
  // workgroup, W two workgroups for each CPU this process may run on (kernels.workgroups)
  cpu_set_t cpus;
  size_t W = 2 * (sched_getaffinity(0, sizeof cpus, &cpus) ? 1 : (size_t)CPU_COUNT(&cpus));
  size_t rows = 32 * ((N + 32 * W - 1) / (32 * W)), B = K / 32;
  rows = rows < 256 ? rows : 256;
  int q4 = type == Q4_1 || type == Q4_1_STORED, q8 = type == Q8_0 || type == Q8_0_STORED;
  size_t qbytes = q4 || type == Q5_0 || kq ? N * K / 2 : q8 ? N * K : 2 * N * K;  // of one matrix
  size_t plane_bytes = type == F16 || type == F16_SWIGLU ? 0 : kq ? 2 * N * (K / 256) : 2 * N * B;  // each of d (and m)
  size_t m_bytes = type == Q5_0 ? N * K / 8 : type == Q6_K ? N * K / 4 : q4 || type == Q4_K ? plane_bytes : 0;  // read of m
  size_t sc_bytes = type == Q4_K ? 12 * N * (K / 256) : type == Q6_K ? 16 * N * (K / 256) : 0;
  // K-quants: every byte random (the layout's order does not change the work), d and dmin small
  uint8_t **qs = calloc(copies, sizeof *qs), **sc = calloc(copies, sizeof *sc);
  uint16_t **d = calloc(copies, sizeof *d), **m = calloc(copies, sizeof *m);
  srand(1);
  for (size_t c = 0; c < copies; ++c) {
    qs[c] = huge_pages(qbytes);
    d[c] = huge_pages(plane_bytes + 2);
    m[c] = huge_pages((m_bytes > plane_bytes ? m_bytes : plane_bytes) + 2);
    sc[c] = huge_pages(sc_bytes + 2);
    for (size_t i = 0; i < sc_bytes; ++i) sc[c][i] = rand();
    if (type == F16 || type == F16_SWIGLU)
      for (size_t i = 0; i < N * K; ++i) ((uint16_t *)qs[c])[i] = 0x3000 | (rand() & 0x83ff);  // |w| in [0.125, 0.25)
    else
      for (size_t i = 0; i < qbytes; ++i) qs[c][i] = rand();
    for (size_t i = 0; i < plane_bytes / 2; ++i) d[c][i] = 0x2000 | (rand() & 0xff), m[c][i] = 0xa000 | (rand() & 0xff);
    if (type == Q5_0 || type == Q6_K)
      for (size_t i = 0; i < m_bytes; ++i) ((uint8_t *)m[c])[i] = rand();
  }
  if (type == Q4_1 || type == Q8_0) {  // as sharkport.kernels.interleave_rows
    size_t row = qbytes / N, size = row / B;  // bytes of a row of w, of its block
    uint8_t *q = malloc(qbytes);
    uint16_t *p = malloc(plane_bytes);
    for (size_t c = 0; c < copies; ++c) {
      for (size_t g = 0; g < N / 8; ++g)  // chunk j of block b of row r at ((g B + b) size / 4 + j) 32 + 4 r
        for (size_t b = 0; b < B; ++b)
          for (size_t j = 0; j < size / 4; ++j)
            for (size_t r = 0; r < 8; ++r)
              memcpy(q + ((g * B + b) * (size / 4) + j) * 32 + 4 * r, qs[c] + (8 * g + r) * row + size * b + 4 * j, 4);
      memcpy(qs[c], q, qbytes);
      uint16_t *planes[2] = {d[c], m[c]};
      for (int k = 0; k < (type == Q4_1 ? 2 : 1); ++k) {
        for (size_t g = 0; g < N / 8; ++g)
          for (size_t b = 0; b < B; ++b)
            for (size_t r = 0; r < 8; ++r) p[(g * B + b) * 8 + r] = planes[k][(8 * g + r) * B + b];
        memcpy(planes[k], p, plane_bytes);
      }
    }
    free(q), free(p);
  }
  float *x = malloc(M * K * sizeof *x), *y = malloc(M * N * sizeof *y);
  for (size_t i = 0; i < M * K; ++i) x[i] = (rand() % 2001 - 1000) / 1000.0f;
  double best = 1e30;
  for (int trial = 0; trial < 5; ++trial) {
    pthread_t t[64];
    job jobs[64];
    spin_barrier_init(threads);
    double t0 = now();
    for (int i = 0; i < threads; ++i) {
      jobs[i] = (job){type, i, threads, reps, M, N, K, rows, (N + rows - 1) / rows, copies, qs, sc, d, m, x, y};
      pthread_create(&t[i], 0, worker, &jobs[i]);
    }
    for (int i = 0; i < threads; ++i) pthread_join(t[i], 0);
    double seconds = (now() - t0) / ((double)reps * copies);
    best = seconds < best ? seconds : best;
  }
  double bytes = (qbytes + (plane_bytes ? plane_bytes + m_bytes : 0) + sc_bytes) * (type == F16_SWIGLU ? 2 : 1);
  printf("%.2f %.3f\n", best * 1e6, bytes / best / 1e9);
  return 0;
}
