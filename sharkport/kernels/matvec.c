// Matrix-vector products that read weights as stored (sharkport.kernels): y[m, n] = sum_k
// x[m, k] * w[n, k] for a few rows m of float32 activations, with w in ggml's Q8_0, Q4_0 or Q4_1
// planes (see sharkport.quant) or in float16. Compiled by the system C compiler into an object
// that iree-compile links into the module (an IREE "custom dispatch"), so it must stay
// freestanding: no libc, no globals, no thread-local state.
//
// Each workgroup computes ROWS outputs n of every row m. The weights of a row n are loaded and
// widened to float32 once, then multiplied with every row of x (at most MAX_M at a time), so a
// decode step of batch M reads each weight once. Per block of 32 values the partial dot product
// is scaled by the block's float16 scale, as ggml's dequantization multiplies each value by it.
//
// Each memref argument arrives as MLIR's expanded descriptor: (base, aligned, offset, size,
// stride).
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

// ROWS (outputs per workgroup) and XSUM_BLOCKS come from sharkport.kernels' CFLAGS.
#define MAX_M 8
#define MEMREF(T, name) \
  T *restrict name, T *restrict name##_aligned, size_t name##_offset, size_t name##_size, size_t name##_stride
#define BASE(name) (name##_aligned + name##_offset)  // MLIR: element i is at aligned + offset + i

static inline __m256 widen_i8(const int8_t *p) {  // 8 int8 -> 8 float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline void nibbles(const uint8_t *p, __m256 *lo, __m256 *hi) {  // 8 bytes -> 2 x 8 float
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
  *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float half(uint16_t h) { return _cvtsh_ss(h); }

// w0..w3: the 32 values of one block as float32 (w[8i .. 8i+7] in wi).
#define DOT32(x, w0, w1, w2, w3)                                                    \
  _mm256_fmadd_ps(w3, _mm256_loadu_ps((x) + 24),                                   \
      _mm256_fmadd_ps(w2, _mm256_loadu_ps((x) + 16),                               \
          _mm256_fmadd_ps(w1, _mm256_loadu_ps((x) + 8), _mm256_mul_ps(w0, _mm256_loadu_ps(x)))))
#define SUM32(x) \
  _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps((x) + 8)), \
                _mm256_add_ps(_mm256_loadu_ps((x) + 16), _mm256_loadu_ps((x) + 24)))

#define ROW_RANGE                                      \
  size_t n0 = wg * ROWS, n1 = n0 + ROWS < N ? n0 + ROWS : N; \
  size_t B = K / 32;

void sharkport_matvec_q8_0(MEMREF(const float, x), MEMREF(const int8_t, qs), MEMREF(const uint16_t, d),
                           MEMREF(float, y), size_t M, size_t N, size_t K, size_t wg) {
  ROW_RANGE
  for (size_t m0 = 0; m0 < M; m0 += MAX_M) {
    size_t mc = M - m0 < MAX_M ? M - m0 : MAX_M;
    for (size_t n = n0; n < n1; ++n) {
      const int8_t *q = BASE(qs) + n * K;
      const uint16_t *dn = BASE(d) + n * B;
      __m256 acc[MAX_M];
      for (size_t i = 0; i < mc; ++i) acc[i] = _mm256_setzero_ps();
      for (size_t b = 0; b < B; ++b, q += 32) {
        __m256 w0 = widen_i8(q), w1 = widen_i8(q + 8), w2 = widen_i8(q + 16), w3 = widen_i8(q + 24);
        __m256 scale = _mm256_set1_ps(half(dn[b]));
        for (size_t i = 0; i < mc; ++i) {
          const float *xb = BASE(x) + (m0 + i) * K + 32 * b;
          acc[i] = _mm256_fmadd_ps(DOT32(xb, w0, w1, w2, w3), scale, acc[i]);
        }
      }
      for (size_t i = 0; i < mc; ++i) BASE(y)[(m0 + i) * N + n] = hsum(acc[i]);
    }
  }
}

// Q4_0 (no `mins`: value = d * q - 8 d) and Q4_1 (value = d * q + m). The offset term of a row,
// sum over blocks of (offset) * (sum of x over the block), is a dot product of two vectors of B
// floats: the block sums of x (once per workgroup) and the row's offsets; the row's scales are
// widened to float once, so the inner loop has no scalar work. Rows of K <= 32 * XSUM_BLOCKS.
static inline void widen_halves(const uint16_t *h, float *out, size_t n) {  // float16 -> float
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
  for (; i < n; ++i) out[i] = half(h[i]);
}

static inline float dot(const float *a, const float *b, size_t n) {
  __m256 acc = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

static inline void matvec_q4(const float *x, const uint8_t *qs, const uint16_t *d, const uint16_t *mins,
                             float *y, size_t M, size_t N, size_t K, size_t wg) {
  ROW_RANGE
  float xsum[MAX_M * XSUM_BLOCKS], scales[XSUM_BLOCKS], offsets[XSUM_BLOCKS];
  if (B > XSUM_BLOCKS) return;  // never traced: kernels.matvec only routes rows this short
  for (size_t m0 = 0; m0 < M; m0 += MAX_M) {
    size_t mc = M - m0 < MAX_M ? M - m0 : MAX_M;
    for (size_t i = 0; i < mc; ++i)
      for (size_t b = 0; b < B; ++b) xsum[i * B + b] = hsum(SUM32(x + (m0 + i) * K + 32 * b));
    for (size_t n = n0; n < n1; ++n) {
      const uint8_t *q = qs + n * (K / 2);
      widen_halves(d + n * B, scales, B);
      if (mins) {
        widen_halves(mins + n * B, offsets, B);
      } else {
        for (size_t b = 0; b < B; ++b) offsets[b] = -8.0f * scales[b];
      }
      __m256 acc[MAX_M];
      for (size_t i = 0; i < mc; ++i) acc[i] = _mm256_setzero_ps();
      for (size_t b = 0; b < B; ++b, q += 16) {
        __m256 w0, w1, w2, w3;  // bytes 0..7: values 0..7 (low) and 16..23 (high); 8..15: 8..15, 24..31
        nibbles(q, &w0, &w2);
        nibbles(q + 8, &w1, &w3);
        __m256 scale = _mm256_broadcast_ss(scales + b);
        for (size_t i = 0; i < mc; ++i) {
          const float *xb = x + (m0 + i) * K + 32 * b;
          acc[i] = _mm256_fmadd_ps(DOT32(xb, w0, w1, w2, w3), scale, acc[i]);
        }
      }
      for (size_t i = 0; i < mc; ++i) y[(m0 + i) * N + n] = hsum(acc[i]) + dot(offsets, xsum + i * B, B);
    }
  }
}

void sharkport_matvec_q4_0(MEMREF(const float, x), MEMREF(const uint8_t, qs), MEMREF(const uint16_t, d),
                           MEMREF(float, y), size_t M, size_t N, size_t K, size_t wg) {
  matvec_q4(BASE(x), BASE(qs), BASE(d), 0, BASE(y), M, N, K, wg);
}

void sharkport_matvec_q4_1(MEMREF(const float, x), MEMREF(const uint8_t, qs), MEMREF(const uint16_t, d),
                           MEMREF(const uint16_t, mins), MEMREF(float, y), size_t M, size_t N, size_t K,
                           size_t wg) {
  matvec_q4(BASE(x), BASE(qs), BASE(d), BASE(mins), BASE(y), M, N, K, wg);
}

// float16 weights [N, K]; K any multiple of 8.
void sharkport_matvec_f16(MEMREF(const float, x), MEMREF(const uint16_t, w), MEMREF(float, y),
                          size_t M, size_t N, size_t K, size_t wg) {
  size_t n0 = wg * ROWS, n1 = n0 + ROWS < N ? n0 + ROWS : N;
  for (size_t m0 = 0; m0 < M; m0 += MAX_M) {
    size_t mc = M - m0 < MAX_M ? M - m0 : MAX_M;
    for (size_t n = n0; n < n1; ++n) {
      const uint16_t *wn = BASE(w) + n * K;
      __m256 acc[MAX_M];
      for (size_t i = 0; i < mc; ++i) acc[i] = _mm256_setzero_ps();
      for (size_t k = 0; k < K; k += 8) {
        __m256 wk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wn + k)));
        for (size_t i = 0; i < mc; ++i)
          acc[i] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(BASE(x) + (m0 + i) * K + k), acc[i]);
      }
      for (size_t i = 0; i < mc; ++i) BASE(y)[(m0 + i) * N + n] = hsum(acc[i]);
    }
  }
}
