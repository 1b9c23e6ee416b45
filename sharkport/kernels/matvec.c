// Matrix-vector products that read weights as stored (sharkport.kernels): y[m, n] = sum_k
// x[m, k] * w[n, k] for a few rows m of float32 activations, with w in ggml's Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS planes (see sharkport.quant; also
// with rows interleaved eight at a time, see q4_x8, q8_x8, q4k_x8, q6k_x8, q23k_x8 and iq4_x8) or
// in float16 or bfloat16. Compiled by the system C compiler into an object that
// iree-compile links into the module (an IREE "custom dispatch"), so it must stay freestanding: no
// libc, no globals, no thread-local state.
//
// Each workgroup computes `rows` outputs n (an argument: sharkport.kernels.ops aims at one
// workgroup per CPU, kernels.workgroups) of every row m, reading each weight once for all rows of
// x, so a decode step of batch M reads the weights once.
//
// Quantized weights multiply 8-bit integers, as ggml does on CPUs: each workgroup first
// quantizes its rows of x in blocks of 32 exactly as gguf's Q8_0 reference quantizer does
// (scale = max |x| / 127 rounded to float16, values rounded half away from zero), or for the
// K-quants in blocks of 256 as llama.cpp's Q8_K (quantize_x_k), then each block's dot product is a
// sum of 8-bit integer products (AVX2 `maddubs`, or AVX-512 VNNI's `vpdpbusd` where the object is
// built for it), scaled by the weight's and x's block scales. Results are the exact product of the
// dequantized weights with the dequantized x, up to float32 rounding of the block sums.
//
// Each memref argument arrives as MLIR's expanded descriptor: (base, aligned, offset, size,
// stride).
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

// MAX_BLOCKS (blocks of 32 in a row of w), XQ_BYTES (bytes of quantized x a workgroup keeps
// on its stack; IREE's workers have 128 KiB) and XN_FLOATS (values of RMS-normalized x it keeps)
// come from sharkport.kernels' CFLAGS.
#define MAX_M 8
#define MAX_SPLITS 4  // parts of a decode attention item in a block (kernels.MAX_ATTENTION_SPLITS)
#define MEMREF(T, name) \
  T *restrict name, T *restrict name##_aligned, size_t name##_offset, size_t name##_size, size_t name##_stride
#define BASE(name) (name##_aligned + name##_offset)  // MLIR: element i is at aligned + offset + i
#define INLINE static inline __attribute__((always_inline))
#define NOINLINE static __attribute__((noinline))
// The file compiles as SHARKPORT_PARTS objects at once (build.py: -DSHARKPORT_PART=0, 1, ...),
// each defining the exported kernels of the sections marked IN_PART of it; the static functions
// they call are compiled in each part that calls them. Without SHARKPORT_PART, all of them.
#define SHARKPORT_PARTS 4
#ifndef SHARKPORT_PART
#define SHARKPORT_PART -1
#endif
#define IN_PART(n) (SHARKPORT_PART < 0 || SHARKPORT_PART == (n))
// Q8_0 weights and Q4 weights interleaved eight rows at a time (q4_x8) are fetched ahead: PREFETCH
// bytes ahead in one step, or in two (see FAR_AHEAD), which reads them faster than the hardware's
// prefetch alone. (F16 and Q4 one row at a time gain nothing from it.)
#define PREFETCH 2048
#define PREFETCH_LINE(p) _mm_prefetch((const char *)(p) + PREFETCH, _MM_HINT_T0)
// The Q4 x8 loops, Q8_0's AVX-512 loop at more than 4 rows of x, and F16's loops at two or more
// rows of x (but f16_row's) fetch in two steps instead: FAR_AHEAD bytes ahead into L2 (T1), then
// NEAR_AHEAD bytes ahead into L1 (T0). One step of PREFETCH bytes into L1 keeps a core's few L1
// misses in flight for the whole trip from memory; the step into L1 from L2 is short. f16_row
// fetches nothing ahead, where two steps are slower. Other distances, T2 for T1, or the scales in
// one step do no better. The Q8_0 loops keep one step up to 4 rows of x (q8_x8_zmm; q8_x8 at all):
// two steps are slower there.
#define FAR_AHEAD 4096
#define NEAR_AHEAD 768
#define PREFETCH_TWO_STEPS(p)                                                          \
  do {                                                                                 \
    _mm_prefetch((const char *)(p) + FAR_AHEAD, _MM_HINT_T1);                          \
    _mm_prefetch((const char *)(p) + NEAR_AHEAD, _MM_HINT_T0);                         \
  } while (0)
// The Q4 x8 loops fetch their scales (and Q4_1's offsets) as many blocks ahead as their weights:
// a block's are 16 bytes of each plane against its 128 of weights, so an eighth as many bytes
// ahead, a line every 4 blocks. Left to the hardware's prefetch, they are streams of their own
// beside the weights', which is slower.
#define PREFETCH_PLANE_LINES(d, m, b, ahead, hint)                                     \
  do {                                                                                 \
    _mm_prefetch((const char *)((d) + 8 * (b)) + (ahead), hint);                       \
    if (m) _mm_prefetch((const char *)((m) + 8 * (b)) + (ahead), hint);                \
  } while (0)
#define PREFETCH_PLANES(d, m, b)                                                       \
  do {                                                                                 \
    if ((b) & 3) break;                                                                \
    PREFETCH_PLANE_LINES(d, m, b, FAR_AHEAD / 8, _MM_HINT_T1);                         \
    PREFETCH_PLANE_LINES(d, m, b, NEAR_AHEAD / 8, _MM_HINT_T0);                        \
  } while (0)
// SHARKPORT_PRODUCTS, a measuring aid (tools/bench_bounds.py builds the object with it through
// $SHARKPORT_KERNEL_PRODUCTS): 0, the default, computes the products; 1 only reads their weights,
// every line of them with the prefetch the products use (read_rows), and 2 reads nothing; both
// then give zeros. So decode with 1 against 0 shows what the products' arithmetic adds to reading
// the weights, and with 2 what a step costs besides reading them (attention, norms, waits, the
// runtime).
#ifndef SHARKPORT_PRODUCTS
#define SHARKPORT_PRODUCTS 0
#endif

INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

INLINE float half(uint16_t h) { return _cvtsh_ss(h); }
INLINE __m256 halves8(const uint16_t *p) {  // eight float16 values at p
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
// Eight float16 (bf16 0) or bfloat16 (bf16 1) weights at p: a bfloat16 is a float32's top half.
INLINE __m256 weights8(const int bf16, const uint16_t *p) {
  if (!bf16) return halves8(p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

// ---- x quantized in blocks of 32 (gguf's Q8_0 reference: quantize_row_q8_0_ref) ----

// v rounded half away from zero, as gguf's np_roundf (floor(|v|) + floor(2 frac(|v|)), v's sign):
// |v| + 0.49999997 (the float just below 0.5) truncated equals it for every float |v| <= 128
// (checked over all of them; x * 127 / max |x| stays below 128), then v's sign.
INLINE __m256i round_half_away(__m256 v) {
  __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  __m256i r = _mm256_cvttps_epi32(_mm256_add_ps(a, _mm256_set1_ps(0.49999997f)));
  return _mm256_sign_epi32(r, _mm256_castps_si256(v));
}

// The largest of each of 8 vectors' lanes: lane j of the result is the max of m[j]'s lanes.
INLINE __m256 lane_max8(const __m256 m[8]) {
  __m256 u[2];
  for (int h = 0; h < 2; ++h) {  // u[h]: per 128-bit half, the max of that half of m[4h + 0..3]
    const __m256 *v = m + 4 * h;
    __m256 t0 = _mm256_max_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
    __m256 t1 = _mm256_max_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
    u[h] = _mm256_max_ps(_mm256_shuffle_ps(t0, t1, 0x44), _mm256_shuffle_ps(t0, t1, 0xEE));
  }
  return _mm256_max_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

// Rows x[0 .. mc) of length K = 32 B into q [mc, K] int8 and per block: scale d [mc, B] and
// d * (sum of the block's q) in s [mc, B]. The blocks' scales come first, eight blocks at a time
// (their max |x| gathered into one vector, then vector divides: scale = max / 127 and the
// multiplier 1 / scale, 0 for a block of zeros), so that no block waits on a horizontal max and two
// scalar divides; inv holds the multipliers.
static void quantize_x(const float *x, size_t mc, size_t K, int8_t *q, float *d, float *s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  size_t n = mc * (K / 32);
  float inv[XQ_BYTES / 32];
  for (size_t i0 = 0; i0 < n; i0 += 8) {
    __m256 m[8];
    for (size_t j = 0; j < 8; ++j) {
      const float *b = x + 32 * (i0 + j < n ? i0 + j : i0);  // past the last block: the first again
      __m256 a0 = _mm256_andnot_ps(sign, _mm256_loadu_ps(b)), a1 = _mm256_andnot_ps(sign, _mm256_loadu_ps(b + 8));
      __m256 a2 = _mm256_andnot_ps(sign, _mm256_loadu_ps(b + 16)), a3 = _mm256_andnot_ps(sign, _mm256_loadu_ps(b + 24));
      m[j] = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
    }
    __m256 scale = _mm256_div_ps(lane_max8(m), _mm256_set1_ps(127.0f));
    __m256 nonzero = _mm256_cmp_ps(scale, _mm256_setzero_ps(), _CMP_NEQ_OQ);
    __m256 multiplier = _mm256_and_ps(nonzero, _mm256_div_ps(_mm256_set1_ps(1.0f), scale));
    __m256 stored = _mm256_cvtph_ps(_mm256_cvtps_ph(scale, _MM_FROUND_TO_NEAREST_INT));  // as Q8_0 keeps it
    float mv[8], dv[8];
    _mm256_storeu_ps(mv, multiplier);
    _mm256_storeu_ps(dv, stored);
    for (size_t j = 0; j < 8 && i0 + j < n; ++j) inv[i0 + j] = mv[j], d[i0 + j] = dv[j];
  }
  for (size_t i = 0; i < n; ++i, x += 32, q += 32) {
    __m256 by = _mm256_broadcast_ss(inv + i);
    __m256i i0 = round_half_away(_mm256_mul_ps(_mm256_loadu_ps(x), by));
    __m256i i1 = round_half_away(_mm256_mul_ps(_mm256_loadu_ps(x + 8), by));
    __m256i i2 = round_half_away(_mm256_mul_ps(_mm256_loadu_ps(x + 16), by));
    __m256i i3 = round_half_away(_mm256_mul_ps(_mm256_loadu_ps(x + 24), by));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_hadd_epi32(t4, t4);
    t4 = _mm_hadd_epi32(t4, t4);
    // pack 4 x 8 int32 to 32 int8; the packs work within 128-bit lanes, the permute restores order
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, packed);
    s[i] = d[i] * (float)_mm_cvtsi128_si32(t4);
  }
}

// ---- x quantized in blocks of 256 for the K-quants (llama.cpp's Q8_K: quantize_row_q8_K_ref) ----
//
// Per 256 values: max, the first of the largest magnitude; q = min(127, round half to even
// (-127 / max * x)) and scale d = 1 / (-127 / max), all in float32 (0 for a block of zeros). With
// one scale for 256 values, a K-quant's super-block sums its integer products in 32 bits and
// scales them once (q4k_row), as llama.cpp's vec_dot_q4_K_q8_K does.

// Rows x[0 .. mc) of length K = 256 S into q [mc, K], scales d [mc, S] and the sums of each 16 q
// in bs [mc, K / 16].
static void quantize_x_k(const float *x, size_t mc, size_t K, int8_t *q, float *d, int16_t *bs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (size_t i = 0, n = mc * (K / 256); i < n; ++i, x += 256, q += 256, bs += 16) {
    __m256 m = _mm256_setzero_ps();
    for (size_t j = 0; j < 256; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))), max = 0.0f;
    if (amax == 0.0f) {
      for (size_t j = 0; j < 256; j += 32) _mm256_storeu_si256((__m256i *)(q + j), _mm256_setzero_si256());
      for (size_t j = 0; j < 16; ++j) bs[j] = 0;
      d[i] = 0.0f;
      continue;
    }
    for (size_t j = 0; j < 256; j += 8) {  // the first value of magnitude amax gives max its sign
      int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)),
                                                 _mm256_set1_ps(amax), _CMP_EQ_OQ));
      if (hit) {
        max = x[j + __builtin_ctz((unsigned)hit)];
        break;
      }
    }
    float iscale = -127.0f / max;
    __m256 by = _mm256_set1_ps(iscale);
    const __m256i top = _mm256_set1_epi32(127);
    for (size_t j = 0; j < 256; j += 32) {
      __m256i v[4];
      for (size_t u = 0; u < 4; ++u) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * u), by),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v[u] = _mm256_min_epi32(_mm256_cvttps_epi32(r), top);
      }
      for (size_t h = 0; h < 2; ++h) {  // the sums of values j + 16 h .. + 15
        __m256i t = _mm256_add_epi32(v[2 * h], v[2 * h + 1]);
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_hadd_epi32(t4, t4);
        t4 = _mm_hadd_epi32(t4, t4);
        bs[j / 16 + h] = (int16_t)_mm_cvtsi128_si32(t4);
      }
      __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i *)(q + j), packed);
    }
    d[i] = 1.0f / iscale;
  }
}

// Q4 weights hold a block's 32 values as 16 bytes (value j in the low nibble of byte j, value
// j + 16 in its high nibble), so two consecutive blocks are one 32-byte load whose low nibbles are
// values 0..15 of both blocks and whose high nibbles are values 16..31. For them, x's quantized
// blocks are rearranged in pairs to match: values 0..15 of blocks 2p and 2p + 1, then values
// 16..31 of both (an odd last block keeps its order).
static void pair_blocks(int8_t *q, size_t mc, size_t K) {
  for (size_t i = 0; i < mc; ++i)
    for (size_t b = 0; b + 2 <= K / 32; b += 2) {
      int8_t *p = q + i * K + 32 * b;
      __m256i a = _mm256_loadu_si256((const __m256i *)p), c = _mm256_loadu_si256((const __m256i *)(p + 32));
      _mm256_storeu_si256((__m256i *)p, _mm256_permute2x128_si256(a, c, 0x20));
      _mm256_storeu_si256((__m256i *)(p + 32), _mm256_permute2x128_si256(a, c, 0x31));
    }
}

// Workspace of one workgroup: its rows of x quantized (q, with per block the scale xd and
// xd * sum of q, xs), and for the row of w at hand the products of its block scales with x's (cs).
// For the K-quants x is quantized per 256 values instead (quantize_x_k): xd holds a scale per 256
// values, and bs the sums of each 16 of q. xn: x RMS-normalized, for the products that normalize
// it (rms_norm_rows). All on the workgroup's stack (stack_space), or x's quantized rows and cs in
// the dispatch's scratch (product_all_rows).
typedef struct {
  int8_t *q;
  float *xd, *xs, *cs, *xn;
  int16_t *bs;
} workspace;
typedef struct {
  int8_t q[XQ_BYTES];
  float xd[XQ_BYTES / 32], xs[XQ_BYTES / 32], cs[XQ_BYTES / 32];
  int16_t bs[XQ_BYTES / 16];
  float xn[XN_FLOATS];
} __attribute__((aligned(64))) stack_space;  // x's rows on cache lines, as the 64-byte loads read them
INLINE workspace on_stack(stack_space *s) { return (workspace){s->q, s->xd, s->xs, s->cs, s->xn, s->bs}; }

// Rows of x a workgroup quantizes at a time: all of them (up to MAX_M) if they fit.
INLINE size_t chunk_rows(size_t M, size_t m0, size_t K) {
  size_t fit = XQ_BYTES / K, left = M - m0, mc = left < MAX_M ? left : MAX_M;
  return mc < fit ? mc : fit;
}

// Weight types: as stored (a w of a row count not a multiple of 8 is multiplied a row at a time),
// and with rows interleaved eight at a time (the X8 types: q4_x8, q8_x8, q4k_x8, q6k_x8, q23k_x8,
// iq4_x8).
enum { Q8_0, Q4_0, Q4_1, Q4_0X8, Q4_1X8, Q8_0X8 };
enum { F16 = Q8_0X8 + 1, Q5_0, Q4_K, Q6_K, Q5_0X8, Q5_K, Q4_KX8, BF16, Q3_K, Q2_K, Q5_1, Q5_1X8, Q5_KX8, Q6_KX8 };
enum { IQ4_NL = Q6_KX8 + 1, IQ4_NLX8, IQ4_XS, IQ4_XSX8, Q2_KX8, Q3_KX8 };
// the types q4_x8 reads, and all the interleaved ones
#define Q4_X8_KIND(kind) ((kind) == Q4_0X8 || (kind) == Q4_1X8 || (kind) == Q5_0X8 || (kind) == Q5_1X8)
#define K4_X8_KIND(kind) ((kind) == Q4_KX8 || (kind) == Q5_KX8)  // the types q4k_x8 reads
#define IQ4_X8_KIND(kind) ((kind) == IQ4_NLX8 || (kind) == IQ4_XSX8)  // the types iq4_x8 reads
#define K23_X8_KIND(kind) ((kind) == Q2_KX8 || (kind) == Q3_KX8)     // the types q23k_x8 reads
#define X8_KIND(kind) \
  (Q4_X8_KIND(kind) || (kind) == Q8_0X8 || K4_X8_KIND(kind) || (kind) == Q6_KX8 || IQ4_X8_KIND(kind) || K23_X8_KIND(kind))
// IQ4_NL and IQ4_XS: 4-bit indices into a table of signed values (iq4_values), x quantized per 32
// values as for Q8_0; IQ4_XS's blocks of 32 take their scales from 6 bits each per 256 values
#define IQ4_ROW_KIND(kind) ((kind) == IQ4_NL || (kind) == IQ4_XS)
#define IQ4_XS_KIND(kind) ((kind) == IQ4_XS || (kind) == IQ4_XSX8)
// row kinds whose values are signed, multiplied as Q8_0's (Q_STEP), without an offset
#define SIGNED_VALUES(kind) ((kind) == Q8_0 || IQ4_ROW_KIND(kind))
// Float weights (read as they are, x not quantized), and the weight types whose x is quantized per
// 256 values (quantize_x_k).
#define FLOAT_WEIGHTS(kind) ((kind) == F16 || (kind) == BF16)
#define OFFSETS(kind) ((kind) == Q4_1 || (kind) == Q5_1)     // value = d q + m (row at a time)
#define FIFTH_BITS(kind) ((kind) == Q5_0 || (kind) == Q5_1)  // q of 5 bits, the fifth in qh (row at a time)
#define X_PER_256(kind) \
  ((kind) == Q4_K || (kind) == Q5_K || (kind) == Q6_K || K4_X8_KIND(kind) || (kind) == Q6_KX8 || (kind) == Q3_K || \
   (kind) == Q2_K || K23_X8_KIND(kind))

// For one row of w with block scales d (and offsets m, Q4_1 and Q5_1): cs[i, b] = d[b] xd[i, b] for
// the MC rows i of x, and in off[i] the offset term: sum over blocks of the block's offset (Q4_0:
// -8 d, Q5_0: -16 d, Q4_1 and Q5_1: m; Q8_0 has none) times the sum of x's block.
// The offset of a Q4_0 or Q5_0 block (Q5_0X8, Q4_0X8 too) in units of its scale: values are stored
// plus 8 (4 bits) or plus 16 (5 bits).
INLINE float offset_scale(int kind) { return kind == Q5_0 || kind == Q5_0X8 ? -16.0f : -8.0f; }

// Where dl is not null, it holds the blocks' scales as floats in place of d (IQ4_XS).
INLINE void row_scales(workspace *ws, int kind, const uint16_t *d, const float *dl, const uint16_t *m, size_t MC,
                       size_t B, float *off) {
  __m256 oacc[MC];
  for (size_t i = 0; i < MC; ++i) oacc[i] = _mm256_setzero_ps();
  size_t b = 0;
  for (; b + 8 <= B; b += 8) {
    __m256 dv = dl ? _mm256_loadu_ps(dl + b) : halves8(d + b);
    __m256 ov = OFFSETS(kind) ? halves8(m + b) : _mm256_mul_ps(dv, _mm256_set1_ps(offset_scale(kind)));
    for (size_t i = 0; i < MC; ++i) {
      _mm256_storeu_ps(ws->cs + i * B + b, _mm256_mul_ps(dv, _mm256_loadu_ps(ws->xd + i * B + b)));
      if (!SIGNED_VALUES(kind)) oacc[i] = _mm256_fmadd_ps(ov, _mm256_loadu_ps(ws->xs + i * B + b), oacc[i]);
    }
  }
  for (size_t i = 0; i < MC; ++i) off[i] = SIGNED_VALUES(kind) ? 0.0f : hsum(oacc[i]);
  for (; b < B; ++b) {
    float dv = dl ? dl[b] : half(d[b]), ov = OFFSETS(kind) ? half(m[b]) : offset_scale(kind) * dv;
    for (size_t i = 0; i < MC; ++i) {
      ws->cs[i * B + b] = dv * ws->xd[i * B + b];
      if (!SIGNED_VALUES(kind)) off[i] += ov * ws->xs[i * B + b];
    }
  }
}

// 8 float partial sums of the products of 32 unsigned and 32 signed bytes
INLINE __m256 dot_u8s8(__m256i u, __m256i s) {
  __m256i pairs = _mm256_maddubs_epi16(u, s);  // |u| <= 128, |s| <= 127: no saturation
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

INLINE __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

// 16 bytes of a Q4 block -> its 32 values (0..15): byte j holds value j (low nibble) and j + 16
INLINE __m256i nibbles(const uint8_t *p) {
  __m128i b = _mm_loadu_si128((const __m128i *)p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
}

// IQ4_NL's and IQ4_XS's values by 4-bit index (ggml's kvalues_iq4nl), for pshufb in each 16-byte lane
INLINE __m128i iq4_values(void) {
  return _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
}
INLINE __m256i iq4_table(void) { return _mm256_broadcastsi128_si256(iq4_values()); }

// IQ4_XS's scale of each block of 32 values of a row (super-block scales d, 6-bit scales' top bits
// sh and low bits sl): d times the block's 6-bit scale less 32, as ggml's dequantize_row_iq4_xs.
INLINE void iq4_xs_scales(const uint16_t *d, const uint16_t *sh, const uint8_t *sl, size_t B, float *dl) {
  for (size_t b = 0; b < B; ++b) {
    size_t s = b / 8, j = b % 8;
    int ls = ((sl[4 * s + j / 2] >> (4 * (j % 2))) & 15) | (((sh[s] >> (2 * j)) & 3) << 4);
    dl[b] = half(d[s]) * (float)(ls - 32);
  }
}

// Q5_0's fifth bits: 32 bits (bit j of value j) -> 32 bytes, byte j 16 where bit j is set
INLINE __m256i fifth_bits(uint32_t bits) {
  const __m256i bytes = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), bytes), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}
INLINE uint32_t load_bits(const uint8_t *p) {
  uint32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// Independent multiply-add chains per row of x: with few rows, several partial sums keep the
// FMA units busy; with many, the rows do (AVX2 has 16 vector registers).
#define SPLIT(MC) ((MC) == 1 ? 4 : (MC) == 2 ? 2 : 1)

// Block b of w times block b of every row of x, scaled, into partial sum u.
#define Q_STEP(b, u)                                                                            \
  {                                                                                             \
    __m256i w, aw;                                                                              \
    if (kind == Q8_0) {                                                                         \
      if (!((b) & 1)) PREFETCH_LINE((const int8_t *)qn + 32 * (b));                             \
      w = load32((const int8_t *)qn + 32 * (b));                                                \
      aw = _mm256_sign_epi8(w, w);                                                              \
    } else if (IQ4_ROW_KIND(kind)) {                                                            \
      if (!((b) & 3)) PREFETCH_LINE((const uint8_t *)qn + 16 * (b));                            \
      w = _mm256_shuffle_epi8(iq4_table(), nibbles((const uint8_t *)qn + 16 * (b)));            \
      aw = _mm256_sign_epi8(w, w);                                                              \
    } else {                                                                                    \
      w = aw = nibbles((const uint8_t *)qn + 16 * (b));                                         \
      if (FIFTH_BITS(kind)) w = aw = _mm256_or_si256(w, fifth_bits(load_bits(qh + 4 * (b))));  \
    }                                                                                           \
    for (size_t i = 0; i < MC; ++i) {                                                           \
      __m256i xb = load32(ws->q + i * K + 32 * (b));                                            \
      /* maddubs multiplies unsigned by signed bytes: signed w passes |w| and x with w's sign */ \
      __m256 p = dot_u8s8(aw, SIGNED_VALUES(kind) ? _mm256_sign_epi8(xb, w) : xb);              \
      acc[i][u] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(ws->cs + i * B + (b)), acc[i][u]);     \
    }                                                                                           \
  }

// Blocks 2p and 2p + 1 of a Q4 w times those of every row of x (paired, see pair_blocks), scaled,
// into partial sum u: the two blocks' values meet x's in two `maddubs`, whose sums (|.| <= 2 * 2
// * 31 * 127) add in 16 bits; lanes 0..3 then hold block 2p's sum, 4..7 block 2p + 1's. Q5's
// fifth bits join the nibbles: the low ones' are bits 0..15 of each block's, the high ones' 16..31.
#define Q4_PAIR_STEP(pair, u)                                                                          \
  {                                                                                                    \
    __m256i v = load32((const uint8_t *)qn + 32 * (pair));                                             \
    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);     \
    if (FIFTH_BITS(kind)) {                                                                            \
      uint32_t h0 = load_bits(qh + 8 * (pair)), h1 = load_bits(qh + 8 * (pair) + 4);                   \
      lo = _mm256_or_si256(lo, fifth_bits((h0 & 0xFFFF) | (h1 << 16)));                                \
      hi = _mm256_or_si256(hi, fifth_bits((h0 >> 16) | (h1 & 0xFFFF0000u)));                           \
    }                                                                                                  \
    for (size_t i = 0; i < MC; ++i) {                                                                  \
      const int8_t *xq = ws->q + i * K + 64 * (pair);                                                  \
      __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load32(xq)), _mm256_maddubs_epi16(hi, load32(xq + 32))); \
      __m256 prod = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, _mm256_set1_epi16(1)));                 \
      __m256 sc = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(ws->cs + i * B + 2 * (pair))));  \
      acc[i][u] = _mm256_fmadd_ps(prod, _mm256_permutevar8x32_ps(sc, pair_lanes), acc[i][u]);          \
    }                                                                                                  \
  }

// One row n of a quantized w (its blocks at qn, scales d, offsets m, Q5's fifth bits qh; IQ4_XS's
// scales' top bits m and low bits qh) times MC rows of x.
INLINE void q_row(workspace *ws, int kind, const void *qn, const uint16_t *d, const uint16_t *m, const uint8_t *qh,
                  size_t MC, size_t K, float *out) {
  size_t B = K / 32;
  float dl[MAX_BLOCKS];
  if (kind == IQ4_XS) iq4_xs_scales(d, m, qh, B, dl);
  row_scales(ws, kind, d, kind == IQ4_XS ? dl : 0, m, MC, B, out);
  __m256 acc[MC][4];  // SPLIT(MC) used; the blocks are unrolled so that each stays in a register
  for (size_t i = 0; i < MC; ++i)
    for (size_t u = 0; u < SPLIT(MC); ++u) acc[i][u] = _mm256_setzero_ps();
  size_t b = 0;
  if (SIGNED_VALUES(kind)) {
    for (; b + SPLIT(MC) <= B; b += SPLIT(MC)) {
      Q_STEP(b, 0)
      if (SPLIT(MC) > 1) Q_STEP(b + 1, 1)
      if (SPLIT(MC) > 2) Q_STEP(b + 2, 2)
      if (SPLIT(MC) > 3) Q_STEP(b + 3, 3)
    }
  } else {
    const __m256i low4 = _mm256_set1_epi8(15), pair_lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    size_t pairs = B / 2, p = 0, step = SPLIT(MC) > 1 ? 2 : 1;
    for (; p + step <= pairs; p += step) {
      Q4_PAIR_STEP(p, 0)
      if (step > 1) Q4_PAIR_STEP(p + 1, 1)
    }
    for (; p < pairs; ++p) Q4_PAIR_STEP(p, 0)
    b = 2 * pairs;
  }
  for (; b < B; ++b) Q_STEP(b, 0)
  for (size_t i = 0; i < MC; ++i) {
    for (size_t u = 1; u < SPLIT(MC); ++u) acc[i][0] = _mm256_add_ps(acc[i][0], acc[i][u]);
    out[i] += hsum(acc[i][0]);
  }
}

// ---- Q4 weights with their rows interleaved eight at a time ("x8") ----
//
// Read as stored, a row of a Q4 w at a time spends on each row a fixed cost (its scales, the sum
// of its lanes) that rivals its blocks' products when rows are short (SmolLM2: 18 blocks), and
// rows read together meet in lanes only through `hadd`s, which x86 CPUs issue at a fraction of
// the rate of `maddubs`. So the module multiplies by a copy of each Q4 matrix whose rows are
// interleaved in groups of eight (sharkport.kernels.interleave_rows, computed once as the module
// loads): per group and block b, 128 bytes hold 4 bytes of each of the eight rows' 16, chunk j
// (bytes 4j .. 4j + 3 of each row) at 32 j, row r's at 32 j + 4 r; the scales (and offsets) of
// block b are the eight rows' in a row. One 32-byte load is then 4 bytes of each of eight rows, and
// its low nibbles (values 4j .. 4j + 3) and high nibbles (values 16 + 4j ..) meet x's four values
// broadcast to every lane: after the block's 8 `maddubs`, each row's sums lie in its own two
// 16-bit lanes (|.| <= 8 * 2 * 15 * 127 < 2^15), one `madd` completes them, and lane r of one
// vector is row r's block sum: no horizontal adds, no per-row work, and the eight outputs come out
// as a vector.
// The loop's sums are pinned to registers: left free, gcc turns each block's sums into a tree of
// adds whose terms spill, which is slower.

INLINE __m256i broadcast4(const int8_t *p) {  // 4 bytes at p in each 32-bit lane
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc[i] (lane r: row r of an interleaved group times row i of x) into out[i].
INLINE void group_outputs(const __m256 *acc, size_t MC, float out[MAX_M][8]) {
  for (size_t i = 0; i < MC; ++i) _mm256_storeu_ps(out[i], acc[i]);
}

// F(MC) for each row count MC of x, 1 .. MAX_M; AT_ROWS(name, MC) is name_<MC>, MC expanded
// before pasting (MAX_M -> 8).
#define FOR_EACH_ROW_COUNT(F) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8)
_Static_assert(MAX_M == 8, "FOR_EACH_ROW_COUNT covers each row count of x up to MAX_M");
#define AT_ROWS(name, MC) AT_ROWS_NAMED(name, MC)
#define AT_ROWS_NAMED(name, MC) name##_##MC

// The x8 loops keep each row i of x's sums in variables of their own (acc0 .. acc7, ...; a loop's
// ROW(i) is its code for row i, ROWS_OF_X repeats it), rather than in arrays: gcc 12 keeps arrays
// of them in registers but also stores every one to the stack on every block (or keeps them
// there), and those stores slow a product from memory.
#define ROWS_OF_X(ROW) ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)
_Static_assert(MAX_M == 8, "ROWS_OF_X names the sums of each row count of x up to MAX_M");
// name0 .. name7 of type T, each v; then the array name [MAX_M] of them (for the outputs)
#define EIGHT(T, name, v) T name##0 = v, name##1 = name##0, name##2 = name##0, name##3 = name##0, \
                          name##4 = name##0, name##5 = name##0, name##6 = name##0, name##7 = name##0
#define SUMS_ARRAY(T, name) T name[MAX_M] = {name##0, name##1, name##2, name##3, name##4, name##5, name##6, name##7}

// Q5_0X8's and Q5_1X8's fifth bits as the archive places them (quant.FIFTH_BIT_TYPES): byte t of
// row r's 4 bytes holds at bit 2j that of value 4j + t and at bit 2j + 1 that of 16 + 4j + t, the
// values whose nibbles lie in byte t of row r's chunk j. Bit k of each byte of h, moved to bit 4.
INLINE __m256i fifth_bits_x8(__m256i h, int k) {
  __m256i v = k < 4 ? _mm256_slli_epi16(h, 4 - k) : k > 4 ? _mm256_srli_epi16(h, k - 4) : h;
  return _mm256_and_si256(v, _mm256_set1_epi8(16));
}

// The x8 loops' steps for row i of x: its values of chunk j of block b times the eight rows'
// values lo and hi (4 bytes each: values 4j .. 4j + 3 and 16 + 4j ..) into its 16-bit sums s_i;
// then block b's 32-bit sums times the rows' scales dv and x's, and the rows' offsets mv times x's
// block sum, into acc_i.
#define X8_NIBBLE_SUMS(i)                                                                           \
  if (i < MC) {                                                                                     \
    const int8_t *xq = ws->q + i * K + 32 * b + 4 * j;                                              \
    s##i = _mm256_add_epi16(s##i, _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xq)),        \
                                                   _mm256_maddubs_epi16(hi, broadcast4(xq + 16)))); \
    __asm__("" : "+x"(s##i)); /* kept in a register, the adds in this order (see above) */          \
  }
#define X8_ADD_BLOCK(i, sums)                                                                                       \
  acc##i = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dv, _mm256_broadcast_ss(ws->xd + i * B + b)), \
                           acc##i);                                                                            \
  acc##i = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(ws->xs + i * B + b), acc##i)

// Rows 0..7 of an x8 group (blocks at qs, scales d and offsets m, 8 per block) times MC rows of x
// (quantized in ws, blocks in order): out[i][r]. A lane's 16-bit sums take 16 products a block, at
// most 16 * 15 * 127.
INLINE void q4_x8(const workspace *ws, int kind, const uint8_t *qs, const uint16_t *d, const uint16_t *m,
                  size_t MC, size_t K, float out[MAX_M][8]) {
  size_t B = K / 32;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  EIGHT(__m256, acc, _mm256_setzero_ps());
  for (size_t b = 0; b < B; ++b, qs += 128) {
    PREFETCH_TWO_STEPS(qs);
    PREFETCH_TWO_STEPS(qs + 64);
    PREFETCH_PLANES(d, m, b);  // m: null for Q4_0
    EIGHT(__m256i, s, _mm256_setzero_si256());
    for (size_t j = 0; j < 4; ++j) {
      __m256i v = load32(qs + 32 * j);
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      ROWS_OF_X(X8_NIBBLE_SUMS)
    }
    __m256 dv = halves8(d + 8 * b);
    __m256 mv = kind == Q4_1X8 ? halves8(m + 8 * b) : _mm256_mul_ps(dv, _mm256_set1_ps(offset_scale(kind)));
#define ROW(i) \
  if (i < MC) { X8_ADD_BLOCK(i, _mm256_madd_epi16(s##i, ones)); }
    ROWS_OF_X(ROW)
#undef ROW
  }
  SUMS_ARRAY(__m256, acc);
  group_outputs(acc, MC, out);
}

// q4_x8 for Q5_0X8 and Q5_1X8 (their fifth bits qh, the eight rows' 4 bytes per block): their
// 16-bit sums would overflow over a block (16 * 31 * 127), so they go into 32 bits every two chunks.
INLINE void q5_x8(const workspace *ws, int kind, const uint8_t *qs, const uint16_t *d, const uint16_t *m,
                  const uint8_t *qh, size_t MC, size_t K, float out[MAX_M][8]) {
  size_t B = K / 32;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  EIGHT(__m256, acc, _mm256_setzero_ps());
  for (size_t b = 0; b < B; ++b, qs += 128) {
    PREFETCH_TWO_STEPS(qs);
    PREFETCH_TWO_STEPS(qs + 64);
    PREFETCH_PLANES(d, m, b);  // m: null for Q5_0
    if (!(b & 1)) PREFETCH_TWO_STEPS(qh + 32 * b);
    __m256i h = load32(qh + 32 * b);
    EIGHT(__m256i, s, _mm256_setzero_si256());
    EIGHT(__m256i, w, _mm256_setzero_si256());  // chunks 0 and 1's sums in 32 bits
    for (size_t j = 0; j < 4; ++j) {
      __m256i v = load32(qs + 32 * j);
      __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low4), fifth_bits_x8(h, 2 * (int)j));
      __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), fifth_bits_x8(h, 2 * (int)j + 1));
      ROWS_OF_X(X8_NIBBLE_SUMS)
#define ROW(i) \
  if (i < MC) w##i = _mm256_madd_epi16(s##i, ones), s##i = _mm256_setzero_si256();
      if (j == 1) {
        ROWS_OF_X(ROW)
      }
#undef ROW
    }
    __m256 dv = halves8(d + 8 * b);
    __m256 mv = kind == Q5_1X8 ? halves8(m + 8 * b) : _mm256_mul_ps(dv, _mm256_set1_ps(offset_scale(kind)));
#define ROW(i) \
  if (i < MC) { X8_ADD_BLOCK(i, _mm256_add_epi32(_mm256_madd_epi16(s##i, ones), w##i)); }
    ROWS_OF_X(ROW)
#undef ROW
  }
  SUMS_ARRAY(__m256, acc);
  group_outputs(acc, MC, out);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---- The x8 loops with AVX-512 VNNI ----
//
// Where the object is built for AVX-512 with VNNI (kernels.isa(), on CPUs that have it), one
// 64-byte load holds two chunks of a group's eight rows, and `vpdpbusd` multiplies 4 unsigned
// bytes by 4 signed ones and adds them into a 32-bit lane: it stands for two `maddubs`, their
// add and the `madd`. The load's lanes are first reordered (pair_chunks) so that row r's 4 bytes
// of chunk j lie in lane 2r and those of chunk j + 1 in lane 2r + 1: x's 8 bytes of the two chunks
// then meet them as one 64-bit broadcast. Lanes 2r and 2r + 1 are added once per group. The
// results equal the AVX2 loops' up to float32 rounding.
#define Q4_X8_LOOP q4_x8_zmm
#define Q8_X8_LOOP q8_x8_zmm

INLINE __m512i pair_chunks(__m512i v) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), v);
}

INLINE __m512i broadcast8(const int8_t *p) {  // 8 bytes at p in each 64-bit lane
  int64_t v;
  __builtin_memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}

// The eight rows' block scales v (lane r: row r's) in pair lanes: lanes 2r and 2r + 1 hold row r's.
INLINE __m512 pair_scales(__m256 v) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                               _mm512_castps256_ps512(v));
}

// acc[i] in pair lanes plus off[i] (lane r) into out[i][r].
INLINE void pair_outputs(const __m512 *acc, const __m256 *off, size_t MC, float out[MAX_M][8]) {
  const __m512i split = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (size_t i = 0; i < MC; ++i) {
    __m512 v = _mm512_permutexvar_ps(split, acc[i]);  // even lanes, then odd ones
    __m256 sum = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    _mm256_storeu_ps(out[i], _mm256_add_ps(sum, off[i]));
  }
}

// Block b's integer sums s (pair lanes) of row i of x into its sums: acc_i += s * the rows' scales dv
// * x's scale, off_i += the rows' offsets (lane r: row r's) * x's block sum. Then the outputs.
#define ADD_BLOCK(i, s, offsets)                                                                                 \
  acc##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(ws->xd[i * B + b])), acc##i); \
  off##i = _mm256_fmadd_ps(offsets, _mm256_broadcast_ss(ws->xs + i * B + b), off##i)
#define PAIR_OUTPUTS       \
  SUMS_ARRAY(__m512, acc); \
  SUMS_ARRAY(__m256, off); \
  pair_outputs(acc, off, MC, out)

// Block b of row i of x times the group's nibbles in pair lanes (lo0, lo1, hi0, hi1: values 0..7,
// 8..15, 16..23, 24..31 of each row's block) into its sums, with offsets mv (ADD_BLOCK).
#define NIBBLE_BLOCK(i)                                                                                   \
  if (i < MC) {                                                                                           \
    const int8_t *xq = ws->q + i * K + 32 * b;                                                            \
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, broadcast8(xq));                         \
    s = _mm512_dpbusd_epi32(s, lo1, broadcast8(xq + 8));                                                  \
    s = _mm512_dpbusd_epi32(s, hi0, broadcast8(xq + 16));                                                 \
    s = _mm512_dpbusd_epi32(s, hi1, broadcast8(xq + 24));                                                 \
    ADD_BLOCK(i, s, mv);                                                                                  \
  }

// Lanes 2r and 2r + 1: lane r of v (a 32-bit word of each of the eight rows).
INLINE __m512i pair_words(__m256i v) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                  _mm512_castsi256_si512(v));
}

// Q5_0X8's and Q5_1X8's fifth bits (placed as fifth_bits_x8 reads them; h: pair_words of the
// rows' 4 bytes) added to the nibbles v of chunks j (lane 2r) and j + 1 (lane 2r + 1): bit k of
// each byte in the even lanes, bit k + 2 in the odd ones.
INLINE __m512i add_fifth_bits(__m512i v, __m512i h, int k) {
  const unsigned long long bits = 0x01010101ULL << k | 0x0101010100000000ULL << (k + 2);
  return _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(h, _mm512_set1_epi64((long long)bits)), v, _mm512_set1_epi8(16));
}

INLINE void q4_x8_zmm(const workspace *ws, int kind, const uint8_t *qs, const uint16_t *d, const uint16_t *m,
                      const uint8_t *qh, size_t MC, size_t K, float out[MAX_M][8]) {
  size_t B = K / 32;
  const int five = kind == Q5_0X8 || kind == Q5_1X8, offsets = kind == Q4_1X8 || kind == Q5_1X8;
  const __m512i low4 = _mm512_set1_epi8(15);
  EIGHT(__m512, acc, _mm512_setzero_ps());
  EIGHT(__m256, off, _mm256_setzero_ps());
  for (size_t b = 0; b < B; ++b, qs += 128) {
    PREFETCH_TWO_STEPS(qs);
    PREFETCH_TWO_STEPS(qs + 64);
    PREFETCH_PLANES(d, m, b);  // m: null for Q4_0 and Q5_0
    __m512i v0 = pair_chunks(_mm512_loadu_si512(qs)), v1 = pair_chunks(_mm512_loadu_si512(qs + 64));
    __m512i lo0 = _mm512_and_si512(v0, low4), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);
    __m512i lo1 = _mm512_and_si512(v1, low4), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);
    if (five) {
      if (!(b & 1)) PREFETCH_TWO_STEPS(qh + 32 * b);
      __m512i h = pair_words(load32(qh + 32 * b));
      lo0 = add_fifth_bits(lo0, h, 0);
      lo1 = add_fifth_bits(lo1, h, 4);
      hi0 = add_fifth_bits(hi0, h, 1);
      hi1 = add_fifth_bits(hi1, h, 5);
    }
    __m256 d8 = halves8(d + 8 * b);
    __m512 dv = pair_scales(d8);
    __m256 mv = offsets ? halves8(m + 8 * b) : _mm256_mul_ps(d8, _mm256_set1_ps(offset_scale(kind)));
    ROWS_OF_X(NIBBLE_BLOCK)
  }
  PAIR_OUTPUTS;
}

// Q8_0: `vpdpbusd` takes unsigned bytes, so the weights go in as w + 128 (w xor 0x80), and each
// block's sum is corrected by -128 times x's block sum, an offset like Q4_0's (-128 d).
// Up to 4 rows of x the weights are fetched ahead in one step (PREFETCH), beyond in two (FAR_AHEAD):
// each reads them faster there than the other or the hardware's prefetch alone.
INLINE void q8_x8_zmm(const workspace *ws, const int8_t *qs, const uint16_t *d, size_t MC, size_t K,
                      float out[MAX_M][8]) {
  size_t B = K / 32;
  const __m512i bias = _mm512_set1_epi8((char)0x80);
  EIGHT(__m512, acc, _mm512_setzero_ps());
  EIGHT(__m256, off, _mm256_setzero_ps());
  for (size_t b = 0; b < B; ++b, qs += 256) {
    for (size_t line = 0; line < 256; line += 64) {
      if (MC > 4)
        PREFETCH_TWO_STEPS(qs + line);
      else
        PREFETCH_LINE(qs + line);
    }
    __m512i u[4];
    for (size_t j = 0; j < 4; ++j) u[j] = _mm512_xor_si512(pair_chunks(_mm512_loadu_si512(qs + 64 * j)), bias);
    __m256 d8 = halves8(d + 8 * b);
    __m512 dv = pair_scales(d8);
    __m256 ov = _mm256_mul_ps(d8, _mm256_set1_ps(-128.0f));
#define ROW(i)                                                                                                     \
  if (i < MC) {                                                                                                    \
    const int8_t *xq = ws->q + i * K + 32 * b;                                                                     \
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], broadcast8(xq));                                 \
    for (size_t j = 1; j < 4; ++j) s = _mm512_dpbusd_epi32(s, u[j], broadcast8(xq + 8 * j));                       \
    ADD_BLOCK(i, s, ov);                                                                                           \
  }
    ROWS_OF_X(ROW)
#undef ROW
  }
  PAIR_OUTPUTS;
}
#else
#define Q4_X8_LOOP(ws, kind, qs, d, m, qh, MC, K, out) \
  (kind == Q5_0X8 || kind == Q5_1X8 ? q5_x8(ws, kind, qs, d, m, qh, MC, K, out) : q4_x8(ws, kind, qs, d, m, MC, K, out))
#define Q8_X8_LOOP q8_x8
#endif

// q4_x8 for each row count MC of x in a function of its own, so that its loop's registers do not
// compete with those of matvec's loop over the outputs.
#define Q4_X8_AT(MC)                                                                              \
  NOINLINE void q4_x8_##MC(const workspace *ws, int kind, const uint8_t *qs, const uint16_t *d, \
                           const uint16_t *m, const uint8_t *qh, size_t K, float out[MAX_M][8]) { \
    Q4_X8_LOOP(ws, kind, qs, d, m, qh, MC, K, out);                                               \
  }
FOR_EACH_ROW_COUNT(Q4_X8_AT)

// Row i of x's 4 values at xq and at xq + second times two chunks of the eight rows' signed values
// (v0 and v1, their magnitudes a0 and a1) into its 32-bit sums s_i, with the sign trick (|w| times x
// with w's sign): each `maddubs` (|.| <= 2 * 127 * 127) goes through `madd` into 32 bits.
#define SIGNED_CHUNKS(i, xq, second, v0, a0, v1, a1)                                                          \
  if (i < MC) {                                                                                               \
    __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(broadcast4(xq), v0));                              \
    __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(broadcast4((xq) + (second)), v1));                 \
    s##i = _mm256_add_epi32(s##i, _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones))); \
    __asm__("" : "+x"(s##i)); /* as in q4_x8 */                                                               \
  }
// Block b's sums s_i of row i of x, times the eight rows' scales dv and x's scale, into acc_i.
#define ADD_SCALED_SUMS(i) \
  if (i < MC) acc##i = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s##i), _mm256_mul_ps(dv, _mm256_broadcast_ss(ws->xd + i * B + b)), acc##i);

// Q8_0 weights interleaved the same way: per group of eight rows and block b, 256 bytes hold the
// rows' 32 bytes 4 at a time, chunk j (bytes 4j .. 4j + 3 of rows 0..7) at 32 j; the eight rows'
// scales of block b together. Each chunk meets x's four values broadcast, with the sign trick of
// Q_STEP (|w| times x with w's sign); two chunks' 16-bit sums could overflow, so each goes through
// `madd` into 32 bits. Lane r then holds row r's block sum.
INLINE void q8_x8(const workspace *ws, const int8_t *qs, const uint16_t *d, size_t MC, size_t K,
                  float out[MAX_M][8]) {
  size_t B = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  EIGHT(__m256, acc, _mm256_setzero_ps());
  for (size_t b = 0; b < B; ++b, qs += 256) {
    for (size_t line = 0; line < 256; line += 64) PREFETCH_LINE(qs + line);
    EIGHT(__m256i, s, _mm256_setzero_si256());
    for (size_t j = 0; j < 8; j += 2) {
      __m256i v0 = load32(qs + 32 * j), v1 = load32(qs + 32 * j + 32);
      __m256i w0 = _mm256_sign_epi8(v0, v0), w1 = _mm256_sign_epi8(v1, v1);
#define ROW(i) SIGNED_CHUNKS(i, ws->q + i * K + 32 * b + 4 * j, 4, v0, w0, v1, w1)
      ROWS_OF_X(ROW)
#undef ROW
    }
    __m256 dv = halves8(d + 8 * b);
    ROWS_OF_X(ADD_SCALED_SUMS)
  }
  SUMS_ARRAY(__m256, acc);
  group_outputs(acc, MC, out);
}

#define Q8_X8_AT(MC) /* as Q4_X8_AT */                                                                  \
  NOINLINE void q8_x8_##MC(const workspace *ws, const int8_t *qs, const uint16_t *d, size_t K,        \
                           float out[MAX_M][8]) {                                                      \
    Q8_X8_LOOP(ws, qs, d, MC, K, out);                                                                  \
  }
FOR_EACH_ROW_COUNT(Q8_X8_AT)

// ---- IQ4_NL and IQ4_XS with rows interleaved eight at a time ----
//
// Laid out as Q4_0X8 (per group of eight rows and block b of 32 values, 128 bytes hold 4 bytes of
// each row's 16 at a time); IQ4_XS's per-256 planes hold the eight rows' side by side: d and the
// scales' top bits sh (16 bits a row), their low bits sl (4 bytes a row). The nibbles index the
// value table (`pshufb`); block b's scale is d (IQ4_NL) or d times the 6-bit scale less 32 (IQ4_XS).

// IQ4_XS's super-block of the eight rows as iq4_scales8 reads it, loaded once for its 8 blocks
// (lane r: row r's): its scales' low bits, their top bits, d and -32 d.
typedef struct {
  __m256i lo, hi;
  __m256 d, bias;
} iq4_super;

INLINE iq4_super iq4_super_at(const uint16_t *d, const uint16_t *sh, const uint8_t *sl, size_t s) {
  __m256 d8 = halves8(d + 8 * s);
  return (iq4_super){load32(sl + 32 * s), _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(sh + 8 * s))), d8,
                     _mm256_mul_ps(d8, _mm256_set1_ps(-32.0f))};
}

// Block b's scales of the eight rows (lane r: row r's): IQ4_NL's d, or IQ4_XS's from its super-block
// x (d ls - 32 d, exact as d (ls - 32) is: at most 17 significant bits).
INLINE __m256 iq4_scales8(int kind, const uint16_t *d, const iq4_super *x, size_t b) {
  if (kind == IQ4_NLX8) return halves8(d + 8 * b);
  const int j = (int)(b % 8);
  __m256i lo = _mm256_and_si256(_mm256_srli_epi32(x->lo, 4 * j), _mm256_set1_epi32(15));
  __m256i hi = _mm256_and_si256(_mm256_srli_epi32(x->hi, 2 * j), _mm256_set1_epi32(3));
  return _mm256_fmadd_ps(x->d, _mm256_cvtepi32_ps(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4))), x->bias);
}

// Rows 0..7 of an x8 group times MC rows of x (quantized in ws, per 32): out[i][r]. The values are
// signed: each chunk meets x as q8_x8's (SIGNED_CHUNKS).
INLINE void iq4_x8(const workspace *ws, int kind, const uint8_t *qs, const uint16_t *d, const uint16_t *sh,
                   const uint8_t *sl, size_t MC, size_t K, float out[MAX_M][8]) {
  size_t B = K / 32;
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), table = iq4_table();
  iq4_super xs = {0};
  EIGHT(__m256, acc, _mm256_setzero_ps());
  for (size_t b = 0; b < B; ++b, qs += 128) {
    PREFETCH_TWO_STEPS(qs);
    PREFETCH_TWO_STEPS(qs + 64);
    EIGHT(__m256i, s, _mm256_setzero_si256());
    for (size_t j = 0; j < 4; ++j) {
      __m256i v = load32(qs + 32 * j);
      __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low4));
      __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
      __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi);
#define ROW(i) SIGNED_CHUNKS(i, ws->q + i * K + 32 * b + 4 * j, 16, lo, alo, hi, ahi)
      ROWS_OF_X(ROW)
#undef ROW
    }
    if (kind == IQ4_XSX8 && !(b & 7)) xs = iq4_super_at(d, sh, sl, b / 8);
    __m256 dv = iq4_scales8(kind, d, &xs, b);
    ROWS_OF_X(ADD_SCALED_SUMS)
  }
  SUMS_ARRAY(__m256, acc);
  group_outputs(acc, MC, out);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// With AVX-512 VNNI, as q4_x8_zmm: the table holds the values plus 128 (unsigned bytes for
// `vpdpbusd`), and each block's sum is corrected by -128 times x's block sum, as Q8_0's.
INLINE void iq4_x8_zmm(const workspace *ws, int kind, const uint8_t *qs, const uint16_t *d, const uint16_t *sh,
                       const uint8_t *sl, size_t MC, size_t K, float out[MAX_M][8]) {
  size_t B = K / 32;
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i table = _mm512_xor_si512(_mm512_broadcast_i32x4(iq4_values()), _mm512_set1_epi8((char)0x80));
  iq4_super xs = {0};
  EIGHT(__m512, acc, _mm512_setzero_ps());
  EIGHT(__m256, off, _mm256_setzero_ps());
  for (size_t b = 0; b < B; ++b, qs += 128) {
    PREFETCH_TWO_STEPS(qs);
    PREFETCH_TWO_STEPS(qs + 64);
    __m512i v0 = pair_chunks(_mm512_loadu_si512(qs)), v1 = pair_chunks(_mm512_loadu_si512(qs + 64));
    __m512i lo0 = _mm512_shuffle_epi8(table, _mm512_and_si512(v0, low4));
    __m512i hi0 = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4));
    __m512i lo1 = _mm512_shuffle_epi8(table, _mm512_and_si512(v1, low4));
    __m512i hi1 = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4));
    if (kind == IQ4_XSX8 && !(b & 7)) xs = iq4_super_at(d, sh, sl, b / 8);
    __m256 d8 = iq4_scales8(kind, d, &xs, b);
    __m512 dv = pair_scales(d8);
    __m256 mv = _mm256_mul_ps(d8, _mm256_set1_ps(-128.0f));
    ROWS_OF_X(NIBBLE_BLOCK)
  }
  PAIR_OUTPUTS;
}
#define IQ4_X8_LOOP iq4_x8_zmm
#else
#define IQ4_X8_LOOP iq4_x8
#endif

#define IQ4_X8_AT(MC) /* as Q4_X8_AT */                                                                       \
  NOINLINE void iq4_x8_##MC(const workspace *ws, int kind, const uint8_t *qs, const uint16_t *d,             \
                            const uint16_t *sh, const uint8_t *sl, size_t K, float out[MAX_M][8]) {          \
    IQ4_X8_LOOP(ws, kind, qs, d, sh, sl, MC, K, out);                                                         \
  }
FOR_EACH_ROW_COUNT(IQ4_X8_AT)

// Calls ROW(mc as a constant) so that each row count gets its own loop with registers for its
// accumulators.
#define FOR_CONSTANT_MC(mc, ROW) \
  switch (mc) {                  \
    case 1: ROW(1); break;       \
    case 2: ROW(2); break;       \
    case 3: ROW(3); break;       \
    case 4: ROW(4); break;       \
    case 5: ROW(5); break;       \
    case 6: ROW(6); break;       \
    case 7: ROW(7); break;       \
    default: ROW(MAX_M); break;  \
  }

// Outputs [n0, n1) of workgroup wg, `rows` per workgroup.
#define ROW_RANGE size_t n0 = wg * rows, n1 = n0 + rows < N ? n0 + rows : N;

// float16 weights [N, K], K a multiple of 8, times float32 x (not quantized).
// Eight independent multiply-add chains in all (nine at three rows of x), the FMA's latency times
// its throughput: three or four rows of x in one chain each would run at half the FMA units' rate.
#define F16_SPLIT(MC) ((MC) == 1 ? 8 : (MC) == 2 ? 4 : (MC) == 3 ? 3 : (MC) == 4 ? 2 : 1)

// The sums of eight 8-lane vectors, as eight floats: _mm256_hadd_ps's tree, which transposes as it
// adds (128-bit lane 0 of q0123 holds vectors 0 .. 3's first four lanes summed, lane 1 their last
// four), then the two lanes added.
INLINE __m256 sums8(__m256 c0, __m256 c1, __m256 c2, __m256 c3, __m256 c4, __m256 c5, __m256 c6, __m256 c7) {
  __m256 q0123 = _mm256_hadd_ps(_mm256_hadd_ps(c0, c1), _mm256_hadd_ps(c2, c3));
  __m256 q4567 = _mm256_hadd_ps(_mm256_hadd_ps(c4, c5), _mm256_hadd_ps(c6, c7));
  return _mm256_add_ps(_mm256_permute2f128_ps(q0123, q4567, 0x20), _mm256_permute2f128_ps(q0123, q4567, 0x31));
}

// f16_pair's chains (below), the same for both instruction sets' vectors, FMA their multiply-add:
// chain n, one of ch0 .. ch7, is pair p = n / S's, row p / MC of w (va, from wa; then vb, from wb)
// times row p % MC of x (x0 .. x3); F16_PAIR_OUTPUTS puts their sums (SUMS8 of the eight, as eight
// floats) in a[8 * i], wa's output for row i of x, and b[8 * i], wb's.
_Static_assert(2 * 2 * F16_SPLIT(4) == 8 && 2 * 3 * F16_SPLIT(6) <= 8 && 2 * 4 * F16_SPLIT(8) == 8,
               "ch0 .. ch7 name every chain of f16_pair");
#define F16_PAIR_X(i) ((i) == 0 ? x0 : (i) == 1 ? x1 : (i) == 2 ? x2 : x3)
#define F16_PAIR_CHAIN(FMA, n, u) \
  if (n < 2 * MC * S && n % S == (u)) ch##n = FMA(n / S < MC ? va : vb, F16_PAIR_X(n / S % MC), ch##n);
#define F16_PAIR_CHAINS(FMA, u)                                                                           \
  F16_PAIR_CHAIN(FMA, 0, u) F16_PAIR_CHAIN(FMA, 1, u) F16_PAIR_CHAIN(FMA, 2, u) F16_PAIR_CHAIN(FMA, 3, u) \
  F16_PAIR_CHAIN(FMA, 4, u) F16_PAIR_CHAIN(FMA, 5, u) F16_PAIR_CHAIN(FMA, 6, u) F16_PAIR_CHAIN(FMA, 7, u)
#define F16_PAIR_OUTPUTS(SUMS8)                                                                        \
  do {                                                                                                 \
    float sums[8];                                                                                     \
    _mm256_storeu_ps(sums, SUMS8(ch0, ch1, ch2, ch3, ch4, ch5, ch6, ch7));                             \
    for (size_t i = 0; i < MC; ++i) {                                                                  \
      a[8 * i] = b[8 * i] = 0.0f;                                                                      \
      for (size_t v = 0; v < S; ++v) a[8 * i] += sums[i * S + v], b[8 * i] += sums[(MC + i) * S + v]; \
    }                                                                                                  \
  } while (0)

INLINE void f16_row(const int bf16, const float *x, const uint16_t *wn, size_t MC, size_t K, float *out) {
  __m256 acc[MC][8];
  for (size_t i = 0; i < MC; ++i)
    for (size_t u = 0; u < F16_SPLIT(MC); ++u) acc[i][u] = _mm256_setzero_ps();
#define F16_STEP(k, u)                                                                               \
  {                                                                                                  \
    __m256 wk = weights8(bf16, wn + (k));                                                            \
    for (size_t i = 0; i < MC; ++i) acc[i][u] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + i * K + (k)), acc[i][u]); \
  }
  size_t k = 0;
  for (; k + 8 * F16_SPLIT(MC) <= K; k += 8 * F16_SPLIT(MC))
    for (size_t u = 0; u < F16_SPLIT(MC); ++u) F16_STEP(k + 8 * u, u)
  for (size_t u = 0; k < K; k += 8, ++u) F16_STEP(k, u)  // fewer than F16_SPLIT chunks left
  for (size_t i = 0; i < MC; ++i) {
    for (size_t u = 1; u < F16_SPLIT(MC); ++u) acc[i][0] = _mm256_add_ps(acc[i][0], acc[i][u]);
    out[i] = hsum(acc[i][0]);
  }
}

#ifdef __AVX512F__
// The f16 loops' loads: 16 weights, the 8 of a row's last half-vector (upper lanes 0), 8 values of x.
#define LOAD_W16(p) _mm256_loadu_si256((const __m256i *)(p))
#define LOAD_W8(p) _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD_X8(p) _mm512_maskz_loadu_ps(0xFF, p)
// 16 float16 (bf16 0) or bfloat16 weights in v, as float32
INLINE __m512 weights16(const int bf16, __m256i v) {
  return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)) : _mm512_cvtph_ps(v);
}

// f16_row in 16-lane vectors, for two or more rows of x where the object is built for AVX-512
// (kernels.isa()): half the conversions and multiply-adds; a row's last 8 values, if K is not a
// multiple of 16, in a step of its own (masked loads throughout run slower than AVX2). One row of x
// is bound by memory and is slower this way: it stays in f16_row.
// Each chain is a variable of its own (ch0 .. ch8, as ROWS_OF_X above), and the weights are read
// ahead in two steps (see FAR_AHEAD): kept in an array, the sums go to the stack as soon as the loop
// holds a prefetch, which makes a product far slower.
INLINE void f16_row_zmm(const int bf16, const float *x, const uint16_t *wn, size_t MC, size_t K, float *out) {
  const size_t S = F16_SPLIT(MC);  // chains a row of x: chain n is row n / S's, for vector n % S of a step
  __m512 ch0 = _mm512_setzero_ps(), ch1 = ch0, ch2 = ch0, ch3 = ch0, ch4 = ch0, ch5 = ch0, ch6 = ch0, ch7 = ch0, ch8 = ch0;
  _Static_assert(2 * F16_SPLIT(2) <= 9 && 3 * F16_SPLIT(3) <= 9 && 4 * F16_SPLIT(4) <= 9 && MAX_M <= 9,
                 "ch0 .. ch8 name every chain");
#define CHAIN_STEP(n, k, u, LOAD_X) \
  if (n < MC * S && n % S == (u)) ch##n = _mm512_fmadd_ps(wv, LOAD_X(x + n / S * K + (k)), ch##n);
#define STEP(k, u, LOAD_W, LOAD_X) /* the weights at k, vector u of a step, times each row of x */ \
  {                                                                                               \
    __m512 wv = weights16(bf16, LOAD_W(wn + (k)));                                                \
    CHAIN_STEP(0, k, u, LOAD_X) CHAIN_STEP(1, k, u, LOAD_X) CHAIN_STEP(2, k, u, LOAD_X)           \
    CHAIN_STEP(3, k, u, LOAD_X) CHAIN_STEP(4, k, u, LOAD_X) CHAIN_STEP(5, k, u, LOAD_X)           \
    CHAIN_STEP(6, k, u, LOAD_X) CHAIN_STEP(7, k, u, LOAD_X) CHAIN_STEP(8, k, u, LOAD_X)           \
  }
  size_t k = 0;
  for (; k + 16 * S <= K; k += 16 * S) {
    PREFETCH_TWO_STEPS(wn + k);
    STEP(k, 0, LOAD_W16, _mm512_loadu_ps)
    if (S > 1) STEP(k + 16, 1, LOAD_W16, _mm512_loadu_ps)
    if (S > 2) STEP(k + 32, 2, LOAD_W16, _mm512_loadu_ps)
    if (S > 3) STEP(k + 48, 3, LOAD_W16, _mm512_loadu_ps)
  }
  size_t u = 0;  // fewer than S vectors of a row left: to its chains in turn
  for (; k + 16 <= K; k += 16, ++u) STEP(k, u, LOAD_W16, _mm512_loadu_ps)
  if (k < K) STEP(k, u, LOAD_W8, LOAD_X8)
  const float sums[9] = {_mm512_reduce_add_ps(ch0), _mm512_reduce_add_ps(ch1), _mm512_reduce_add_ps(ch2),
                         _mm512_reduce_add_ps(ch3), _mm512_reduce_add_ps(ch4), _mm512_reduce_add_ps(ch5),
                         _mm512_reduce_add_ps(ch6), _mm512_reduce_add_ps(ch7), _mm512_reduce_add_ps(ch8)};
  for (size_t i = 0; i < MC; ++i) {
    out[i] = 0.0f;
    for (size_t v = 0; v < S; ++v) out[i] += sums[i * S + v];
  }
#undef CHAIN_STEP
#undef STEP
}

// The sums of eight 16-lane vectors, as eight floats: each vector's halves added (two vectors to a
// shuffle pair), then sums8's tree. About 37 operations for the eight, where _mm512_reduce_add_ps
// takes about 8 each.
INLINE __m256 sums8_zmm(__m512 c0, __m512 c1, __m512 c2, __m512 c3, __m512 c4, __m512 c5, __m512 c6, __m512 c7) {
#define HALVES(a, b) /* [a's halves added, b's halves added] */ \
  _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)))
  __m512 p01 = HALVES(c0, c1), p23 = HALVES(c2, c3), p45 = HALVES(c4, c5), p67 = HALVES(c6, c7);
#undef HALVES
#define LO(p) _mm512_castps512_ps256(p)
#define HI(p) _mm512_extractf32x8_ps(p, 1)
  return sums8(LO(p01), HI(p01), LO(p23), HI(p23), LO(p45), HI(p45), LO(p67), HI(p67));
#undef LO
#undef HI
}

// Two rows of float16 weights, wa and wb, times MC (2 to 4) rows of x (without AVX-512: the same in
// 8-lane vectors, below): f16_row_zmm's loop with each vector of x loaded once for both rows, and
// one reduction (sums8_zmm) for the pair, where f16_row_zmm spent 8 _mm512_reduce_add_ps on each
// row. a[8 * i] is wa's output for row i of x, b[8 * i] wb's (so a and b can be columns of
// out[MAX_M][8]).
INLINE void f16_pair(const int bf16, const float *x, const uint16_t *wa, const uint16_t *wb, size_t MC, size_t K,
                     float *a, float *b) {
  const size_t S = F16_SPLIT(2 * MC);  // chains a (row of w, row of x): chain n is pair n / S's
  __m512 ch0 = _mm512_setzero_ps(), ch1 = ch0, ch2 = ch0, ch3 = ch0, ch4 = ch0, ch5 = ch0, ch6 = ch0, ch7 = ch0;
  // Each row of x's vector is loaded once for both rows of w, into a register: gcc otherwise folds
  // the load into each multiply-add, loading it twice.
#define LOAD_X_ROW(i, k, LOAD_X)                            \
  __m512 x##i = LOAD_X(x + ((i) < MC ? (i) : 0) * K + (k)); \
  if ((i) < MC) __asm__("" : "+v"(x##i));
#define STEP(k, u, LOAD_W, LOAD_X)                                                                        \
  {                                                                                                       \
    __m512 va = weights16(bf16, LOAD_W(wa + (k))), vb = weights16(bf16, LOAD_W(wb + (k)));               \
    LOAD_X_ROW(0, k, LOAD_X) LOAD_X_ROW(1, k, LOAD_X) LOAD_X_ROW(2, k, LOAD_X) LOAD_X_ROW(3, k, LOAD_X) \
    F16_PAIR_CHAINS(_mm512_fmadd_ps, u)                                                                   \
  }
  size_t k = 0;
  for (; k + 32 <= K; k += 32) {  // a line of each row of w
    PREFETCH_TWO_STEPS(wa + k);
    PREFETCH_TWO_STEPS(wb + k);
    STEP(k, 0, LOAD_W16, _mm512_loadu_ps)
    STEP(k + 16, 1 % S, LOAD_W16, _mm512_loadu_ps)
  }
  if (k + 16 <= K) {
    STEP(k, 0, LOAD_W16, _mm512_loadu_ps)
    k += 16;
  }
  if (k < K) STEP(k, 1 % S, LOAD_W8, LOAD_X8)
  F16_PAIR_OUTPUTS(sums8_zmm);
#undef LOAD_X_ROW
#undef STEP
}
#undef LOAD_W16
#undef LOAD_W8
#undef LOAD_X8
#define F16_ROWS f16_row_zmm
#else
#define F16_ROWS f16_row
// f16_pair (above) in 8-lane vectors, for objects built for AVX2: each vector of x loaded once for
// both rows of w, where f16_row for each row loaded it twice. Eight chains at most, as above; with
// the two rows of w and four of x, 14 of the 16 vector registers.
INLINE void f16_pair(const int bf16, const float *x, const uint16_t *wa, const uint16_t *wb, size_t MC, size_t K,
                     float *a, float *b) {
  const size_t S = F16_SPLIT(2 * MC);  // chains a (row of w, row of x): chain n is pair n / S's
  __m256 ch0 = _mm256_setzero_ps(), ch1 = ch0, ch2 = ch0, ch3 = ch0, ch4 = ch0, ch5 = ch0, ch6 = ch0, ch7 = ch0;
#define LOAD_X_ROW(i, k)                                                 \
  __m256 x##i = _mm256_loadu_ps(x + ((i) < MC ? (i) : 0) * K + (k));    \
  if ((i) < MC) __asm__("" : "+x"(x##i));
#define STEP(k, u)                                                                             \
  {                                                                                            \
    __m256 va = weights8(bf16, wa + (k)), vb = weights8(bf16, wb + (k));                       \
    LOAD_X_ROW(0, k) LOAD_X_ROW(1, k) LOAD_X_ROW(2, k) LOAD_X_ROW(3, k)                        \
    F16_PAIR_CHAINS(_mm256_fmadd_ps, u)                                                        \
  }
  size_t k = 0;
  for (; k + 32 <= K; k += 32) {  // a line of each row of w
    PREFETCH_TWO_STEPS(wa + k);
    PREFETCH_TWO_STEPS(wb + k);
    STEP(k, 0)
    STEP(k + 8, 1 % S)
    STEP(k + 16, 0)
    STEP(k + 24, 1 % S)
  }
  for (; k + 16 <= K; k += 16) {
    STEP(k, 0)
    STEP(k + 8, 1 % S)
  }
  if (k < K) STEP(k, 0)
  F16_PAIR_OUTPUTS(sums8);
#undef LOAD_X_ROW
#undef STEP
}
#endif
// The rows of x (mc) at which product_rows takes F16 rows of w two at a time (f16_pair). Not with
// SHARKPORT_PRODUCTS, whose read_rows stands in for some_rows (so F16 does not bypass some_rows),
// fetching as f16_pair would (F16_PAIR_ROWS).
#define F16_PAIR_ROWS(mc) ((mc) >= 2 && (mc) <= 4)
#define F16_PAIRS(mc) (!SHARKPORT_PRODUCTS && F16_PAIR_ROWS(mc))
INLINE void f16_pairs(const int bf16, const float *x, const uint16_t *wa, const uint16_t *wb, size_t mc, size_t K,
                      float *a, float *b) {  // f16_pair with its row count a constant
  switch (mc) {
    case 2: f16_pair(bf16, x, wa, wb, 2, K, a, b); break;
    case 3: f16_pair(bf16, x, wa, wb, 3, K, a, b); break;
    default: f16_pair(bf16, x, wa, wb, 4, K, a, b); break;
  }
}

// exp(x) for x <= 0 (scores minus their running max): 2^n exp(r), n = round(x / ln 2),
// r = x - n ln 2 in two parts, exp(r) by its Taylor polynomial of degree 7 (|r| <= 0.35:
// relative error below 2e-8 before float32 rounding). x below -87 gives exp(-87), about 1.6e-38.
INLINE __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

INLINE float exp_scalar(float x) { return _mm256_cvtss_f32(exp_nonpositive(_mm256_set1_ps(x))); }

// One weight matrix of a product: its planes (F16: the values in qs; Q4_K: its dmin in m; Q6_K:
// its ql in qs), its number of rows, and Q5_0's and Q6_K's high bits h and the K-quants' scales s.
typedef struct {
  const void *qs;
  const uint16_t *d, *m;
  size_t n;
  const uint8_t *h, *s;
} matrix;
enum { CONCAT, SWIGLU };  // y = [x w0^T, x w1^T, ...], or y = silu(x w0^T) * (x w1^T)

INLINE float silu(float g) {  // g * sigmoid(g), with exp only of non-positive values
  float e = exp_scalar(g < 0 ? g : -g);
  return g * (g < 0 ? e / (1.0f + e) : 1.0f / (1.0f + e));
}

// silu(g) * u of eight outputs at once, each as silu() computes it (which takes an exp of one
// vector lane an output).
INLINE __m256 swiglu8(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  __m256 e = exp_nonpositive(_mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), g, negative));
  __m256 one_e = _mm256_add_ps(one, e);
  __m256 sigmoid = _mm256_blendv_ps(_mm256_div_ps(one, one_e), _mm256_div_ps(e, one_e), negative);
  return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u);
}

// A row of w's bytes in each plane (see sharkport.quant): its values (their low bits) qs, of K
// values; per 32 values, in 1/256 bytes, its scales d and offsets m (or K-quant mins, IQ4_XS's
// scales' top bits), high bits h and scales s.
INLINE size_t qs_row_bytes(int kind, size_t K) {
  if (FLOAT_WEIGHTS(kind)) return 2 * K;
  if (kind == Q8_0 || kind == Q8_0X8) return K;
  return kind == Q2_K || kind == Q3_K || K23_X8_KIND(kind) ? K / 4 : K / 2;
}
INLINE size_t d_bytes256(int kind) { return X_PER_256(kind) || IQ4_XS_KIND(kind) ? 64 : 512; }
INLINE size_t h_bytes256(int kind) { return kind == Q6_K || kind == Q6_KX8 ? 2048 : 1024; }
INLINE size_t s_bytes256(int kind) {
  if (IQ4_XS_KIND(kind)) return 128;
  return kind == Q6_K || kind == Q6_KX8 || kind == Q2_K || kind == Q2_KX8 ? 512 : 384;
}

#if SHARKPORT_PRODUCTS == 1

// Rows [n, n + rows) of w's planes read (SHARKPORT_PRODUCTS 1) in the products' order, a block of
// 32 values of the rows at a time: a byte of each line of its weights, fetched ahead where and as
// the product for mc rows of x fetches them (PREFETCH bytes ahead, or in two steps), and a byte of
// each line of its other planes, in step with the weights' (a plane's bytes up to block b's share)
// and fetched as many blocks ahead (as PREFETCH_PLANES does). No divisions: this runs per group.
NOINLINE void read_rows(int kind, const matrix *w, size_t n, size_t rows, size_t mc, size_t K) {
  size_t B = K / 32, block = rows * qs_row_bytes(kind, 32);
  struct plane {
    const uint8_t *at;
    size_t per_block, done, far, near;  // per_block in 1/256 bytes
  } planes[5] = {{(const uint8_t *)w->qs + n * B * (block / rows), block << 8}};
  size_t count = 1;
#define PLANE(p, bytes256) \
  if (p) planes[count++] = (struct plane){(const uint8_t *)(p) + ((n * B * (bytes256)) >> 8), rows * (bytes256)}
  if (!FLOAT_WEIGHTS(kind)) {
    PLANE(w->d, d_bytes256(kind));
    PLANE(w->m, d_bytes256(kind));
    PLANE(w->h, h_bytes256(kind));
    PLANE(w->s, s_bytes256(kind));
  }
#undef PLANE
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  const int ahead = kind == Q8_0X8 || FLOAT_WEIGHTS(kind) ? mc > 1 : kind != Q4_0 && kind != Q4_1;  // see q8_x8_zmm
  const int two_steps = Q4_X8_KIND(kind) || IQ4_X8_KIND(kind) || kind == Q8_0X8 || FLOAT_WEIGHTS(kind);  // see FAR_AHEAD
#else
  // F16: f16_pair fetches, f16_row (one row of x, or more than four) does not
  const int ahead = FLOAT_WEIGHTS(kind) ? F16_PAIR_ROWS(mc) : kind != Q4_0 && kind != Q4_1;
  const int two_steps = Q4_X8_KIND(kind) || IQ4_X8_KIND(kind) || FLOAT_WEIGHTS(kind);
#endif
  const int scale = 8 + __builtin_ctzl(block);  // block: a power of two
  for (size_t p = 0; p < count && ahead; ++p) {
    planes[p].far = ((two_steps ? FAR_AHEAD : PREFETCH) * planes[p].per_block) >> scale;
    planes[p].near = two_steps ? (NEAR_AHEAD * planes[p].per_block) >> scale : 0;
  }
  uint8_t seen = 0;
  for (size_t b = 0; b < B; ++b)
    for (size_t p = 0; p < count; ++p) {
      struct plane *q = &planes[p];
      for (size_t end = (q->per_block * (b + 1)) >> 8; q->done < end; q->done += 64) {
        const char *line = (const char *)q->at + q->done;
        if (q->far && two_steps)
          _mm_prefetch(line + q->far, _MM_HINT_T1);
        else if (q->far)
          _mm_prefetch(line + q->far, _MM_HINT_T0);
        if (q->near) _mm_prefetch(line + q->near, _MM_HINT_T0);
        seen ^= *line;
      }
    }
  __asm__ volatile("" ::"r"(seen));
}
#endif

// ---- K-quants, a row at a time ----
//
// A K-quant row is super-blocks of 256 values, each one of x's blocks (quantize_x_k).
// Q4_K: value = d sc[j] q - dmin mn[j] for q in 0..15 and 6-bit sc, mn per 32 values j; Q5_K the
// same with q in 0..31; Q6_K: value = d sc[j] (q - 32) for q in 0..63 and signed 8-bit sc per 16
// values j (ggml's dequantize_row_q4_K, _q5_K and _q6_K); Q3_K and Q2_K as q23k_row says. Per super-block and row of x, the
// products of 32 values are a `maddubs`, a `madd` by their scale and an integer add, and the
// super-block's sum is scaled once; the mins (Q4_K, Q5_K) and Q6_K's -32 are x's sums of 16 (bs)
// times the scales, a `madd` a super-block.

// Q4_K's eight 6-bit scales and mins, packed in 12 bytes (ggml's get_scale_min_k4: bytes 0..3
// hold the low 6 bits of scales 0..3, bytes 4..7 of mins 0..3, and their top 2 bits the high
// bits of scales and mins 4..7, whose low 4 bits are bytes 8..11's nibbles), as 16-bit lanes: the
// scales in lanes 0..7 of each 128-bit half (sc8), the mins each in two lanes, 2j and 2j + 1 (mn16,
// to meet x's sums of 16).
INLINE void k4_scales(const uint8_t *q, __m256i *sc8, __m256i *mn16) {
  uint32_t u[3];
  __builtin_memcpy(u, q, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x30303030;
  uint32_t sc_lo = u[0] & low6, sc_hi = (u[2] & low4) | ((u[0] >> 2) & top2);
  uint32_t mn_lo = u[1] & low6, mn_hi = ((u[2] >> 4) & low4) | ((u[1] >> 2) & top2);
  __m128i sc = _mm_cvtepu8_epi16(_mm_setr_epi32((int)sc_lo, (int)sc_hi, 0, 0));
  __m128i mn = _mm_setr_epi32((int)mn_lo, (int)mn_hi, 0, 0);
  *sc8 = _mm256_broadcastsi128_si256(sc);
  *mn16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn, mn));
}

// Every 16-bit lane of v's low 128-bit half set to that half's lane j0, of its high half to lane j1
INLINE __m256i lanes16(__m256i v, int j0, int j1) {
  return _mm256_shuffle_epi8(v, _mm256_setr_m128i(_mm_set1_epi16((short)(0x0202 * j0 + 0x0100)),
                                                  _mm_set1_epi16((short)(0x0202 * j1 + 0x0100))));
}

// One Q4_K or Q5_K row (qs 128 bytes a super-block: 32 bytes hold two blocks, the low nibbles one
// and the high the next; Q5_K's qh 32 bytes, bits 2c and 2c + 1 of byte l the fifth bits of
// value l of blocks 2c and 2c + 1; d and dmin float16; 12 bytes of scales) times MC rows of x into
// out.
INLINE void q4k_row(int kind, const workspace *ws, const uint8_t *qs, const uint16_t *d, const uint16_t *dmin,
                    const uint8_t *scales, const uint8_t *qh, size_t MC, size_t K, float *out) {
  size_t S = K / 256;
  const __m256i low4 = _mm256_set1_epi8(15), fifth = _mm256_set1_epi8(16);
  __m256 acc[MC];
  for (size_t i = 0; i < MC; ++i) acc[i] = _mm256_setzero_ps();
  for (size_t s = 0; s < S; ++s, qs += 128, scales += 12, qh += kind == Q5_K ? 32 : 0) {
    PREFETCH_LINE(qs);
    PREFETCH_LINE(qs + 64);
    if (kind == Q5_K) PREFETCH_LINE(qh);
    __m256i sc8, mn16, sum[MC];
    k4_scales(scales, &sc8, &mn16);
    for (size_t i = 0; i < MC; ++i) sum[i] = _mm256_setzero_si256();
    const __m256i h = kind == Q5_K ? load32(qh) : _mm256_setzero_si256();
    for (size_t c = 0; c < 4; ++c) {
      __m256i v = load32(qs + 32 * c);
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if (kind == Q5_K) {  // bit 2c (2c + 1) of each byte to bit 4 (each byte's own: the shifts stay within it)
        __m256i h0 = c < 2 ? _mm256_slli_epi16(h, 4 - 2 * (int)c) : _mm256_srli_epi16(h, 2 * (int)c - 4);
        __m256i h1 = c < 2 ? _mm256_slli_epi16(h, 3 - 2 * (int)c) : _mm256_srli_epi16(h, 2 * (int)c - 3);
        lo = _mm256_or_si256(lo, _mm256_and_si256(h0, fifth));
        hi = _mm256_or_si256(hi, _mm256_and_si256(h1, fifth));
      }
      __m256i s_lo = lanes16(sc8, 2 * (int)c, 2 * (int)c), s_hi = lanes16(sc8, 2 * (int)c + 1, 2 * (int)c + 1);
      for (size_t i = 0; i < MC; ++i) {  // |maddubs| <= 2 * 31 * 127: no saturation
        const int8_t *xq = ws->q + i * K + 256 * s + 64 * c;
        __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(xq)), s_lo);
        __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(xq + 32)), s_hi);
        sum[i] = _mm256_add_epi32(sum[i], _mm256_add_epi32(p_lo, p_hi));
      }
    }
    float ds = half(d[s]), dm = half(dmin[s]);
    for (size_t i = 0; i < MC; ++i) {
      float xd = ws->xd[i * S + s];
      __m256i mins = _mm256_madd_epi16(mn16, load32(ws->bs + i * (K / 16) + 16 * s));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), _mm256_set1_ps(ds * xd), acc[i]);
      acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(dm * xd), acc[i]);
    }
  }
  for (size_t i = 0; i < MC; ++i) out[i] = hsum(acc[i]);
}

// One Q6_K row (per super-block: ql 128 bytes of low nibbles, qh 64 bytes of 2-bit high parts,
// 16 signed scales, d float16) times MC rows of x into out. Each half of a super-block is 64 bytes
// of ql and 32 of qh: its values 32g + l (g = 0..3) take ql[l] (g 0, 2) or ql[32 + l] (g 1, 3),
// low nibble for g < 2, and bits 2g, 2g + 1 of qh[l]; scale sc[8 half + 2g + l / 16].
INLINE void q6k_row(const workspace *ws, const uint8_t *ql, const uint16_t *d, const uint8_t *qh,
                    const int8_t *scales, size_t MC, size_t K, float *out) {
  size_t S = K / 256;
  const __m256i low4 = _mm256_set1_epi8(15), high2 = _mm256_set1_epi8(0x30);
  __m256 acc[MC];
  for (size_t i = 0; i < MC; ++i) acc[i] = _mm256_setzero_ps();
  for (size_t s = 0; s < S; ++s, ql += 128, qh += 64, scales += 16) {
    PREFETCH_LINE(ql);
    PREFETCH_LINE(ql + 64);
    PREFETCH_LINE(qh);
    __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scales)), sum[MC];
    // each half's eight scales in both 128-bit halves, for lanes16
    const __m256i half_sc[2] = {_mm256_permute2x128_si256(sc, sc, 0x00), _mm256_permute2x128_si256(sc, sc, 0x11)};
    for (size_t i = 0; i < MC; ++i)  // the -32 of every value: x's sums of 16 times the scales
      sum[i] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                _mm256_slli_epi32(_mm256_madd_epi16(sc, load32(ws->bs + i * (K / 16) + 16 * s)), 5));
    for (size_t h = 0; h < 2; ++h) {
      __m256i l0 = load32(ql + 64 * h), l1 = load32(ql + 64 * h + 32), hb = load32(qh + 32 * h);
      __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), high2)),
          _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), high2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(hb, high2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(hb, 2), high2))};
      for (size_t g = 0; g < 4; ++g) {
        // the block's two scales, one for each 16 values: 16-bit lanes 0..7, then 8..15
        __m256i sc16 = lanes16(half_sc[h], 2 * (int)g, 2 * (int)g + 1);
        for (size_t i = 0; i < MC; ++i) {  // |maddubs| <= 2 * 63 * 127: no saturation
          __m256i xb = load32(ws->q + i * K + 256 * s + 128 * h + 32 * g);
          sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], xb), sc16));
        }
      }
    }
    float ds = half(d[s]);
    for (size_t i = 0; i < MC; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), _mm256_set1_ps(ds * ws->xd[i * S + s]), acc[i]);
  }
  for (size_t i = 0; i < MC; ++i) out[i] = hsum(acc[i]);
}

// Q3_K's sixteen 6-bit scales, packed in 12 bytes (ggml's dequantize_row_q3_K: bytes 0..7 hold
// the low 4 bits of scales 0..7 and, in their high nibbles, of 8..15; bytes 8..11 the top 2 bits,
// four to a byte), as 16 signed bytes less their offset of 32.
INLINE __m128i k3_scales(const uint8_t *q) {
  uint32_t u[3];
  __builtin_memcpy(u, q, 12);
  const uint32_t low4 = 0x0f0f0f0f, low2 = 0x03030303;
  __m128i sc = _mm_setr_epi32((int)((u[0] & low4) | ((u[2] & low2) << 4)),
                              (int)((u[1] & low4) | (((u[2] >> 2) & low2) << 4)),
                              (int)(((u[0] >> 4) & low4) | (((u[2] >> 4) & low2) << 4)),
                              (int)(((u[1] >> 4) & low4) | (((u[2] >> 6) & low2) << 4)));
  return _mm_sub_epi8(sc, _mm_set1_epi8(32));
}

// One Q3_K or Q2_K row times MC rows of x into out. Per super-block both hold 64 bytes of 2-bit
// parts: value 128 h + 32 j + l (h = 0, 1; j = 0..3; l = 0..31) is bits 2j, 2j + 1 of qs[32 h + l],
// its scale number 8 h + 2 j + l / 16 (ggml's dequantize_row_q3_K and _q2_K). Q3_K: value =
// d sc (q - 4), q the 2 bits with bit 4h + j of hmask[l] as its third, sc 6-bit less 32; Q2_K:
// value = d sc q - dmin mn, sc and mn each byte of scales' low and high nibble. The -4 and the mins
// are x's sums of 16 times the scales (mins), a `madd` a super-block.
INLINE void q23k_row(int kind, const workspace *ws, const uint8_t *qs, const uint16_t *d, const uint16_t *dmin,
                     const uint8_t *hmask, const uint8_t *scales, size_t MC, size_t K, float *out) {
  size_t S = K / 256;
  const __m256i low2 = _mm256_set1_epi8(3), third = _mm256_set1_epi8(4);
  __m256 acc[MC];
  for (size_t i = 0; i < MC; ++i) acc[i] = _mm256_setzero_ps();
  for (size_t s = 0; s < S; ++s, qs += 64, hmask += 32, scales += kind == Q3_K ? 12 : 16) {
    PREFETCH_LINE(qs);
    if (kind == Q3_K && !(s & 1)) PREFETCH_LINE(hmask);
    __m256i sc, mn = _mm256_setzero_si256(), sum[MC], mins[MC];
    if (kind == Q3_K) {
      sc = _mm256_cvtepi8_epi16(k3_scales(scales));
    } else {
      __m128i b = _mm_loadu_si128((const __m128i *)scales);
      sc = _mm256_cvtepu8_epi16(_mm_and_si128(b, _mm_set1_epi8(15)));
      mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
    }
    // each half's eight scales in both 128-bit halves, for lanes16
    const __m256i half_sc[2] = {_mm256_permute2x128_si256(sc, sc, 0x00), _mm256_permute2x128_si256(sc, sc, 0x11)};
    for (size_t i = 0; i < MC; ++i) {
      __m256i bs = load32(ws->bs + i * (K / 16) + 16 * s);
      if (kind == Q3_K)  // the -4 of every value
        sum[i] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc, bs), 2));
      else
        sum[i] = _mm256_setzero_si256(), mins[i] = _mm256_madd_epi16(mn, bs);
    }
    const __m256i hm = kind == Q3_K ? load32(hmask) : _mm256_setzero_si256();
    for (size_t h = 0; h < 2; ++h) {
      __m256i v = load32(qs + 32 * h);
      for (size_t j = 0; j < 4; ++j) {
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (int)j), low2);
        if (kind == Q3_K) {  // bit 4h + j of each byte to bit 2 (each byte's own: the shifts stay within it)
          int bit = 4 * (int)h + (int)j;
          __m256i t = bit >= 2 ? _mm256_srli_epi16(hm, bit - 2) : _mm256_slli_epi16(hm, 2 - bit);
          q = _mm256_or_si256(q, _mm256_and_si256(t, third));
        }
        // the two scales of these 32 values, one for each 16: 16-bit lanes 0..7, then 8..15
        __m256i sc16 = lanes16(half_sc[h], 2 * (int)j, 2 * (int)j + 1);
        for (size_t i = 0; i < MC; ++i) {  // |maddubs| <= 2 * 7 * 127: no saturation
          __m256i xb = load32(ws->q + i * K + 256 * s + 128 * h + 32 * j);
          sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xb), sc16));
        }
      }
    }
    float ds = half(d[s]);
    for (size_t i = 0; i < MC; ++i) {
      float xd = ws->xd[i * S + s];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), _mm256_set1_ps(ds * xd), acc[i]);
      if (kind == Q2_K)
        acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[i]), _mm256_set1_ps(half(dmin[s]) * xd), acc[i]);
    }
  }
  for (size_t i = 0; i < MC; ++i) out[i] = hsum(acc[i]);
}

// The AVX2 K-quant loops (q4k_x8, q6k_x8, q23k_x8) at one row of x leave their weights to the
// hardware's prefetch, which streams large matrices (a 3B's) faster than the two steps do; at more
// rows of x they fetch in two steps.
#define PREFETCH_KX8_AVX2(p)           \
  do {                                 \
    if (MC > 1) PREFETCH_TWO_STEPS(p); \
  } while (0)

// Q4_K with rows interleaved eight at a time (Q4_KX8): per group of eight rows and super-block,
// qs is 32 chunks of 32 bytes (chunk j: bytes 4j .. 4j + 3 of the eight rows' 128, so chunks
// 8c .. 8c + 7 hold sub-blocks 2c, low nibbles, and 2c + 1, high), the scales 3 chunks (bytes
// 4t .. 4t + 3 of the rows' 12: lane r of chunk t is row r's word t of get_scale_min_k4), and d
// and dmin the eight rows' values side by side. Each 32-byte load serves the eight rows, and a
// sub-block's scale is a vector of the rows' scales: per sub-block and row of x, 8 `maddubs`
// and adds in 16 bits (at most 8 * 2 * 15 * 127), then one `madd` by the scales into 32 bits;
// the mins are x's sums of 16 times the rows' mins, a `madd` a sub-block.

// The eight rows' 6-bit scales (sc) and mins (mn) of one super-block: word t of lane r of sc[t]
// (mn[t]) holds row r's scales (mins) 4t .. 4t + 3, a byte each (ggml's get_scale_min_k4 on all
// eight rows at once).
INLINE void k4_scales_x8(const uint8_t *scales, __m256i sc[2], __m256i mn[2]) {
  const __m256i low6 = _mm256_set1_epi8(0x3f), low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30);
  __m256i u0 = load32(scales), u1 = load32(scales + 32), u2 = load32(scales + 64);
  sc[0] = _mm256_and_si256(u0, low6);
  mn[0] = _mm256_and_si256(u1, low6);
  sc[1] = _mm256_or_si256(_mm256_and_si256(u2, low4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), top2));
  mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi32(u1, 2), top2));
}

// Byte k of each 32-bit lane of v, in both of the lane's 16-bit halves.
INLINE __m256i byte_in_halves(__m256i v, int k) {
  const __m128i at = _mm_setr_epi8((char)k, -1, (char)k, -1, (char)(4 + k), -1, (char)(4 + k), -1, (char)(8 + k), -1,
                                   (char)(8 + k), -1, (char)(12 + k), -1, (char)(12 + k), -1);
  return _mm256_shuffle_epi8(v, _mm256_setr_m128i(at, at));
}

// The AVX2 eight-row K-quant loops' rows of x in super-block s, xr0 .. xr7: a step's four bytes of
// x are then a constant offset from a pointer (from i * K, gcc spent an address computation a step).
#define K_X8_ROWS_OF_X                                                                              \
  const int8_t *xr0 = ws->q + 256 * s, *xr1 = xr0 + K, *xr2 = xr1 + K, *xr3 = xr2 + K, *xr4 = xr3 + K, \
               *xr5 = xr4 + K, *xr6 = xr5 + K, *xr7 = xr6 + K;                                        \
  (void)xr1, (void)xr2, (void)xr3, (void)xr4, (void)xr5, (void)xr6, (void)xr7

// The AVX2 eight-row K-quant loops' steps for row i of x: a chunk's values q times x's four at xq
// as 16-bit pair sums into s16_i, and s16_i times the rows' scales into 32 bits in si_i.
#define K_X8_PAIR_SUMS(i, xq)                                                   \
  if (i < MC) {                                                                 \
    s16##i = _mm256_add_epi16(s16##i, _mm256_maddubs_epi16(q, broadcast4(xq))); \
    __asm__("" : "+x"(s16##i)); /* as in q4_x8 */                               \
  }
#define K_X8_SCALED(i, scale)                                          \
  if (i < MC) {                                                        \
    si##i = _mm256_add_epi32(si##i, _mm256_madd_epi16(s16##i, scale)); \
    s16##i = _mm256_setzero_si256();                                   \
  }

// Lane r: the sum over p of x's sums of 16 bs[2p], bs[2p + 1] (a super-block's) times the 16-bit
// halves of lane r of f[p]: the eight-row AVX2 K-quant loops' mins and offsets.
INLINE __m256i x8_sums_of_16(const __m256i f[8], const int16_t *bs) {
  __m256i t = _mm256_setzero_si256();
  for (size_t p = 0; p < 8; ++p) {
    int32_t pair;
    __builtin_memcpy(&pair, bs + 2 * p, 4);
    t = _mm256_add_epi32(t, _mm256_madd_epi16(f[p], _mm256_set1_epi32(pair)));
  }
  return t;
}

// Rows 0..7 of a Q4_KX8 or Q5_KX8 group times MC rows of x (quantized per 256 values in ws):
// out[i][r]. Q5_K's qh is interleaved as qs: its chunk l holds the fifth bits of the values of
// qs's chunks l, 8 + l, 16 + l and 24 + l (bit k: sub-block k's), and with values to 31 a
// sub-block's 16-bit sums are taken into 32 bits every 4 chunks.
INLINE void q4k_x8(const workspace *ws, int kind, const uint8_t *qs, const uint8_t *qh, const uint16_t *d,
                   const uint16_t *dmin, const uint8_t *scales, size_t MC, size_t K, float out[MAX_M][8]) {
  size_t S = K / 256;
  const int five = kind == Q5_KX8;
  const __m256i low4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
  EIGHT(__m256, acc, _mm256_setzero_ps());
  for (size_t s = 0; s < S; ++s, qs += 1024, qh += five ? 256 : 0, scales += 96) {
    __m256i sc[2], mn[2];
    k4_scales_x8(scales, sc, mn);
    EIGHT(__m256i, si, _mm256_setzero_si256());
    K_X8_ROWS_OF_X;
#pragma GCC unroll 8  // k a constant: the scales' byte shuffles and the shifts by k (rolled: 1.8x the time)
    for (size_t k = 0; k < 8; ++k) {  // sub-block k: low (k even) or high nibbles of chunks 8 (k / 2) ..
      const uint8_t *chunk = qs + 256 * (k / 2);
      if (!(k & 1))
        for (size_t line = 0; line < 256; line += 64) PREFETCH_KX8_AVX2(chunk + line);
      __m256i scale = byte_in_halves(sc[k / 4], (int)(k % 4));
      EIGHT(__m256i, s16, _mm256_setzero_si256());
#pragma GCC unroll 8
      for (size_t l = 0; l < 8; ++l) {
        __m256i v = load32(chunk + 32 * l);
        __m256i q = _mm256_and_si256(k & 1 ? _mm256_srli_epi16(v, 4) : v, low4);
        if (five) {  // bit k of qh's bytes to bit 4
          __m256i h = load32(qh + 32 * l);
          h = k < 4 ? _mm256_slli_epi16(h, (int)(4 - k)) : _mm256_srli_epi16(h, (int)(k - 4));
          q = _mm256_or_si256(q, _mm256_and_si256(h, bit4));
        }
#define ROW(i) K_X8_PAIR_SUMS(i, xr##i + 32 * k + 4 * l)
        ROWS_OF_X(ROW)
#undef ROW
        if (l == 7 || (five && l == 3)) {  // at most 8 * 2 * 15 * 127, or 4 * 2 * 31 * 127
#define ROW(i) K_X8_SCALED(i, scale)
          ROWS_OF_X(ROW)
#undef ROW
        }
      }
    }
    __m256 dv = halves8(d + 8 * s), mv = halves8(dmin + 8 * s);
    __m256i mk[8];  // each sub-block's mins, for x's two sums of 16
#pragma GCC unroll 8
    for (size_t k = 0; k < 8; ++k) mk[k] = byte_in_halves(mn[k / 4], (int)(k % 4));
#define ROW(i)                                                                                                   \
  if (i < MC) {                                                                                                  \
    __m256i mins = x8_sums_of_16(mk, ws->bs + i * (K / 16) + 16 * s);                                            \
    __m256 xd = _mm256_broadcast_ss(ws->xd + i * S + s);                                                         \
    acc##i = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si##i), _mm256_mul_ps(dv, xd), acc##i);                          \
    acc##i = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(mv, xd), acc##i);                          \
  }
    ROWS_OF_X(ROW)
#undef ROW
  }
  SUMS_ARRAY(__m256, acc);
  group_outputs(acc, MC, out);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Q4_KX8 and Q5_KX8 with AVX-512 VNNI, as q4_x8_zmm: one 64-byte load holds two chunks of the
// eight rows in pair lanes, and a sub-block's 32 values meet a row of x in four `vpdpbusd`; each
// sub-block's sums are multiplied by the rows' scales in 32 bits (at most 16 * 31 * 128 before,
// 63 times that after), and the mins meet x's sums of 16 in one `vpdpwssd` per two sub-blocks.
#define Q4K_X8_LOOP q4k_x8_zmm

// The K-quants' VNNI loops (q4k_x8_zmm, q6k_x8_zmm, q23k_x8_zmm) at one row of x fetch each line
// once, into L1 and further ahead than NEAR_AHEAD: they run through a group's weights faster than
// the two steps keep up with (decode bs1 of the K-quant mixtures); at more rows, in two steps.
#define ONE_ROW_AHEAD 3072
#define PREFETCH_K_X8(p)                                            \
  do {                                                              \
    if (MC == 1)                                                    \
      _mm_prefetch((const char *)(p) + ONE_ROW_AHEAD, _MM_HINT_T0); \
    else                                                            \
      PREFETCH_TWO_STEPS(p);                                        \
  } while (0)

// Pair lanes of the mins of sub-blocks 2j (even lanes) and 2j + 1 (odd lanes), each in both of the
// lane's 16-bit halves, from mn (pair_words of the rows' mins 4t .. 4t + 3, t = j / 2).
INLINE __m512i mins_in_pairs(__m512i mn, int j) {
  const int e = 2 * (j % 2), o = e + 1;  // the two sub-blocks' bytes in a lane
  return _mm512_shuffle_epi8(mn, _mm512_set4_epi32((int)(0x80008000u | (12 + o) << 16 | (12 + o)),
                                                   (int)(0x80008000u | (8 + e) << 16 | (8 + e)),
                                                   (int)(0x80008000u | (4 + o) << 16 | (4 + o)),
                                                   (int)(0x80008000u | e << 16 | e)));
}

INLINE void q4k_x8_zmm(const workspace *ws, int kind, const uint8_t *qs, const uint8_t *qh, const uint16_t *d,
                       const uint16_t *dmin, const uint8_t *scales, size_t MC, size_t K, float out[MAX_M][8]) {
  size_t S = K / 256;
  const int five = kind == Q5_KX8;
  const __m512i low4 = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16), byte = _mm512_set1_epi32(0xFF);
  EIGHT(__m512, acc, _mm512_setzero_ps());
  EIGHT(__m256, off, _mm256_setzero_ps());
  for (size_t s = 0; s < S; ++s, qs += 1024, qh += five ? 256 : 0, scales += 96) {
    __m256i sc[2], mn[2];
    k4_scales_x8(scales, sc, mn);
    const __m512i sc2[2] = {pair_words(sc[0]), pair_words(sc[1])}, mn2[2] = {pair_words(mn[0]), pair_words(mn[1])};
    EIGHT(__m512i, si, _mm512_setzero_si512());
    for (size_t c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high) of chunks 8c .. 8c + 7
      const uint8_t *chunk = qs + 256 * c;
      for (size_t line = 0; line < 256; line += 64) PREFETCH_K_X8(chunk + line);
      __m512i lo[4], hi[4];
      for (size_t j = 0; j < 4; ++j) {
        __m512i v = pair_chunks(_mm512_loadu_si512(chunk + 64 * j));
        lo[j] = _mm512_and_si512(v, low4);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if (five) {  // bits 2c and 2c + 1 of qh's bytes (its chunks 2j, 2j + 1 as qs's) to bit 4: a | (b & c)
          __m512i h = _mm512_srl_epi16(pair_chunks(_mm512_loadu_si512(qh + 64 * j)), _mm_cvtsi32_si128((int)(2 * c)));
          lo[j] = _mm512_ternarylogic_epi32(lo[j], _mm512_slli_epi16(h, 4), bit4, 0xF8);
          hi[j] = _mm512_ternarylogic_epi32(hi[j], _mm512_slli_epi16(h, 3), bit4, 0xF8);
        }
      }
      // the scales of sub-blocks 2c and 2c + 1: bytes 2 (c % 2) and 2 (c % 2) + 1 of the rows' words c / 2
      const __m512i words = _mm512_srlv_epi32(sc2[c / 2], _mm512_set1_epi32((int)(16 * (c % 2))));
      const __m512i scale_lo = _mm512_and_si512(words, byte), scale_hi = _mm512_and_si512(_mm512_srli_epi32(words, 8), byte);
#define ROW(i)                                                                                                 \
  if (i < MC) {                                                                                                \
    const int8_t *xq = ws->q + i * K + 256 * s + 64 * c; /* sub-block 2c, then 2c + 1 */                       \
    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], broadcast8(xq));                            \
    __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], broadcast8(xq + 32));                       \
    for (size_t j = 1; j < 4; ++j) {                                                                           \
      a = _mm512_dpbusd_epi32(a, lo[j], broadcast8(xq + 8 * j));                                               \
      b = _mm512_dpbusd_epi32(b, hi[j], broadcast8(xq + 32 + 8 * j));                                          \
    }                                                                                                          \
    si##i = _mm512_add_epi32(si##i, _mm512_add_epi32(_mm512_mullo_epi32(a, scale_lo), _mm512_mullo_epi32(b, scale_hi))); \
  }
      ROWS_OF_X(ROW)
#undef ROW
    }
    const __m512i mk[4] = {mins_in_pairs(mn2[0], 0), mins_in_pairs(mn2[0], 1), mins_in_pairs(mn2[1], 2),
                           mins_in_pairs(mn2[1], 3)};
    __m512 dv = pair_scales(halves8(d + 8 * s)), mv = pair_scales(halves8(dmin + 8 * s));
#define ROW(i)                                                                                                 \
  if (i < MC) {                                                                                                \
    const int8_t *bs = (const int8_t *)(ws->bs + i * (K / 16) + 16 * s); /* 4 sums of 16 per two sub-blocks */ \
    __m512i mins = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mk[0], broadcast8(bs));                         \
    for (size_t j = 1; j < 4; ++j) mins = _mm512_dpwssd_epi32(mins, mk[j], broadcast8(bs + 8 * j));            \
    __m512 xd = _mm512_set1_ps(ws->xd[i * S + s]);                                                             \
    acc##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si##i), _mm512_mul_ps(dv, xd), acc##i);                        \
    acc##i = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(mv, xd), acc##i);                        \
  }
    ROWS_OF_X(ROW)
#undef ROW
  }
  PAIR_OUTPUTS;
}
#else
#define Q4K_X8_LOOP q4k_x8
#endif

#define Q4K_X8_AT(MC) /* as Q4_X8_AT, a function for each type */                                            \
  NOINLINE void q4k_x8_##MC(const workspace *ws, int kind, const uint8_t *qs, const uint8_t *qh,              \
                            const uint16_t *d, const uint16_t *dmin, const uint8_t *scales, size_t K,         \
                            float out[MAX_M][8]) {                                                            \
    if (kind == Q5_KX8)                                                                                       \
      Q4K_X8_LOOP(ws, Q5_KX8, qs, qh, d, dmin, scales, MC, K, out);                                           \
    else                                                                                                      \
      Q4K_X8_LOOP(ws, Q4_KX8, qs, 0, d, dmin, scales, MC, K, out);                                            \
  }
FOR_EACH_ROW_COUNT(Q4K_X8_AT)

// Q6_K with rows interleaved eight at a time (Q6_KX8): per group of eight rows and super-block, ql
// is 32 chunks of 32 bytes (chunk m: bytes 4m .. 4m + 3 of the eight rows' 128), qh 16 chunks of
// the rows' 64 bytes, the scales 4 chunks of their 16 (lane r of chunk t: row r's scales 4t ..
// 4t + 3), and d the rows' values side by side. Value group g of 32 (half h = g / 4, k = g % 4;
// see dequant.py's _q6_k) lies in the low (k < 2) or high nibbles of ql's chunks 16h + 8 (k % 2)
// .. + 7, its top two bits in bits 2k and 2k + 1 of qh's chunks 8h .. 8h + 7. Values are biased by
// 32: x's sums of 16 times the scales take it off, per row of x and super-block.

// Each 16-bit half of each 32-bit lane of v's result: byte b of the lane, sign-extended.
INLINE __m256i sbyte_in_halves(__m256i v, int b) {
  const __m128i at = _mm_setr_epi8(-1, (char)b, -1, (char)b, -1, (char)(4 + b), -1, (char)(4 + b), -1, (char)(8 + b),
                                   -1, (char)(8 + b), -1, (char)(12 + b), -1, (char)(12 + b));
  return _mm256_srai_epi16(_mm256_shuffle_epi8(v, _mm256_setr_m128i(at, at)), 8);
}

// Bytes b and b + 1 of each 32-bit lane of v in its low and high 16 bits, sign-extended.
INLINE __m256i sbyte_pairs(__m256i v, int b) {
  const __m128i at = _mm_setr_epi8(-1, (char)b, -1, (char)(b + 1), -1, (char)(4 + b), -1, (char)(5 + b), -1,
                                   (char)(8 + b), -1, (char)(9 + b), -1, (char)(12 + b), -1, (char)(13 + b));
  return _mm256_srai_epi16(_mm256_shuffle_epi8(v, _mm256_setr_m128i(at, at)), 8);
}

// The AVX2 16-value sub-block loops' step (q6k_x8, q23k_x8): chunk l (of 4) of sub-block j of
// super-block s, its values q, into each row of x's 16-bit sums, those taken into 32 bits by the
// sub-block's scale every two chunks.
#define K16_X8_SUMS(i) K_X8_PAIR_SUMS(i, xr##i + 16 * j + 4 * l)
#define K16_X8_SCALED(i) K_X8_SCALED(i, scale)
#define K16_X8_STEP          \
  ROWS_OF_X(K16_X8_SUMS)     \
  if (l & 1) {               \
    ROWS_OF_X(K16_X8_SCALED) \
  }

// Rows 0..7 of a Q6_KX8 group times MC rows of x (quantized per 256 values in ws): out[i][r]. Per
// sub-block of 16 values and row of x, 4 `maddubs` and adds in 16 bits (at most 2 * 2 * 63 * 127
// before each `madd` by the scales), as q4k_x8.
INLINE void q6k_x8(const workspace *ws, const uint8_t *ql, const uint8_t *qh, const uint16_t *d,
                   const uint8_t *scales, size_t MC, size_t K, float out[MAX_M][8]) {
  size_t S = K / 256;
  const __m256i low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30);
  EIGHT(__m256, acc, _mm256_setzero_ps());
  for (size_t s = 0; s < S; ++s, ql += 1024, qh += 512, scales += 128) {
    const __m256i sc[4] = {load32(scales), load32(scales + 32), load32(scales + 64), load32(scales + 96)};
    EIGHT(__m256i, si, _mm256_setzero_si256());
    K_X8_ROWS_OF_X;
#pragma GCC unroll 16  // so that the shifts by k are constants
    for (size_t j = 0; j < 16; ++j) {  // sub-block j: the first or second half (j % 2) of value group j / 2
      const size_t g = j / 2, k = g % 4;
      const uint8_t *lq = ql + 512 * (g / 4) + 256 * (k % 2) + 128 * (j % 2), *hq = qh + 256 * (g / 4) + 128 * (j % 2);
      for (size_t line = 0; line < 128; line += 64) {
        if (k < 2) PREFETCH_KX8_AVX2(lq + line);  // ql's chunks serve k and k + 2
        if (k == 0) PREFETCH_KX8_AVX2(hq + line);
      }
      const __m256i scale = sbyte_in_halves(sc[j / 4], (int)(j % 4));
      EIGHT(__m256i, s16, _mm256_setzero_si256());
      for (size_t l = 0; l < 4; ++l) {
        __m256i v = load32(lq + 32 * l);
        __m256i q = _mm256_and_si256(k < 2 ? v : _mm256_srli_epi16(v, 4), low4);
        __m256i t = load32(hq + 32 * l);  // bits 2k, 2k + 1 to 4, 5
        __m256i top = k < 2 ? _mm256_slli_epi16(t, (int)(4 - 2 * k)) : _mm256_srli_epi16(t, (int)(2 * k - 4));
        q = _mm256_or_si256(q, _mm256_and_si256(top, top2));
        K16_X8_STEP
      }
    }
    __m256i sp[8];  // lane r: row r's scales of sub-blocks 2p and 2p + 1, for x's two sums of 16
    for (size_t p = 0; p < 8; ++p) sp[p] = sbyte_pairs(sc[p / 2], (int)(2 * (p % 2)));
    __m256 dv = halves8(d + 8 * s);
#define ROW(i)                                                                                                   \
  if (i < MC) {                                                                                                  \
    __m256i bias = x8_sums_of_16(sp, ws->bs + i * (K / 16) + 16 * s);                                            \
    __m256i total = _mm256_sub_epi32(si##i, _mm256_slli_epi32(bias, 5));                                         \
    acc##i = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dv, _mm256_broadcast_ss(ws->xd + i * S + s)), \
                             acc##i);                                                                            \
  }
    ROWS_OF_X(ROW)
#undef ROW
  }
  SUMS_ARRAY(__m256, acc);
  group_outputs(acc, MC, out);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Q6_KX8 with AVX-512 VNNI, as q4k_x8_zmm: a sub-block's 16 values meet a row of x in two
// `vpdpbusd`, its sums multiplied by the rows' (signed) scales in 32 bits, and x's sums of 16
// meet the scales in one `vpdpwssd` per four sub-blocks.
#define Q6K_X8_LOOP q6k_x8_zmm

// Byte b of each 32-bit lane of v, sign-extended.
INLINE __m512i sbyte_of_words(__m512i v, int b) {
  return _mm512_srai_epi32(_mm512_sllv_epi32(v, _mm512_set1_epi32(24 - 8 * b)), 24);
}

// From the pair lanes of the rows' scales 4t .. 4t + 3: even lanes scales 4t and 4t + 1, odd lanes
// 4t + 2 and 4t + 3, each sign-extended to 16 bits (for x's sums of 16 broadcast8 lays out so).
INLINE __m512i scale_pairs(__m512i v) {
  const __m512i at = _mm512_set4_epi32((int)0x0F800E80, (int)0x09800880, (int)0x07800680, (int)0x01800080);
  return _mm512_srai_epi16(_mm512_shuffle_epi8(v, at), 8);
}

// The VNNI 16-value sub-block loops' step for row i of x (q6k_x8_zmm, q23k_x8_zmm): value group g
// of super-block s, its values w[4] in pair lanes (w[0], w[1]: sub-block 2g; w[2], w[3]: 2g + 1),
// times x into 32-bit sums, those times the rows' scales of the two sub-blocks into si_i.
#define K16_X8_ZMM_ROW(i)                                                                                      \
  if (i < MC) {                                                                                                \
    const int8_t *xq = ws->q + i * K + 256 * s + 32 * g;                                                       \
    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], broadcast8(xq));                             \
    __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2], broadcast8(xq + 16));                        \
    a = _mm512_dpbusd_epi32(a, w[1], broadcast8(xq + 8));                                                      \
    b = _mm512_dpbusd_epi32(b, w[3], broadcast8(xq + 24));                                                     \
    si##i = _mm512_add_epi32(si##i, _mm512_add_epi32(_mm512_mullo_epi32(a, scale_a), _mm512_mullo_epi32(b, scale_b))); \
  }

INLINE void q6k_x8_zmm(const workspace *ws, const uint8_t *ql, const uint8_t *qh, const uint16_t *d,
                       const uint8_t *scales, size_t MC, size_t K, float out[MAX_M][8]) {
  size_t S = K / 256;
  const __m512i low4 = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30);
  EIGHT(__m512, acc, _mm512_setzero_ps());
  EIGHT(__m256, off, _mm256_setzero_ps());
  for (size_t s = 0; s < S; ++s, ql += 1024, qh += 512, scales += 128) {
    const __m512i sc[4] = {pair_words(load32(scales)), pair_words(load32(scales + 32)),
                           pair_words(load32(scales + 64)), pair_words(load32(scales + 96))};
    EIGHT(__m512i, si, _mm512_setzero_si512());
    for (size_t h = 0; h < 2; ++h) {  // each half's qh and ql chunks are loaded once, for its four value groups
      __m512i top[4];
      for (size_t line = 0; line < 256; line += 64) PREFETCH_K_X8(qh + 256 * h + line);
      for (size_t j = 0; j < 4; ++j) top[j] = pair_chunks(_mm512_loadu_si512(qh + 256 * h + 64 * j));
      for (size_t odd = 0; odd < 2; ++odd) {  // value groups 4h + odd (low nibbles) and 4h + odd + 2 (high)
        const uint8_t *lq = ql + 512 * h + 256 * odd;
        for (size_t line = 0; line < 256; line += 64) PREFETCH_K_X8(lq + line);
        __m512i v[4];
        for (size_t j = 0; j < 4; ++j) v[j] = pair_chunks(_mm512_loadu_si512(lq + 64 * j));
#pragma GCC unroll 2
        for (size_t k = odd; k < 4; k += 2) {  // so that the shifts by k are constants
          const size_t g = 4 * h + k;
          __m512i w[4];
          for (size_t j = 0; j < 4; ++j) {  // v's nibbles | bits 2k, 2k + 1 of top at bits 4, 5
            __m512i t = k < 2 ? _mm512_slli_epi16(top[j], (int)(4 - 2 * k)) : _mm512_srli_epi16(top[j], (int)(2 * k - 4));
            w[j] = _mm512_ternarylogic_epi32(_mm512_and_si512(k < 2 ? v[j] : _mm512_srli_epi16(v[j], 4), low4), t,
                                             top2, 0xF8);
          }
          const __m512i scale_a = sbyte_of_words(sc[g / 2], (int)(2 * (g % 2)));
          const __m512i scale_b = sbyte_of_words(sc[g / 2], (int)(2 * (g % 2) + 1));
          ROWS_OF_X(K16_X8_ZMM_ROW)
        }
      }
    }
    const __m512i sp[4] = {scale_pairs(sc[0]), scale_pairs(sc[1]), scale_pairs(sc[2]), scale_pairs(sc[3])};
    __m512 dv = pair_scales(halves8(d + 8 * s));
#define ROW(i)                                                                                                 \
  if (i < MC) {                                                                                                \
    const int8_t *bs = (const int8_t *)(ws->bs + i * (K / 16) + 16 * s); /* 4 sums of 16 per 4 sub-blocks */   \
    __m512i bias = _mm512_dpwssd_epi32(_mm512_setzero_si512(), sp[0], broadcast8(bs));                         \
    for (size_t t = 1; t < 4; ++t) bias = _mm512_dpwssd_epi32(bias, sp[t], broadcast8(bs + 8 * t));            \
    __m512i total = _mm512_sub_epi32(si##i, _mm512_slli_epi32(bias, 5));                                       \
    acc##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dv, _mm512_set1_ps(ws->xd[i * S + s])), acc##i); \
  }
    ROWS_OF_X(ROW)
#undef ROW
  }
  PAIR_OUTPUTS;
}
#else
#define Q6K_X8_LOOP q6k_x8
#endif

#define Q6K_X8_AT(MC) /* as Q4_X8_AT */                                                                        \
  NOINLINE void q6k_x8_##MC(const workspace *ws, const uint8_t *ql, const uint8_t *qh, const uint16_t *d,     \
                            const uint8_t *scales, size_t K, float out[MAX_M][8]) {                           \
    Q6K_X8_LOOP(ws, ql, qh, d, scales, MC, K, out);                                                           \
  }
FOR_EACH_ROW_COUNT(Q6K_X8_AT)

// Q2_K and Q3_K with rows interleaved eight at a time (Q2_KX8, Q3_KX8): per group of eight rows and
// super-block, qs is 16 chunks of 32 bytes (chunk c: bytes 4c .. 4c + 3 of the eight rows' 64, so
// chunks 8h .. 8h + 7 hold half h's bytes l = 0..31, whose bits 2k, 2k + 1 are value 128 h + 32 k +
// l: see q23k_row), Q3_K's hmask 8 chunks (bit 4h + k of byte l: that value's third bit), the
// scales 3 (Q3_K) or 4 (Q2_K) chunks, and d (Q2_K's dmin) the rows' values side by side. Value
// group g = 4h + k is sub-blocks 2g and 2g + 1 as Q6_K's value group g is, so the loops are
// q6k_x8's with these values: Q3_K's 0..7 less 4 (x's sums of 16 times the scales, times 4), Q2_K's
// 0..3 less the mins (x's sums times the mins, times dmin).

// The eight rows' sixteen scales of a super-block: lane r of sc[t] holds row r's scales 4t ..
// 4t + 3 as signed bytes (Q3_K: k3_scales of each row; Q2_K: its bytes' low nibbles), of mn[t]
// Q2_K's mins (the high nibbles).
INLINE void k23_scales_x8(int kind, const uint8_t *scales, __m256i sc[4], __m256i mn[4]) {
  const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3);
  if (kind == Q2_KX8) {
    for (size_t t = 0; t < 4; ++t) {
      __m256i b = load32(scales + 32 * t);
      sc[t] = _mm256_and_si256(b, low4);
      mn[t] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    }
    return;
  }
  __m256i u0 = load32(scales), u1 = load32(scales + 32), u2 = load32(scales + 64);
  for (size_t t = 0; t < 4; ++t) {  // the low 4 bits from u0 or u1, the top 2 from u2, as k3_scales
    __m256i low = _mm256_and_si256(t & 2 ? _mm256_srli_epi16(t & 1 ? u1 : u0, 4) : t & 1 ? u1 : u0, low4);
    __m256i top = _mm256_and_si256(_mm256_srli_epi16(u2, (int)(2 * t)), low2);
    sc[t] = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
    mn[t] = _mm256_setzero_si256();
  }
}

// Rows 0..7 of a Q2_KX8 or Q3_KX8 group times MC rows of x (quantized per 256 values in ws):
// out[i][r]. Per sub-block of 16 values and row of x, 4 `maddubs` and adds in 16 bits (at most
// 2 * 2 * 7 * 127 before each `madd` by the scales), as q6k_x8.
INLINE void q23k_x8(const workspace *ws, int kind, const uint8_t *qs, const uint8_t *hmask, const uint16_t *d,
                    const uint16_t *dmin, const uint8_t *scales, size_t MC, size_t K, float out[MAX_M][8]) {
  size_t S = K / 256;
  const int three = kind == Q3_KX8;
  const __m256i low2 = _mm256_set1_epi8(3), third = _mm256_set1_epi8(4);
  EIGHT(__m256, acc, _mm256_setzero_ps());
  for (size_t s = 0; s < S; ++s, qs += 512, hmask += three ? 256 : 0, scales += three ? 96 : 128) {
    __m256i sc[4], mn[4];
    k23_scales_x8(kind, scales, sc, mn);
    EIGHT(__m256i, si, _mm256_setzero_si256());
    K_X8_ROWS_OF_X;
#pragma GCC unroll 16  // so that the shifts by k are constants
    for (size_t j = 0; j < 16; ++j) {  // sub-block j: the first or second half (j % 2) of value group j / 2
      const size_t g = j / 2, h = g / 4, k = g % 4;
      const uint8_t *lq = qs + 256 * h + 128 * (j % 2), *hq = hmask + 128 * (j % 2);
      for (size_t line = 0; line < 128; line += 64) {
        if (k == 0) PREFETCH_KX8_AVX2(lq + line);  // qs's chunks serve the half's four value groups
        if (three && g == 0) PREFETCH_KX8_AVX2(hq + line);
      }
      const __m256i scale = sbyte_in_halves(sc[j / 4], (int)(j % 4));
      EIGHT(__m256i, s16, _mm256_setzero_si256());
      for (size_t l = 0; l < 4; ++l) {
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(load32(lq + 32 * l), (int)(2 * k)), low2);
        if (three) {  // bit 4h + k of hmask's bytes to bit 2
          const int bit = (int)(4 * h + k);
          __m256i t = load32(hq + 32 * l);
          t = bit >= 2 ? _mm256_srli_epi16(t, bit - 2) : _mm256_slli_epi16(t, 2 - bit);
          q = _mm256_or_si256(q, _mm256_and_si256(t, third));
        }
        K16_X8_STEP
      }
    }
    __m256i sp[8];  // lane r: row r's scales (Q2_K: mins) of sub-blocks 2p and 2p + 1, for x's two sums of 16
    for (size_t p = 0; p < 8; ++p) sp[p] = sbyte_pairs(three ? sc[p / 2] : mn[p / 2], (int)(2 * (p % 2)));
    __m256 dv = halves8(d + 8 * s), mv = three ? _mm256_setzero_ps() : halves8(dmin + 8 * s);
#define ROW(i)                                                                                                   \
  if (i < MC) {                                                                                                  \
    __m256i sums = x8_sums_of_16(sp, ws->bs + i * (K / 16) + 16 * s);                                            \
    __m256 xd = _mm256_broadcast_ss(ws->xd + i * S + s);                                                         \
    if (three) si##i = _mm256_sub_epi32(si##i, _mm256_slli_epi32(sums, 2));                                      \
    acc##i = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si##i), _mm256_mul_ps(dv, xd), acc##i);                          \
    if (!three) acc##i = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(mv, xd), acc##i);              \
  }
    ROWS_OF_X(ROW)
#undef ROW
  }
  SUMS_ARRAY(__m256, acc);
  group_outputs(acc, MC, out);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Q2_KX8 and Q3_KX8 with AVX-512 VNNI, as q6k_x8_zmm: a half's qs (and Q3_K's hmask) are loaded
// once for its four value groups, a sub-block's 16 values meet a row of x in two `vpdpbusd`.
#define Q23K_X8_LOOP q23k_x8_zmm

INLINE void q23k_x8_zmm(const workspace *ws, int kind, const uint8_t *qs, const uint8_t *hmask, const uint16_t *d,
                        const uint16_t *dmin, const uint8_t *scales, size_t MC, size_t K, float out[MAX_M][8]) {
  size_t S = K / 256;
  const int three = kind == Q3_KX8;
  const __m512i low2 = _mm512_set1_epi8(3), third = _mm512_set1_epi8(4);
  EIGHT(__m512, acc, _mm512_setzero_ps());
  EIGHT(__m256, off, _mm256_setzero_ps());
  for (size_t s = 0; s < S; ++s, qs += 512, hmask += three ? 256 : 0, scales += three ? 96 : 128) {
    __m256i sc8[4], mn8[4];
    k23_scales_x8(kind, scales, sc8, mn8);
    const __m512i sc[4] = {pair_words(sc8[0]), pair_words(sc8[1]), pair_words(sc8[2]), pair_words(sc8[3])};
    EIGHT(__m512i, si, _mm512_setzero_si512());
    __m512i top[4];
    if (three) {
      for (size_t line = 0; line < 256; line += 64) PREFETCH_K_X8(hmask + line);
      for (size_t j = 0; j < 4; ++j) top[j] = pair_chunks(_mm512_loadu_si512(hmask + 64 * j));
    }
    for (size_t h = 0; h < 2; ++h) {
      const uint8_t *lq = qs + 256 * h;
      for (size_t line = 0; line < 256; line += 64) PREFETCH_K_X8(lq + line);
      __m512i v[4];
      for (size_t j = 0; j < 4; ++j) v[j] = pair_chunks(_mm512_loadu_si512(lq + 64 * j));
#pragma GCC unroll 4
      for (size_t k = 0; k < 4; ++k) {  // so that the shifts by k are constants
        const size_t g = 4 * h + k;
        const int bit = (int)g;  // Q3_K: bit 4h + k of hmask's bytes to bit 2: a | (b & c)
        __m512i w[4];
        for (size_t j = 0; j < 4; ++j) {
          w[j] = _mm512_and_si512(_mm512_srli_epi16(v[j], (int)(2 * k)), low2);
          if (three)
            w[j] = _mm512_ternarylogic_epi32(
                w[j], bit >= 2 ? _mm512_srli_epi16(top[j], bit - 2) : _mm512_slli_epi16(top[j], 2 - bit), third, 0xF8);
        }
        const __m512i scale_a = sbyte_of_words(sc[g / 2], (int)(2 * (g % 2)));
        const __m512i scale_b = sbyte_of_words(sc[g / 2], (int)(2 * (g % 2) + 1));
        ROWS_OF_X(K16_X8_ZMM_ROW)
      }
    }
    __m512i sp[4];  // scale_pairs of the scales (Q3_K) or of the mins (Q2_K), for x's sums of 16
    for (size_t t = 0; t < 4; ++t) sp[t] = scale_pairs(pair_words(three ? sc8[t] : mn8[t]));
    __m512 dv = pair_scales(halves8(d + 8 * s)), mv = three ? _mm512_setzero_ps() : pair_scales(halves8(dmin + 8 * s));
#define ROW(i)                                                                                                 \
  if (i < MC) {                                                                                                \
    const int8_t *bs = (const int8_t *)(ws->bs + i * (K / 16) + 16 * s); /* 4 sums of 16 per 4 sub-blocks */   \
    __m512i sums = _mm512_dpwssd_epi32(_mm512_setzero_si512(), sp[0], broadcast8(bs));                         \
    for (size_t t = 1; t < 4; ++t) sums = _mm512_dpwssd_epi32(sums, sp[t], broadcast8(bs + 8 * t));            \
    __m512 xd = _mm512_set1_ps(ws->xd[i * S + s]);                                                             \
    if (three) si##i = _mm512_sub_epi32(si##i, _mm512_slli_epi32(sums, 2));                                    \
    acc##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si##i), _mm512_mul_ps(dv, xd), acc##i);                        \
    if (!three) acc##i = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(mv, xd), acc##i);            \
  }
    ROWS_OF_X(ROW)
#undef ROW
  }
  PAIR_OUTPUTS;
}
#else
#define Q23K_X8_LOOP q23k_x8
#endif

#define Q23K_X8_AT(MC) /* as Q4K_X8_AT */                                                                      \
  NOINLINE void q23k_x8_##MC(const workspace *ws, int kind, const uint8_t *qs, const uint8_t *hmask,          \
                             const uint16_t *d, const uint16_t *dmin, const uint8_t *scales, size_t K,         \
                             float out[MAX_M][8]) {                                                            \
    if (kind == Q3_KX8)                                                                                        \
      Q23K_X8_LOOP(ws, Q3_KX8, qs, hmask, d, 0, scales, MC, K, out);                                           \
    else                                                                                                       \
      Q23K_X8_LOOP(ws, Q2_KX8, qs, 0, d, dmin, scales, MC, K, out);                                            \
  }
FOR_EACH_ROW_COUNT(Q23K_X8_AT)

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// The K-quants a row at a time with AVX-512 VNNI (q4k_row's, q6k_row's and q23k_row's sums): a
// super-block's values are unpacked 64 at a time (k_values_zmm), and per 64 values and row of x
// a `maddubs` gives 16-bit pair sums and one `vpdpwssd` multiplies them by their scales (of 16
// values, or of 32 for Q4_K and Q5_K) into 32 bits and adds them: two instructions where the
// AVX2 loops take six, so several rows of x (batches, prefill) stay bound by memory longer
// (docs/performance.md).

// Values 64v .. 64v + 63 of a super-block (v = 0..3) as unsigned bytes (see q4k_row, q6k_row and
// q23k_row for where they lie). Q4_K and Q5_K: blocks 2v (the low 32 bytes) and 2v + 1, the low
// and high nibbles of qs[32v ..], Q5_K's fifth bits from qh; the others: of half h = v / 2, its
// groups of 32 g = 2 (v % 2) (the low 32 bytes) and g + 1, Q6_K from ql (64 bytes a half) and qh
// (32), Q3_K from qs (32 a half) and hmask, Q2_K from qs.
INLINE __m512i k_values_zmm(int kind, const uint8_t *q, const uint8_t *high, int v) {
  const int h = v / 2, odd = v % 2;
  if (kind == Q4_K || kind == Q5_K) {
    const __m512i nib = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m512i lo = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load32(q + 32 * v)), nib),
                                  _mm512_set1_epi8(15));
    if (kind == Q4_K) return lo;
    // bits 2v (low 32 bytes) and 2v + 1 of qh[l] to bit 4
    const __m512i qh = _mm512_broadcast_i64x4(load32(high));
    const int b = 2 * v;
    __m512i t = b < 4 ? _mm512_sllv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16((short)(4 - b)),
                                                                 _mm256_set1_epi16((short)(3 - b)), 1))
                      : _mm512_srlv_epi16(qh, _mm512_inserti64x4(_mm512_set1_epi16((short)(b - 4)),
                                                                 _mm256_set1_epi16((short)(b - 3)), 1));
    return _mm512_or_si512(lo, _mm512_and_si512(t, _mm512_set1_epi8(16)));
  }
  if (kind == Q6_K) {  // low nibbles of ql's 64 bytes (v even) or high; qh bits 2g, 2g + 1 to bits 4, 5
    __m512i l = _mm512_loadu_si512((const void *)(q + 64 * h));
    __m512i lo = _mm512_and_si512(odd ? _mm512_srli_epi16(l, 4) : l, _mm512_set1_epi8(15));
    __m512i hb = _mm512_broadcast_i64x4(load32(high + 32 * h));
    hb = odd ? _mm512_srlv_epi16(hb, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1))
             : _mm512_sllv_epi16(hb, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1));
    return _mm512_or_si512(lo, _mm512_and_si512(hb, _mm512_set1_epi8(0x30)));
  }
  // bits 2g, 2g + 1 of qs[32 h + l] (each byte's own: masked after the shift)
  const __m512i qb = _mm512_broadcast_i64x4(load32(q + 32 * h));
  const __m512i by =
      _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * odd)), _mm256_set1_epi16((short)(4 * odd + 2)), 1);
  __m512i q2 = _mm512_and_si512(_mm512_srlv_epi16(qb, by), _mm512_set1_epi8(3));
  if (kind == Q2_K) return q2;
  // Q3_K: bit 4h + g of hmask[l] to bit 2
  const int b0 = 4 * h + 2 * odd;
  const __m512i hm = _mm512_broadcast_i64x4(load32(high));
  __m512i t = b0 >= 2 ? _mm512_srlv_epi16(hm, _mm512_inserti64x4(_mm512_set1_epi16((short)(b0 - 2)),
                                                                 _mm256_set1_epi16((short)(b0 - 1)), 1))
                      : _mm512_sllv_epi16(hm, _mm512_inserti64x4(_mm512_set1_epi16(2), _mm256_set1_epi16(1), 1));
  return _mm512_or_si512(q2, _mm512_and_si512(t, _mm512_set1_epi8(4)));
}

// One K-quant row (planes as k_row passes them) times MC rows of x into out.
INLINE void k_row_zmm(int kind, const workspace *ws, const uint8_t *q, const uint16_t *d, const uint16_t *dmin,
                      const uint8_t *high, const uint8_t *scales, size_t MC, size_t K, float *out) {
  size_t S = K / 256;
  const int k4 = kind == Q4_K || kind == Q5_K;  // scales and mins of 32 values
  const size_t q_step = kind == Q6_K || k4 ? 128 : 64, scale_step = kind == Q3_K || k4 ? 12 : 16;
  const size_t high_step = kind == Q6_K ? 64 : kind == Q3_K || kind == Q5_K ? 32 : 0;
  __m512 acc[MC];
  for (size_t i = 0; i < MC; ++i) acc[i] = _mm512_setzero_ps();
  for (size_t s = 0; s < S; ++s, q += q_step, high += high_step, scales += scale_step) {
    PREFETCH_LINE(q);
    if (q_step == 128) PREFETCH_LINE(q + 64);
    if (high_step && (high_step == 64 || !(s & 1))) PREFETCH_LINE(high);
    // the 16 scales (signed; Q4_K's and Q5_K's 8, each in two lanes), Q2_K's (Q4_K's, Q5_K's) mins,
    // as 16-bit lanes: scale and min j for values 16j .. 16j + 15
    __m128i sc8, mn8 = _mm_setzero_si128();
    if (k4) {
      uint32_t u[3];
      __builtin_memcpy(u, scales, 12);
      const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x30303030;
      __m128i sc = _mm_setr_epi32((int)(u[0] & low6), (int)((u[2] & low4) | ((u[0] >> 2) & top2)), 0, 0);
      __m128i mn = _mm_setr_epi32((int)(u[1] & low6), (int)(((u[2] >> 4) & low4) | ((u[1] >> 2) & top2)), 0, 0);
      sc8 = _mm_unpacklo_epi8(sc, sc), mn8 = _mm_unpacklo_epi8(mn, mn);  // as k4_scales
    } else if (kind == Q3_K) {
      sc8 = k3_scales(scales);
    } else {
      sc8 = _mm_loadu_si128((const __m128i *)scales);
      if (kind == Q2_K) {
        mn8 = _mm_and_si128(_mm_srli_epi16(sc8, 4), _mm_set1_epi8(15));
        sc8 = _mm_and_si128(sc8, _mm_set1_epi8(15));
      }
    }
    const __m256i sc = _mm256_cvtepi8_epi16(sc8), mn = _mm256_cvtepu8_epi16(mn8);  // Q2_K's: 0..15
    __m512i sum[MC];
    __m256i mins[MC];
    for (size_t i = 0; i < MC; ++i) {
      __m256i bs = load32(ws->bs + i * (K / 16) + 16 * s);
      // Q6_K's -32 and Q3_K's -4 of every value; Q2_K's mins apart (scaled by dmin)
      __m256i offset = kind == Q2_K || k4 ? _mm256_setzero_si256()
                                          : _mm256_slli_epi32(_mm256_madd_epi16(sc, bs), kind == Q6_K ? 5 : 2);
      sum[i] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), offset));
      mins[i] = kind == Q2_K || k4 ? _mm256_madd_epi16(mn, bs) : _mm256_setzero_si256();
    }
    const __m512i sc_both = _mm512_broadcast_i64x4(sc);  // 16-bit lane j: scale j % 16
    for (int v = 0; v < 4; ++v) {
      const __m512i w = k_values_zmm(kind, q, high, v);
      // 16-bit lane t of the pair sums (values 2t, 2t + 1) takes scale 4v + t / 8
      const __m512i sc32 = _mm512_permutexvar_epi16(
          _mm512_add_epi16(_mm512_set1_epi16((short)(4 * v)),
                           _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18,
                                                              17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                              1, 0), 3)),
          sc_both);
      for (size_t i = 0; i < MC; ++i) {  // |maddubs| <= 2 * 63 * 127: no saturation
        __m512i xb = _mm512_loadu_si512((const void *)(ws->q + i * K + 256 * s + 64 * v));
        sum[i] = _mm512_dpwssd_epi32(sum[i], _mm512_maddubs_epi16(w, xb), sc32);
      }
    }
    float ds = half(d[s]);
    for (size_t i = 0; i < MC; ++i) {
      float xd = ws->xd[i * S + s];
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]), _mm512_set1_ps(ds * xd), acc[i]);
      if (kind == Q2_K || k4)
        acc[i] = _mm512_fnmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(mins[i])),
                                  _mm512_set1_ps(half(dmin[s]) * xd), acc[i]);
    }
  }
  for (size_t i = 0; i < MC; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif

// Row n of a K-quant w times MC rows of x into out.
INLINE void k_row(int kind, const workspace *ws, const matrix *w, size_t n, size_t MC, size_t K, float *out) {
  size_t S = K / 256;
  // row n's planes: its values, high bits (Q3_K's hmask, Q5_K's and Q6_K's qh), scales and mins
  const int k4 = kind == Q4_K || kind == Q5_K;
  const uint8_t *q = (const uint8_t *)w->qs + n * (kind == Q3_K || kind == Q2_K ? K / 4 : K / 2);
  const uint8_t *high = kind == Q3_K || kind == Q5_K ? w->h + n * (K / 8) : kind == Q6_K ? w->h + n * (K / 4) : 0;
  const uint8_t *scales = w->s + n * S * (k4 || kind == Q3_K ? 12 : 16);
  const uint16_t *d = w->d + n * S, *dmin = k4 || kind == Q2_K ? w->m + n * S : 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  k_row_zmm(kind, ws, q, d, dmin, high, scales, MC, K, out);
#else
  if (k4)
    q4k_row(kind, ws, q, d, dmin, scales, high, MC, K, out);
  else if (kind == Q6_K)
    q6k_row(ws, q, d, high, (const int8_t *)scales, MC, K, out);
  else
    q23k_row(kind, ws, q, d, dmin, high, scales, MC, K, out);
#endif
}

// Row wn of float16 (bf16 0) or bfloat16 weights times rows [0, mc) of x into column c of out.
INLINE void f16_rows(const int bf16, const float *x, const uint16_t *wn, size_t mc, size_t K, float out[MAX_M][8],
                     size_t c) {
  float column[MAX_M];
#define ROW(MC) ((MC) == 1 ? f16_row : F16_ROWS)(bf16, x, wn, MC, K, column)
  FOR_CONSTANT_MC(mc, ROW)
#undef ROW
  for (size_t i = 0; i < mc; ++i) out[i][c] = column[i];
}

// Rows n .. n + 7 of matrix w with interleaved rows (X8_KIND), else row n, times
// rows [m0, m0 + mc) of x (quantized in ws unless F16) into out[0, mc)[r].
INLINE void some_rows(int kind, workspace *ws, const float *x, const matrix *w, size_t n, size_t mc, size_t K,
                      float out[MAX_M][8]) {
  size_t B = K / 32;
  float column[MAX_M];  // one row of w's outputs
#if SHARKPORT_PRODUCTS
#if SHARKPORT_PRODUCTS == 1
  read_rows(kind, w, n, X8_KIND(kind) ? 8 : 1, mc, K);
#endif
  for (size_t i = 0; i < mc; ++i)
    for (size_t r = 0; r < 8; ++r) out[i][r] = 0.0f;
  return;
#endif
  if (FLOAT_WEIGHTS(kind)) {
    f16_rows(kind == BF16, x, (const uint16_t *)w->qs + n * K, mc, K, out, 0);
    return;
  }
  if (K4_X8_KIND(kind)) {  // the group's planes start where row n's would
    size_t S = K / 256;
#define ROW(MC) AT_ROWS(q4k_x8, MC)(ws, kind, (const uint8_t *)w->qs + n * (K / 2), w->h ? w->h + n * (K / 8) : 0, \
                                     w->d + n * S, w->m + n * S, w->s + n * S * 12, K, out)
    FOR_CONSTANT_MC(mc, ROW)
#undef ROW
    return;
  }
  if (kind == Q6_KX8) {
    size_t S = K / 256;
#define ROW(MC) AT_ROWS(q6k_x8, MC)(ws, (const uint8_t *)w->qs + n * (K / 2), w->h + n * (K / 4), w->d + n * S, \
                                     w->s + n * S * 16, K, out)
    FOR_CONSTANT_MC(mc, ROW)
#undef ROW
    return;
  }
  if (K23_X8_KIND(kind)) {
    size_t S = K / 256;
#define ROW(MC) AT_ROWS(q23k_x8, MC)(ws, kind, (const uint8_t *)w->qs + n * (K / 4), w->h ? w->h + n * (K / 8) : 0, \
                                      w->d + n * S, w->m ? w->m + n * S : 0, w->s + n * S * (kind == Q3_KX8 ? 12 : 16), \
                                      K, out)
    FOR_CONSTANT_MC(mc, ROW)
#undef ROW
    return;
  }
  if (X_PER_256(kind)) {  // a K-quant a row at a time
#define ROW(MC) k_row(kind, ws, w, n, MC, K, column)
    FOR_CONSTANT_MC(mc, ROW)
#undef ROW
    for (size_t i = 0; i < mc; ++i) out[i][0] = column[i];
    return;
  }
  // (interleaved: the group's planes from n) IQ4_XS's d and its scales' top bits (m) per 256
  // values, their low bits (qh) 4 bytes per 256; Q5's fifth bits 4 bytes a block
  const size_t per_d = IQ4_XS_KIND(kind) ? K / 256 : B;
  const uint8_t *qn = (const uint8_t *)w->qs + n * qs_row_bytes(kind, K);
  const uint16_t *d = w->d + n * per_d, *m = w->m ? w->m + n * per_d : 0;
  const uint8_t *qh = IQ4_XS_KIND(kind) ? w->s + n * (K / 64) : w->h ? w->h + n * B * 4 : 0;
  if (kind == Q8_0X8) {
#define ROW(MC) AT_ROWS(q8_x8, MC)(ws, (const int8_t *)qn, d, K, out)
    FOR_CONSTANT_MC(mc, ROW)
#undef ROW
    return;
  }
  if (Q4_X8_KIND(kind)) {
#define ROW(MC) AT_ROWS(q4_x8, MC)(ws, kind, qn, d, m, qh, K, out)
    FOR_CONSTANT_MC(mc, ROW)
#undef ROW
    return;
  }
  if (IQ4_X8_KIND(kind)) {
#define ROW(MC) AT_ROWS(iq4_x8, MC)(ws, kind, qn, d, m, qh, K, out)
    FOR_CONSTANT_MC(mc, ROW)
#undef ROW
    return;
  }
#define ROW(MC) q_row(ws, kind, qn, d, m, qh, MC, K, column)
  FOR_CONSTANT_MC(mc, ROW)
#undef ROW
  for (size_t i = 0; i < mc; ++i) out[i][0] = column[i];
}

// Rows x [M, K] (K a multiple of 8) RMS-normalized by weight g [K] into xn, as sharkport.ops.rms_norm:
// x * (1 / sqrt(sum(x^2) / K + eps)) * g. The squares add in four chains.
static void rms_norm_rows(const float *x, const float *g, float eps, size_t M, size_t K, float *xn) {
  for (size_t i = 0; i < M; ++i, x += K, xn += K) {
    __m256 sq[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    size_t k = 0;
    for (; k + 32 <= K; k += 32)
      for (size_t u = 0; u < 4; ++u) {
        __m256 v = _mm256_loadu_ps(x + k + 8 * u);
        sq[u] = _mm256_fmadd_ps(v, v, sq[u]);
      }
    for (; k < K; k += 8) {
      __m256 v = _mm256_loadu_ps(x + k);
      sq[0] = _mm256_fmadd_ps(v, v, sq[0]);
    }
    float mean = hsum(_mm256_add_ps(_mm256_add_ps(sq[0], sq[1]), _mm256_add_ps(sq[2], sq[3]))) / (float)K;
    __m256 r = _mm256_set1_ps(_mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.0f), _mm_sqrt_ss(_mm_set_ss(mean + eps)))));
    for (k = 0; k < K; k += 8)
      _mm256_storeu_ps(xn + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), r), _mm256_loadu_ps(g + k)));
  }
}

// Rows [m0, m0 + mc) of x [M, K] prepared in ws for the products of weights of `kind`: where g is
// not null, RMS-normalized by it into ws->xn (a row at a time, as each is quantized; float
// weights' mc rows at once, mc K <= XN_FLOATS); then, unless the weights are floats, quantized in
// blocks of 256 for the K-quants, else of 32 (and paired, for Q4 and Q5). Returns the rows as
// the float products read them: in ws->xn, or in x.
INLINE const float *prepare_x(int kind, const float *x, const float *g, float eps, size_t K, size_t m0, size_t mc,
                              workspace *ws) {
  x += m0 * K;
  if (FLOAT_WEIGHTS(kind)) {
    if (!g) return x;
    rms_norm_rows(x, g, eps, mc, K, ws->xn);
    return ws->xn;
  }
  for (size_t i = 0, rows = g ? 1 : mc; i < mc; i += rows) {  // normalized: a row at a time
    const float *xi = x + i * K;
    if (g) rms_norm_rows(xi, g, eps, 1, K, ws->xn), xi = ws->xn;
    if (X_PER_256(kind))
      quantize_x_k(xi, rows, K, ws->q + i * K, ws->xd + i * (K / 256), ws->bs + i * (K / 16));
    else
      quantize_x(xi, rows, K, ws->q + i * K, ws->xd + i * (K / 32), ws->xs + i * (K / 32));
  }
  if (kind == Q4_0 || kind == Q4_1 || kind == Q5_0 || kind == Q5_1) pair_blocks(ws->q, mc, K);
  return x;
}

// y[at] = the product's output v, plus the residual r[at] where r is not null.
INLINE void put(float *y, const float *r, size_t at, float v) { y[at] = r ? r[at] + v : v; }

// Outputs [n0, n1) of the product of rows [m0, m0 + mc) of x [M, K] (prepared in ws by
// prepare_x, which returned those rows as x) with the `count` matrices w. CONCAT: N outputs, the
// rows of the matrices one after the other, and y the products [M, w[j].n] one after the other
// (so that each is a contiguous tensor); SWIGLU: N = w[0].n and y [M, N]. Interleaved weights go
// eight rows at a time: each matrix's rows, and so n0, are a multiple of 8. With a residual r
// (CONCAT, laid out as y), y = r + product.
INLINE void product_rows(int kind, int op, workspace *ws, const float *x, const matrix *w, size_t count,
                         const float *r, float *y, size_t M, size_t N, size_t K, size_t m0, size_t mc, size_t n0,
                         size_t n1) {
  // rows of w at a time
  const size_t group = X8_KIND(kind) ? 8 : 1;
  const int pairs = FLOAT_WEIGHTS(kind) && F16_PAIRS(mc);  // float rows of w two at a time (f16_pairs)
  size_t j = 0, first = 0;  // the matrix holding output n, its first output
  for (size_t n = n0, step; n < n1; n += step) {
    while (op == CONCAT && j + 1 < count && n >= first + w[j].n) first += w[j++].n;
    const uint16_t *f16 = FLOAT_WEIGHTS(kind) ? (const uint16_t *)w[j].qs + (n - first) * K : 0;  // row n's weights
    float out[MAX_M][8];
    step = group;
    if (op == SWIGLU) {
      float up[MAX_M][8];
      if (FLOAT_WEIGHTS(kind) && !SHARKPORT_PRODUCTS) {
        // Up to eight outputs, so that their silu goes at once (swiglu8; a silu at a time weighs
        // on gate/up at several rows of x).
        step = n1 - n < 8 ? n1 - n : 8;
        for (size_t c = 0; c < step; ++c) {
          const uint16_t *gate = f16 + c * K, *upw = (const uint16_t *)w[1].qs + (n + c) * K;
          if (pairs) {  // the gate's row and the up projection's together
            f16_pairs(kind == BF16, x, gate, upw, mc, K, out[0] + c, up[0] + c);
          } else {
            f16_rows(kind == BF16, x, gate, mc, K, out, c);
            f16_rows(kind == BF16, x, upw, mc, K, up, c);
          }
        }
      } else {
        some_rows(kind, ws, x, &w[0], n, mc, K, out);
        some_rows(kind, ws, x, &w[1], n, mc, K, up);
      }
      for (size_t i = 0; i < mc; ++i) {
        float *yi = y + (m0 + i) * N + n;
        if (step == 8)  // eight outputs at once
          _mm256_storeu_ps(yi, swiglu8(_mm256_loadu_ps(out[i]), _mm256_loadu_ps(up[i])));
        else
          for (size_t c = 0; c < step; ++c) yi[c] = silu(out[i][c]) * up[i][c];
      }
      continue;
    }
    const size_t end = n1 < first + w[j].n ? n1 : first + w[j].n, h = (end - n) / 2;  // of matrix j
    if (pairs && h) {
      // Matrix j's rows [n, end) two at a time, n + p with n + h + p: so each row of a pair walks
      // forward through the weights as one row at a time would (pairing rows n + p and n + p + 1
      // instead reads them from memory slower than one row at a time).
      for (size_t p = 0; p < h; ++p) {
        f16_pairs(kind == BF16, x, f16 + p * K, f16 + (h + p) * K, mc, K, out[0], out[0] + 1);
        for (size_t i = 0; i < mc; ++i) {
          size_t at = first * M + (m0 + i) * w[j].n + n - first + p;
          put(y, r, at, out[i][0]);
          put(y, r, at + h, out[i][1]);
        }
      }
      step = 2 * h;  // an odd row left over goes on its own
      continue;
    }
    some_rows(kind, ws, x, &w[j], n - first, mc, K, out);
    for (size_t i = 0; i < mc; ++i)
      for (size_t c = 0; c < group; ++c) {
        put(y, r, first * M + (m0 + i) * w[j].n + n - first + c, out[i][c]);
      }
  }
}

// Rows of x the products take at a time from m0: F16 up to MAX_M (normalized: as many as ws->xn
// holds), else as many as ws holds quantized (chunk_rows).
INLINE size_t x_rows(int kind, const float *g, size_t M, size_t m0, size_t K) {
  if (!FLOAT_WEIGHTS(kind)) return chunk_rows(M, m0, K);
  size_t left = M - m0, most = g && XN_FLOATS / K < MAX_M ? XN_FLOATS / K : MAX_M;
  return left < most ? left : most;
}

// ws with its quantized rows of x from row i on (as prepare_x lays them out for `kind`).
INLINE workspace rows_from(workspace ws, int kind, size_t K, size_t i) {
  ws.q += i * K, ws.xd += i * (X_PER_256(kind) ? K / 256 : K / 32), ws.xs += i * (K / 32), ws.bs += i * (K / 16);
  return ws;
}

// Bytes of the dispatch's scratch each workgroup takes for R rows of x of length K (and
// kernels.mlir's product_module allots): q R K bytes, xd and xs R K / 32 floats each, cs
// MAX_M K / 32 floats and bs R K / 16 int16, rounded up to 64.
INLINE size_t scratch_bytes(size_t K, size_t R) { return (K * (11 * R + 8) / 8 + 63) / 64 * 64; }

// ws's quantized rows of x and cs in `own`, a workgroup's scratch_bytes(K, R) (from a multiple of
// 64 bytes into the scratch, so x's rows start on cache lines as on the stack).
INLINE workspace in_scratch(workspace ws, int8_t *own, size_t K, size_t R) {
  const size_t B = K / 32;
  float *f = (float *)(own + R * K);
  ws.q = own, ws.xd = f, ws.xs = f + R * B, ws.cs = f + 2 * R * B, ws.bs = (int16_t *)(f + (2 * R + MAX_M) * B);
  return ws;
}

// Outputs [n0, n1) of the product of all of x [M, K] (normalized by g where not null) with the
// `count` matrices w (see product_rows). With R = 0, x is prepared on the stack x_rows at a time
// and each chunk multiplies all of [n0, n1): the weights are read once per chunk, and the stack
// holds XQ_BYTES of quantized x (5 rows of K = 3072, 2 of 8192). Otherwise ws is in the dispatch's
// scratch and holds R rows, which a pass over the weights takes: a tile of rows of w (about
// PASS_TILE_BYTES, a multiple of 8 rows) against all R rows of x, MAX_M at a time, so that each
// pass reads the weights once from memory, the tile from L2 and those rows of x from L1.
#define PASS_TILE_BYTES (256 << 10)
INLINE void product_all_rows(int kind, int op, workspace *ws, const float *x, const float *g, float eps,
                             const matrix *w, size_t count, const float *r, float *y, size_t M, size_t N, size_t K,
                             size_t R, size_t n0, size_t n1) {
  for (size_t p0 = 0, pc; p0 < M; p0 += pc) {
    pc = !R ? x_rows(kind, g, M, p0, K) : M - p0 < R ? M - p0 : R;
    const float *xm = x;
    for (size_t i = 0, c; i < pc; i += c) {  // as many rows at a time as prepare_x takes
      c = R ? chunk_rows(pc, i, K) : pc;
      workspace at = rows_from(*ws, kind, K, i);
      xm = prepare_x(kind, x, g, eps, K, p0 + i, c, &at);
    }
    const size_t tile = !R ? n1 - n0 : PASS_TILE_BYTES / K < 8 ? 8 : PASS_TILE_BYTES / K / 8 * 8;
    for (size_t n = n0; n < n1; n += tile)
      for (size_t i = 0, c; i < pc; i += c) {
        c = pc - i < MAX_M ? pc - i : MAX_M;
        workspace at = rows_from(*ws, kind, K, i);
        product_rows(kind, op, &at, xm, w, count, r, y, M, N, K, p0 + i, c, n, n + tile < n1 ? n + tile : n1);
      }
  }
}

// Outputs [n0, n1) of workgroup wg (`rows` per workgroup) of the product of x [M, K] with the
// `count` matrices w (see product_rows). With a norm weight g [K] (not null), x is first
// RMS-normalized by it (each workgroup normalizes the rows it takes, K <= XN_FLOATS). So a layer's
// norms and residual adds take no dispatch of their own. With R > 0, quantized weights take x R
// rows at a time in the dispatch's scratch (product_all_rows), scratch_bytes(K, R) a workgroup.
INLINE void matvec(int kind, int op, const float *x, const float *g, float eps, const matrix *w, size_t count,
                   const float *r, float *y, size_t M, size_t N, size_t K, size_t rows, size_t wg, int8_t *scratch,
                   size_t R) {
  ROW_RANGE
  if (K / 32 > MAX_BLOCKS || (g && K > XN_FLOATS)) return;  // never traced: kernels routes only these
  stack_space space;
  workspace ws = on_stack(&space);
  if (FLOAT_WEIGHTS(kind)) R = 0;
  if (R) ws = in_scratch(ws, scratch + wg * scratch_bytes(K, R), K, R);
  product_all_rows(kind, op, &ws, x, g, eps, w, count, r, y, M, N, K, R, n0, n1);
}

// The C functions, each with its planes in kernels.PLANES order (forms in kernels.ops.FORMS):
// sharkport_matvec_<type>: y = x w^T; ..._add_<type>: y = r + x w^T; ..._norm_<type>: y = n(x) w^T,
// n(x) x RMS-normalized by weight g; ..._qkv_<type>: x times three matrices, the products one
// after the other; ..._qkv_norm_<type>: n(x) so; ..._swiglu_<type>: silu(x a^T) * (x b^T);
// ..._swiglu_norm_<type>: n(x) so. A norm's weight g follows x, its eps comes last.
#define ARGS_Q8_0(p) MEMREF(const int8_t, p##qs), MEMREF(const uint16_t, p##d)
#define ARGS_Q4_0(p) MEMREF(const uint8_t, p##qs), MEMREF(const uint16_t, p##d)
#define ARGS_Q4_1(p) MEMREF(const uint8_t, p##qs), MEMREF(const uint16_t, p##d), MEMREF(const uint16_t, p##m)
#define ARGS_F16(p) MEMREF(const uint16_t, p##qs)
#define MAT_Q8_0(p, rows) {BASE(p##qs), BASE(p##d), 0, rows}
#define MAT_Q4_0(p, rows) {BASE(p##qs), BASE(p##d), 0, rows}
#define MAT_Q4_1(p, rows) {BASE(p##qs), BASE(p##d), BASE(p##m), rows}
#define ARGS_Q8_0X8 ARGS_Q8_0
#define MAT_Q8_0X8 MAT_Q8_0
#define ARGS_Q4_0X8 ARGS_Q4_0
#define ARGS_Q4_1X8 ARGS_Q4_1
#define MAT_Q4_0X8 MAT_Q4_0
#define MAT_Q4_1X8 MAT_Q4_1
#define MAT_F16(p, rows) {BASE(p##qs), 0, 0, rows}
#define ARGS_Q5_0(p) MEMREF(const uint8_t, p##qs), MEMREF(const uint16_t, p##d), MEMREF(const uint8_t, p##qh)
#define MAT_Q5_0(p, rows) {BASE(p##qs), BASE(p##d), 0, rows, BASE(p##qh), 0}
#define ARGS_Q5_0X8 ARGS_Q5_0
#define MAT_Q5_0X8 MAT_Q5_0
#define ARGS_Q4_K(p)                                                                     \
  MEMREF(const uint8_t, p##qs), MEMREF(const uint16_t, p##d), MEMREF(const uint16_t, p##dmin), \
      MEMREF(const uint8_t, p##sc)
#define MAT_Q4_K(p, rows) {BASE(p##qs), BASE(p##d), BASE(p##dmin), rows, 0, BASE(p##sc)}
#define ARGS_Q4_KX8 ARGS_Q4_K
#define MAT_Q4_KX8 MAT_Q4_K
#define ARGS_Q5_K(p) ARGS_Q4_K(p), MEMREF(const uint8_t, p##qh)
#define MAT_Q5_K(p, rows) {BASE(p##qs), BASE(p##d), BASE(p##dmin), rows, BASE(p##qh), BASE(p##sc)}
#define ARGS_Q6_K(p)                                                                 \
  MEMREF(const uint8_t, p##ql), MEMREF(const uint16_t, p##d), MEMREF(const uint8_t, p##qh), \
      MEMREF(const uint8_t, p##sc)
#define MAT_Q6_K(p, rows) {BASE(p##ql), BASE(p##d), 0, rows, BASE(p##qh), BASE(p##sc)}
#define ARGS_Q3_K(p) \
  MEMREF(const uint8_t, p##qs), MEMREF(const uint16_t, p##d), MEMREF(const uint8_t, p##hm), MEMREF(const uint8_t, p##sc)
#define MAT_Q3_K(p, rows) {BASE(p##qs), BASE(p##d), 0, rows, BASE(p##hm), BASE(p##sc)}
#define ARGS_Q2_K ARGS_Q4_K
#define MAT_Q2_K MAT_Q4_K
#define ARGS_Q5_1(p) ARGS_Q4_1(p), MEMREF(const uint8_t, p##qh)
#define MAT_Q5_1(p, rows) {BASE(p##qs), BASE(p##d), BASE(p##m), rows, BASE(p##qh), 0}
#define ARGS_Q5_KX8 ARGS_Q5_K
#define MAT_Q5_KX8 MAT_Q5_K
#define ARGS_Q6_KX8 ARGS_Q6_K
#define MAT_Q6_KX8 MAT_Q6_K
#define ARGS_Q5_1X8 ARGS_Q5_1
#define MAT_Q5_1X8 MAT_Q5_1
#define ARGS_BF16 ARGS_F16
#define MAT_BF16 MAT_F16
#define ARGS_IQ4_NL ARGS_Q4_0
#define MAT_IQ4_NL MAT_Q4_0
#define ARGS_IQ4_NLX8 ARGS_Q4_0
#define MAT_IQ4_NLX8 MAT_Q4_0
#define ARGS_IQ4_XS(p) \
  MEMREF(const uint8_t, p##qs), MEMREF(const uint16_t, p##d), MEMREF(const uint16_t, p##sh), MEMREF(const uint8_t, p##sl)
#define MAT_IQ4_XS(p, rows) {BASE(p##qs), BASE(p##d), BASE(p##sh), rows, 0, BASE(p##sl)}  // scales_h as m, scales_l as s
#define ARGS_IQ4_XSX8 ARGS_IQ4_XS
#define MAT_IQ4_XSX8 MAT_IQ4_XS
#define ARGS_Q2_KX8 ARGS_Q2_K
#define MAT_Q2_KX8 MAT_Q2_K
#define ARGS_Q3_KX8 ARGS_Q3_K
#define MAT_Q3_KX8 MAT_Q3_K
#define X_ARG MEMREF(const float, x)
#define NORM_ARG MEMREF(const float, g)
#define N_ARGS size_t M, size_t N, size_t K, size_t rows, size_t wg
#define QKV_N_ARGS size_t M, size_t N0, size_t N1, size_t N2, size_t K, size_t rows, size_t wg
#define UNPAREN(...) __VA_ARGS__
// Each form twice: `name`, the product inlined with its form's constants (decode's products, whose
// time is the weights' read, ran slower sharing one function), and name_scratch, which takes the
// dispatch's scratch after y and R (rows of x a pass over the weights takes, see matvec) after the
// sizes and calls `shared`, a type's function for its op.
#define TWINS(name, params, sizes, tail, T, op, shared, ...)                                               \
  void name(UNPAREN params, UNPAREN sizes UNPAREN tail) { matvec(T, op, __VA_ARGS__, 0, 0); }              \
  void name##_scratch(UNPAREN params, MEMREF(int8_t, t), UNPAREN sizes, size_t R UNPAREN tail) {          \
    shared(__VA_ARGS__, BASE(t), R);                                                                       \
  }
#define PRODUCT_PARAMS                                                                                     \
  const float *x, const float *g, float eps, const matrix *w, size_t count, const float *r, float *y,      \
      size_t M, size_t N, size_t K, size_t rows, size_t wg, int8_t *scratch, size_t R
#define PRODUCT_ARGS x, g, eps, w, count, r, y, M, N, K, rows, wg, scratch, R
#define DEFINE_KERNELS(T, lower)                                                                                 \
  NOINLINE void concat_##lower(PRODUCT_PARAMS) { matvec(T, CONCAT, PRODUCT_ARGS); }                              \
  NOINLINE void swiglu_##lower(PRODUCT_PARAMS) { matvec(T, SWIGLU, PRODUCT_ARGS); }                              \
  TWINS(sharkport_matvec_##lower, (X_ARG, ARGS_##T(a), MEMREF(float, y)), (N_ARGS), (), T, CONCAT,               \
        concat_##lower, BASE(x), 0, 0, (matrix[]){MAT_##T(a, N)}, 1, 0, BASE(y), M, N, K, rows, wg)              \
  TWINS(sharkport_matvec_add_##lower, (X_ARG, ARGS_##T(a), MEMREF(const float, r), MEMREF(float, y)),            \
        (N_ARGS), (), T, CONCAT, concat_##lower, BASE(x), 0, 0, (matrix[]){MAT_##T(a, N)}, 1, BASE(r),           \
        BASE(y), M, N, K, rows, wg)                                                                              \
  TWINS(sharkport_matvec_norm_##lower, (X_ARG, NORM_ARG, ARGS_##T(a), MEMREF(float, y)), (N_ARGS),               \
        (, float eps), T, CONCAT, concat_##lower, BASE(x), BASE(g), eps, (matrix[]){MAT_##T(a, N)}, 1, 0,        \
        BASE(y), M, N, K, rows, wg)                                                                              \
  TWINS(sharkport_matvec_qkv_##lower, (X_ARG, ARGS_##T(a), ARGS_##T(b), ARGS_##T(c), MEMREF(float, y)),          \
        (QKV_N_ARGS), (), T, CONCAT, concat_##lower, BASE(x), 0, 0,                                              \
        (matrix[]){MAT_##T(a, N0), MAT_##T(b, N1), MAT_##T(c, N2)}, 3, 0, BASE(y), M, N0 + N1 + N2, K, rows, wg) \
  TWINS(sharkport_matvec_qkv_norm_##lower,                                                                       \
        (X_ARG, NORM_ARG, ARGS_##T(a), ARGS_##T(b), ARGS_##T(c), MEMREF(float, y)), (QKV_N_ARGS),                \
        (, float eps), T, CONCAT, concat_##lower, BASE(x), BASE(g), eps,                                         \
        (matrix[]){MAT_##T(a, N0), MAT_##T(b, N1), MAT_##T(c, N2)}, 3, 0, BASE(y), M, N0 + N1 + N2, K, rows, wg) \
  TWINS(sharkport_matvec_swiglu_##lower, (X_ARG, ARGS_##T(a), ARGS_##T(b), MEMREF(float, y)), (N_ARGS), (),      \
        T, SWIGLU, swiglu_##lower, BASE(x), 0, 0, (matrix[]){MAT_##T(a, N), MAT_##T(b, N)}, 2, 0, BASE(y), M, N, \
        K, rows, wg)                                                                                             \
  TWINS(sharkport_matvec_swiglu_norm_##lower,                                                                    \
        (X_ARG, NORM_ARG, ARGS_##T(a), ARGS_##T(b), MEMREF(float, y)), (N_ARGS), (, float eps), T, SWIGLU,       \
        swiglu_##lower, BASE(x), BASE(g), eps, (matrix[]){MAT_##T(a, N), MAT_##T(b, N)}, 2, 0, BASE(y), M, N,    \
        K, rows, wg)

#if IN_PART(0)
DEFINE_KERNELS(Q8_0, q8_0)
DEFINE_KERNELS(Q4_0, q4_0)
DEFINE_KERNELS(Q4_1, q4_1)
DEFINE_KERNELS(Q4_0X8, q4_0x8)
DEFINE_KERNELS(Q4_1X8, q4_1x8)
DEFINE_KERNELS(Q8_0X8, q8_0x8)
DEFINE_KERNELS(F16, f16)
DEFINE_KERNELS(Q5_0, q5_0)
DEFINE_KERNELS(Q5_0X8, q5_0x8)
#endif
#if IN_PART(1)
DEFINE_KERNELS(Q4_K, q4_k)
DEFINE_KERNELS(Q4_KX8, q4_kx8)
DEFINE_KERNELS(Q5_K, q5_k)
DEFINE_KERNELS(Q6_K, q6_k)
DEFINE_KERNELS(BF16, bf16)
DEFINE_KERNELS(Q3_K, q3_k)
DEFINE_KERNELS(Q2_K, q2_k)
#endif
#if IN_PART(2)
DEFINE_KERNELS(Q5_1, q5_1)
DEFINE_KERNELS(Q5_1X8, q5_1x8)
DEFINE_KERNELS(Q5_KX8, q5_kx8)
DEFINE_KERNELS(Q6_KX8, q6_kx8)
DEFINE_KERNELS(IQ4_NL, iq4_nl)
DEFINE_KERNELS(IQ4_NLX8, iq4_nlx8)
DEFINE_KERNELS(IQ4_XS, iq4_xs)
DEFINE_KERNELS(IQ4_XSX8, iq4_xsx8)
DEFINE_KERNELS(Q2_KX8, q2_kx8)
DEFINE_KERNELS(Q3_KX8, q3_kx8)
#endif
#undef X_ARG
#undef NORM_ARG
#undef N_ARGS
#undef QKV_N_ARGS
#undef TWINS
#undef PRODUCT_PARAMS
#undef PRODUCT_ARGS

// ---- Decode attention over the paged KV cache ----
//
// One new position per sequence: sharkport_decode_attention rotates its k and writes k and v
// into the cache (in place), then attends with its rotated query to the positions [0, len) of its
// pages, in one dispatch (the write takes no dispatch of its own).
// The cache is sharkport.layers.PagedCache's flat [pages, L, 2 (K, V), stride, Hkv, D], of float32
// (sharkport_decode_attention) or float16 (sharkport_decode_attention_f16: half the bytes to read;
// written rounded to nearest even as torch's .half(), read exactly).
// Its workgroups take a sequence and one or more of its kv heads (all of them when there are
// enough sequences for the CPUs), each with its G query heads, so that K and V are read once; a
// workgroup writes the new slots of its kv heads before it reads them, and no other workgroup
// touches them. It walks the sequence a page at a time with a running softmax (scores of a page,
// their max, the earlier sums rescaled), in float32 throughout. The functions below take `f16`
// (whether the cache is float16) as a constant: each exported function inlines them for its
// element type.

// Eight cache values from element i of base, as float32.
INLINE __m256 load8(const int f16, const void *base, size_t i) {
  return f16 ? halves8((const uint16_t *)base + i) : _mm256_loadu_ps((const float *)base + i);
}

// Rotary embedding of one head x [D] over its first R dims by angles (c, s) [R / 2]: pairs
// (2i, 2i + 1) when interleaved (GGUF), else (i, i + R / 2) (HF); as sharkport.ops.apply_rope.
INLINE void rope(float *out, const float *x, const float *c, const float *s, size_t D, size_t R,
                 int interleaved) {
  for (size_t d = 0; d < D; ++d) out[d] = x[d];
  for (size_t i = 0; i < R / 2; ++i) {
    size_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + R / 2;
    out[a] = x[a] * c[i] - x[b] * s[i];
    out[b] = x[b] * c[i] + x[a] * s[i];
  }
}

// Sequence b's k and v [B, Hkv D] of kv head g at the new position (k before rotary) into its
// page's slot of cache; pages [B, blocks]; starts [B] (the new positions); layer [2]: the cache
// layer, then the layer count; rcos and rsin [B, R / 2] (unread when R is 0).
INLINE void kv_write(const int f16, const float *knew, const float *vnew, void *cache, const int64_t *pages,
                     const int64_t *starts, const int64_t *layer, const float *rcos, const float *rsin,
                     size_t blocks, size_t Hkv, size_t D, size_t L, size_t stride, size_t R, size_t interleaved,
                     size_t b, size_t g) {
  size_t pos = (size_t)starts[b], l = (size_t)layer[0];
  size_t slot_elems = Hkv * D, kv_elems = stride * slot_elems;
  size_t page = (size_t)pages[b * blocks + pos / stride];
  size_t at = (page * L + l) * 2 * kv_elems + (pos % stride) * slot_elems + g * D;  // k's first element
  float k[MAX_GD];
  rope(k, knew + (b * Hkv + g) * D, rcos + b * (R / 2), rsin + b * (R / 2), D, R, (int)interleaved);
  const float *v = vnew + (b * Hkv + g) * D;
  for (size_t d = 0; d < D; ++d) {
    if (f16) {
      ((uint16_t *)cache)[at + d] = _cvtss_sh(k[d], _MM_FROUND_TO_NEAREST_INT);
      ((uint16_t *)cache)[at + kv_elems + d] = _cvtss_sh(v[d], _MM_FROUND_TO_NEAREST_INT);
    } else {
      ((float *)cache)[at + d] = k[d];
      ((float *)cache)[at + kv_elems + d] = v[d];
    }
  }
}

#ifdef __AVX512F__
// Where the object is built for AVX-512 (kernels.isa()), page_scores and page_values take 16
// values of d at a time when D allows: half the multiply-adds and float16 conversions, which is
// faster in the caches; from memory (what decode sees) the reads bound it.
INLINE __m512 load16(const int f16, const void *base, size_t i) {  // as load8
  return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)))
             : _mm512_loadu_ps((const float *)base + i);
}
#define FOLD16(a) _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1))  // lanes i, i + 8 added
#endif

// Eight sums, a_i's lanes holding parts of sum i, in one vector times sc: two rounds of hadd leave
// in lane i of each 128-bit half a part of a_i's sum (u0: i < 4, u1: i >= 4); adding the halves
// completes them.
INLINE __m256 gather8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7,
                      __m256 sc) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  return _mm256_mul_ps(s, sc);
}

// Scores of one page's positions [0, n) for query head qh [D]: p[j] = scale * (qh . k[j]), k[j]
// at k + j * slot. Eight positions at a time in eight independent multiply-add chains, whose sums
// horizontal adds gather into one vector (rather than an `hsum` each).
INLINE void page_scores(const int f16, const float *qh, const void *k, size_t slot, size_t n, size_t D, float scale,
                        float *p) {
  const __m256 sc = _mm256_set1_ps(scale);
  // a_i += qd times K's vector at d of position j + i (kj: position j's first element), one width
#define SCORES8(FMA, LOAD)                                                                              \
  a0 = FMA(qd, LOAD(f16, k, kj + d), a0), a1 = FMA(qd, LOAD(f16, k, kj + slot + d), a1);                \
  a2 = FMA(qd, LOAD(f16, k, kj + 2 * slot + d), a2), a3 = FMA(qd, LOAD(f16, k, kj + 3 * slot + d), a3); \
  a4 = FMA(qd, LOAD(f16, k, kj + 4 * slot + d), a4), a5 = FMA(qd, LOAD(f16, k, kj + 5 * slot + d), a5); \
  a6 = FMA(qd, LOAD(f16, k, kj + 6 * slot + d), a6), a7 = FMA(qd, LOAD(f16, k, kj + 7 * slot + d), a7)
  size_t j = 0;
#ifdef __AVX512F__
  if (D % 16 == 0)
    for (; j + 8 <= n; j += 8) {
      size_t kj = j * slot;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (size_t d = 0; d < D; d += 16) {
        __m512 qd = _mm512_loadu_ps(qh + d);
        SCORES8(_mm512_fmadd_ps, load16);
      }
      _mm256_storeu_ps(p + j, gather8(FOLD16(a0), FOLD16(a1), FOLD16(a2), FOLD16(a3), FOLD16(a4), FOLD16(a5),
                                      FOLD16(a6), FOLD16(a7), sc));
    }
#endif
  for (; j + 8 <= n; j += 8) {
    size_t kj = j * slot;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (size_t d = 0; d < D; d += 8) {
      __m256 qd = _mm256_loadu_ps(qh + d);
      SCORES8(_mm256_fmadd_ps, load8);
    }
    _mm256_storeu_ps(p + j, gather8(a0, a1, a2, a3, a4, a5, a6, a7, sc));
  }
  for (; j < n; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (size_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(f16, k, j * slot + d), a);
    p[j] = hsum(a) * scale;
  }
#undef SCORES8
}

// A page's K and V come from memory (a step's weights evict them between layers): while a
// workgroup walks one page, it prefetches into L2 its rows of the next page (its kv heads' `seg`
// bytes of each position's row; the whole page when it takes every kv head), K's then V's,
// `per_position` lines for each position its query heads pass over, so that all of them are
// asked for along the way.
typedef struct {
  const char *row;   // the segment of the row the next line is in (K's rows, then V's)
  size_t off, seg;   // the next line's offset in it, the segment's bytes
  size_t slot, left; // bytes from a row to the next, rows left (of K, then of V)
  const char *v;     // V's first row, until the walk gets there (0: no next page, or on V)
  size_t rows, per_position;
} next_page;

INLINE void prefetch_next_page(next_page *pf) {
  for (size_t i = 0; i < pf->per_position && pf->left; ++i) {
    _mm_prefetch(pf->row + pf->off, _MM_HINT_T1);
    if ((pf->off += 64) < pf->seg) continue;
    pf->off = 0, pf->row += pf->slot;
    if (!--pf->left && pf->v) pf->row = pf->v, pf->v = 0, pf->left = pf->rows;
  }
}

// ah [D] = ah * rescale + sum over j < n of p[j] v[j] (v[j] at v + j * slot): 64 values of d at a
// time in eight registers (eight independent chains), then 8. With AVX-512, the 64 values are four
// registers, and even and odd positions go to chains of their own (eight again), added at the end.
INLINE void page_values(const int f16, float *ah, const float *p, const void *v, size_t slot, size_t n, size_t D,
                        float rescale, next_page *pf) {
  const __m256 r = _mm256_set1_ps(rescale);
  size_t d = 0;
#ifdef __AVX512F__
  for (; d + 64 <= D; d += 64) {
    __m512 a[4], b[4];  // even positions, odd ones
    for (int i = 0; i < 4; ++i)
      a[i] = _mm512_mul_ps(_mm512_loadu_ps(ah + d + 16 * i), _mm512_set1_ps(rescale)), b[i] = _mm512_setzero_ps();
    size_t j = 0;
    for (; j + 2 <= n; j += 2) {
      prefetch_next_page(pf);
      prefetch_next_page(pf);
      __m512 pj = _mm512_set1_ps(p[j]), pk = _mm512_set1_ps(p[j + 1]);
      size_t vj = j * slot + d;
      for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(pj, load16(f16, v, vj + 16 * i), a[i]);
      for (int i = 0; i < 4; ++i) b[i] = _mm512_fmadd_ps(pk, load16(f16, v, vj + slot + 16 * i), b[i]);
    }
    if (j < n) {
      prefetch_next_page(pf);
      __m512 pj = _mm512_set1_ps(p[j]);
      for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(pj, load16(f16, v, j * slot + d + 16 * i), a[i]);
    }
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(ah + d + 16 * i, _mm512_add_ps(a[i], b[i]));
  }
#endif
  for (; d + 64 <= D; d += 64) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(ah + d + 8 * i), r);
    for (size_t j = 0; j < n; ++j) {
      prefetch_next_page(pf);
      __m256 pj = _mm256_broadcast_ss(p + j);
      size_t vj = j * slot + d;
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(pj, load8(f16, v, vj + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(ah + d + 8 * i, a[i]);
  }
  for (; d < D; d += 8) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(ah + d), r);
    for (size_t j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), load8(f16, v, j * slot + d), a);
    _mm256_storeu_ps(ah + d, a);
  }
}

#ifdef __AVX512F__
// Where HG query heads (2 or 3) share a kv head, their scores and their sums over V go together:
// each vector of K and of V is loaded (and widened from float16) once for all of them.
// Scores of positions [0, n) of the page for heads q [HG, D] into p [HG][MAX_STRIDE]; D % 16 == 0.
INLINE void group_scores(const int f16, const size_t HG, const float *q, size_t D, const void *k, size_t slot,
                         size_t n, float scale, float (*p)[MAX_STRIDE]) {
  const __m256 sc = _mm256_set1_ps(scale);
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m512 a[3][8];
    for (size_t h = 0; h < HG; ++h)
      for (int i = 0; i < 8; ++i) a[h][i] = _mm512_setzero_ps();
    for (size_t d = 0; d < D; d += 16) {
      __m512 qd[3];
      for (size_t h = 0; h < HG; ++h) qd[h] = _mm512_loadu_ps(q + h * D + d);
      for (int i = 0; i < 8; ++i) {
        __m512 kv = load16(f16, k, (j + i) * slot + d);
        for (size_t h = 0; h < HG; ++h) a[h][i] = _mm512_fmadd_ps(qd[h], kv, a[h][i]);
      }
    }
    for (size_t h = 0; h < HG; ++h)
      _mm256_storeu_ps(p[h] + j, gather8(FOLD16(a[h][0]), FOLD16(a[h][1]), FOLD16(a[h][2]), FOLD16(a[h][3]),
                                         FOLD16(a[h][4]), FOLD16(a[h][5]), FOLD16(a[h][6]), FOLD16(a[h][7]), sc));
  }
  for (; j < n; ++j)  // as page_scores
    for (size_t h = 0; h < HG; ++h) {
      __m256 a = _mm256_setzero_ps();
      for (size_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), load8(f16, k, j * slot + d), a);
      p[h][j] = hsum(a) * scale;
    }
}

// acc [HG, D] = acc * rescale[h] + sum over j < n of p[h][j] v[j], as page_values for each head
// (its sums in the same order: even and odd positions apart); D % 64 == 0. Fetches ahead HG
// times a position, as page_values once a head and position.
INLINE void group_values(const int f16, const size_t HG, float *acc, size_t D, float (*p)[MAX_STRIDE],
                         const void *v, size_t slot, size_t n, const float *rescale, next_page *pf) {
  for (size_t d = 0; d + 64 <= D; d += 64) {
    __m512 a[3][4], b[3][4];  // even positions, odd ones
    for (size_t h = 0; h < HG; ++h)
      for (int i = 0; i < 4; ++i)
        a[h][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + d + 16 * i), _mm512_set1_ps(rescale[h])),
        b[h][i] = _mm512_setzero_ps();
    size_t j = 0;
    for (; j + 2 <= n; j += 2) {
      for (size_t h = 0; h < 2 * HG; ++h) prefetch_next_page(pf);
      for (int i = 0; i < 4; ++i) {
        __m512 ve = load16(f16, v, j * slot + d + 16 * i), vo = load16(f16, v, (j + 1) * slot + d + 16 * i);
        for (size_t h = 0; h < HG; ++h)
          a[h][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][j]), ve, a[h][i]),
          b[h][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][j + 1]), vo, b[h][i]);
      }
    }
    if (j < n) {
      for (size_t h = 0; h < HG; ++h) prefetch_next_page(pf);
      for (int i = 0; i < 4; ++i) {
        __m512 ve = load16(f16, v, j * slot + d + 16 * i);
        for (size_t h = 0; h < HG; ++h) a[h][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][j]), ve, a[h][i]);
      }
    }
    for (size_t h = 0; h < HG; ++h)
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + h * D + d + 16 * i, _mm512_add_ps(a[h][i], b[h][i]));
  }
}
#endif

// Head h's running softmax over one page's scores p [n]: its max and sum updated, p replaced by
// exp(p - max); returns the factor for the earlier sums.
INLINE float page_softmax(float *p, size_t n, float *run_max, float *run_sum) {
  __m256 mx = _mm256_set1_ps(-__builtin_inff());
  size_t j = 0;
  for (; j + 8 <= n; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(p + j));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float page_max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (; j < n; ++j) page_max = p[j] > page_max ? p[j] : page_max;
  float m = page_max > *run_max ? page_max : *run_max;
  float rescale = exp_scalar(*run_max - m);  // 0 on the first page (exp(-inf) clamps to ~0)
  *run_max = m;
  __m256 mv = _mm256_set1_ps(m), total = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; j < n; ++j) sum += p[j] = exp_scalar(p[j] - m);
  *run_sum = *run_sum * rescale + sum;
  return rescale;
}

#ifdef __AVX512F__
// One page for hg (2 or 3) query heads of one kv head, together: q [hg, D], their acc [hg, D],
// running maxima and sums; D % 64 == 0.
INLINE void group_page(const int f16, size_t hg, const float *q, float *acc, float *run_max, float *run_sum,
                       const void *k, const void *v, size_t slot, size_t n, size_t D, float scale,
                       float (*ps)[MAX_STRIDE], next_page *pf) {
  float rescale[3];
  if (hg == 2)
    group_scores(f16, 2, q, D, k, slot, n, scale, ps);
  else
    group_scores(f16, 3, q, D, k, slot, n, scale, ps);
  for (size_t i = 0; i < hg; ++i) rescale[i] = page_softmax(ps[i], n, run_max + i, run_sum + i);
  if (hg == 2)
    group_values(f16, 2, acc, D, ps, v, slot, n, rescale, pf);
  else
    group_values(f16, 3, acc, D, ps, v, slot, n, rescale, pf);
}
#endif

// Workgroup wg takes one sequence b and `hpw` of its kv heads from g0
// (kernels.ops.AttentionShape.kv_heads_per_workgroup): it writes their new k and v (kv_write), then
// q [B, H D] (before rotary) of their query heads attends to positions [0, lens[b]) of the cache;
// pages, layer, rcos and rsin as kv_write's; out [B, H D]. With all the kv heads, a workgroup reads
// each page's K and V whole, in address order, once; with fewer, more workgroups share the
// sequence. It walks the pages once, each page's kv heads and their query heads in turn: with
// AVX-512 and D a multiple of 64, two or three query heads of a kv head at a time (group_page),
// so that each vector of K and V is read and widened once for them. It fetches the first page's
// rows at once, then each next page's along the way. MAX_GD (query heads per workgroup times
// head_dim) and MAX_STRIDE come from CFLAGS. With `splits` above 1 it takes part `split` of the
// pages (the last part writes the new k and v, as only it reads their page) and writes to `part`
// its sums, maxima and totals for merge_splits instead of out.
//
// Both save time from memory (tools/attention_harness.c times them on SmolLM2's shapes); fetching
// two pages ahead is no faster, and all of them at once is slower.
INLINE void attention(const int f16, const float *q, const float *knew, const float *vnew, void *cache,
                      const int64_t *pages, const int64_t *starts, const int64_t *lens, const int64_t *layer,
                      const float *rcos, const float *rsin, float *out, size_t blocks, size_t H, size_t Hkv, size_t D,
                      size_t L, size_t stride, size_t R, size_t interleaved, size_t hpw, float scale, size_t window,
                      size_t wg, size_t split, size_t splits, float *part) {
  size_t G = H / Hkv, heads = hpw * G;  // query heads a kv head, a workgroup
  if (!hpw || Hkv % hpw || heads * D > MAX_GD || stride > MAX_STRIDE || D % 8 || R > D || split >= splits)
    return;  // never traced: kernels routes only these
  size_t b = wg / (Hkv / hpw), g0 = wg % (Hkv / hpw) * hpw;
  if (split == splits - 1)  // the split with the last page, where the new position goes
    for (size_t g = g0; g < g0 + hpw; ++g)
      kv_write(f16, knew, vnew, cache, pages, starts, layer, rcos, rsin, blocks, Hkv, D, L, stride, R, interleaved, b,
               g);
  const int64_t *page_ids = pages + b * blocks;
  size_t len = (size_t)lens[b], l = (size_t)layer[0], bytes = f16 ? 2 : 4;
  size_t slot_elems = Hkv * D, kv_elems = stride * slot_elems;  // one K (or V) of a page and layer
  float qb[MAX_GD];  // the workgroup's query heads (those of kv heads g0 ..), rotated, [heads, D]
  for (size_t h = 0; h < heads; ++h)
    rope(qb + h * D, q + (b * H + g0 * G + h) * D, rcos + b * (R / 2), rsin + b * (R / 2), D, R, (int)interleaved);
  float acc[MAX_GD], run_max[MAX_GD / 8], run_sum[MAX_GD / 8], ps[3][MAX_STRIDE];
  for (size_t i = 0; i < heads * D; ++i) acc[i] = 0.0f;
  for (size_t h = 0; h < heads; ++h) run_max[h] = -__builtin_inff(), run_sum[h] = 0.0f;
  // positions seen: [first, len), the last `window` of them with a sliding window (keys t with
  // len - 1 - t < window, as ops.length_mask)
  size_t first = window && len > window ? len - window : 0, t_first = first - first % stride;
  // this split's pages of those seen: [t_lo, t_end) of positions
  size_t seen_pages = len > t_first ? (len - t_first + stride - 1) / stride : 0;
  size_t t_lo = t_first + seen_pages * split / splits * stride;
  size_t t_hi = t_first + seen_pages * (split + 1) / splits * stride, t_end = t_hi < len ? t_hi : len;
  if (t_lo < t_end) {  // the first page's rows at once (the walk fetches each next page while on one)
    size_t rows = t_end - t_lo < stride ? t_end - t_lo : stride, seg = hpw * D * bytes;
    const char *k = (const char *)cache + ((size_t)page_ids[t_lo / stride] * L + l) * 2 * kv_elems * bytes +
                    g0 * D * bytes;
    next_page pf0 = {k, 0, seg, slot_elems * bytes, rows, k + kv_elems * bytes, rows, 2 * rows * ((seg + 63) / 64)};
    prefetch_next_page(&pf0);
  }
  for (size_t t0 = t_lo; t0 < t_end; t0 += stride) {
    size_t skip = t0 < first ? first - t0 : 0;  // rows of the page before the window
    size_t n = (len - t0 < stride ? len - t0 : stride) - skip;
    const char *page = (const char *)cache + ((size_t)page_ids[t0 / stride] * L + l) * 2 * kv_elems * bytes +
                       skip * slot_elems * bytes;
    next_page pf = {0};
    if (t0 + stride < t_end) {
      size_t rows = t_end - t0 - stride < stride ? t_end - t0 - stride : stride, seg = hpw * D * bytes;
      const char *k = (const char *)cache + ((size_t)page_ids[t0 / stride + 1] * L + l) * 2 * kv_elems * bytes +
                      g0 * D * bytes;
      pf = (next_page){k, 0, seg, slot_elems * bytes, rows, k + kv_elems * bytes, rows,
                       (2 * rows * ((seg + 63) / 64) + heads * n - 1) / (heads * n)};
    }
    for (size_t h = 0; h < heads;) {
      size_t g = g0 + h / G, left = G - h % G;  // query heads of kv head g from h
      const void *k = page + g * D * bytes, *v = page + (kv_elems + g * D) * bytes;
#ifdef __AVX512F__
      size_t hg = D % 64 ? 1 : left == 4 ? 2 : left < 3 ? left : 3;  // heads taken together (4: two pairs)
      if (hg > 1) {
        group_page(f16, hg, qb + h * D, acc + h * D, run_max + h, run_sum + h, k, v, slot_elems, n, D, scale, ps, &pf);
        h += hg;
        continue;
      }
#endif
      (void)left;
      page_scores(f16, qb + h * D, k, slot_elems, n, D, scale, ps[0]);
      float rescale = page_softmax(ps[0], n, run_max + h, run_sum + h);
      page_values(f16, acc + h * D, ps[0], v, slot_elems, n, D, rescale, &pf);
      ++h;
    }
  }
  if (splits > 1) {  // the split's sums, maxima and totals for merge_splits
    for (size_t i = 0; i < heads * D; ++i) part[i] = acc[i];
    for (size_t h = 0; h < heads; ++h) part[heads * D + h] = run_max[h], part[heads * (D + 1) + h] = run_sum[h];
    return;
  }
  float *ob = out + (b * H + g0 * G) * D;
  for (size_t h = 0; h < heads; ++h)
    for (size_t d = 0; d < D; ++d) ob[h * D + d] = acc[h * D + d] / run_sum[h];
}

// out [M, H D]: the `splits` parts of each of the M (Hkv / hpw) attention items merged, each part
// a split's sums over its positions [heads, D], its maxima [heads] and totals [heads] (heads = hpw
// G), as attention() writes them: each head's sums rescaled to the largest maximum.
INLINE void merge_splits(const float *parts, float *out, size_t M, size_t H, size_t Hkv, size_t D, size_t hpw,
                         size_t splits) {
  size_t G = H / Hkv, heads = hpw * G, per = heads * (D + 2);
  if (splits > MAX_SPLITS) return;  // never traced: kernels.attention_splits gives at most these
  for (size_t item = 0; item < M * (Hkv / hpw); ++item) {
    const float *part = parts + item * splits * per;  // its first part
    size_t b = item / (Hkv / hpw), g0 = item % (Hkv / hpw) * hpw;
    float *ob = out + (b * H + g0 * G) * D;
    for (size_t h = 0; h < heads; ++h) {
      const float *maxima = part + heads * D + h, *totals = part + heads * (D + 1) + h;  // a part apart
      float m = -__builtin_inff(), total = 0.0f, w[MAX_SPLITS];
      for (size_t s = 0; s < splits; ++s) m = maxima[s * per] > m ? maxima[s * per] : m;
      for (size_t s = 0; s < splits; ++s) w[s] = exp_scalar(maxima[s * per] - m), total += w[s] * totals[s * per];
      for (size_t d = 0; d < D; ++d) {
        float sum = 0.0f;
        for (size_t s = 0; s < splits; ++s) sum += w[s] * part[s * per + h * D + d];
        ob[h * D + d] = sum / total;
      }
    }
  }
}

#define ATTENTION_ARGS(T)                                                                                    \
  MEMREF(const float, q), MEMREF(const float, knew), MEMREF(const float, vnew), MEMREF(T, cache),            \
      MEMREF(const int64_t, pages), MEMREF(const int64_t, starts), MEMREF(const int64_t, lens),              \
      MEMREF(const int64_t, layer), MEMREF(const float, rcos), MEMREF(const float, rsin), MEMREF(float, out), \
      size_t blocks, size_t H, size_t Hkv, size_t D, size_t L, size_t stride, size_t R, size_t interleaved,   \
      size_t hpw, float scale, size_t window, size_t wg
#define ATTENTION(f16)                                                                                        \
  attention(f16, BASE(q), BASE(knew), BASE(vnew), BASE(cache), BASE(pages), BASE(starts), BASE(lens), BASE(layer), \
            BASE(rcos), BASE(rsin), BASE(out), blocks, H, Hkv, D, L, stride, R, interleaved, hpw, scale, window, wg, \
            0, 1, 0)
#if IN_PART(2)
void sharkport_decode_attention(ATTENTION_ARGS(float)) { ATTENTION(0); }
void sharkport_decode_attention_f16(ATTENTION_ARGS(uint16_t)) { ATTENTION(1); }
#endif

// ---- prefill attention: causal, over the prompt's own K and V ----

// q [B, S, H D], k and v [B, S, Hkv D] (rotated), out [B, S, H D]: query position i of head h
// attends to positions [0, i] of kv head h / G. Workgroup wg takes batch row b, kv head g and
// PREFILL_ROWS query positions; workgroups are numbered last positions first, so that the longest
// (their queries see the most positions) start first and the short ones fill the workers' idle
// ends. For each query head in turn, the workgroup walks the keys PA_CHUNK at a time with a running
// softmax, for tiles of PA_Q consecutive positions: the chunk's K transposed once ([D][PA_CHUNK] on
// the stack), a tile's scores are PA_Q x 16 multiply-add accumulators over d (a broadcast of q per
// row, two loads of K^T), and its values PA_Q x 16 dims of accumulators over the chunk's keys:
// both bound by multiply-adds, not by loads as one query at a time is.
#define PREFILL_ROWS 12
#define PA_Q 6
#define PA_CHUNK 32
#define PA_MAX_D 256
#define PA_MAX_GD 1024  // query heads per kv head times D: acc holds all of them (48 KiB)
_Static_assert(PREFILL_ROWS % PA_Q == 0, "a workgroup's positions are whole tiles of acc rows");

// Scores of PA_Q queries qr[r] [D] against the chunk's keys kt [D][PA_CHUNK] (16 at a time),
// scaled, into s[r][0, PA_CHUNK).
INLINE void pa_scores(const float *const qr[PA_Q], const float *kt, size_t D, float scale, float s[PA_Q][PA_CHUNK]) {
  const __m256 sc = _mm256_set1_ps(scale);
  for (size_t j = 0; j < PA_CHUNK; j += 16) {
    __m256 a[PA_Q][2];
    for (int r = 0; r < PA_Q; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (size_t d = 0; d < D; ++d) {
      __m256 k0 = _mm256_loadu_ps(kt + d * PA_CHUNK + j), k1 = _mm256_loadu_ps(kt + d * PA_CHUNK + j + 8);
      for (int r = 0; r < PA_Q; ++r) {
        __m256 qd = _mm256_broadcast_ss(qr[r] + d);
        a[r][0] = _mm256_fmadd_ps(qd, k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qd, k1, a[r][1]);
      }
    }
    for (int r = 0; r < PA_Q; ++r) {
      _mm256_storeu_ps(s[r] + j, _mm256_mul_ps(a[r][0], sc));
      _mm256_storeu_ps(s[r] + j + 8, _mm256_mul_ps(a[r][1], sc));
    }
  }
}

// K^T of 8 keys (rows of src, `stride` apart; those past `keys` read as 0) by 8 dims: dst[d][j] at
// dst + d * PA_CHUNK + j, by an 8 x 8 transpose in registers.
INLINE void pa_transpose8(const float *src, size_t stride, size_t keys, float *dst) {
  __m256 r[8], t[8], u[8];
  for (size_t j = 0; j < 8; ++j) r[j] = j < keys ? _mm256_loadu_ps(src + j * stride) : _mm256_setzero_ps();
  for (int j = 0; j < 8; j += 2) t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]), t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
  for (int j = 0; j < 8; j += 4) {  // u[j + i]: dims i and i + 4 of keys j .. j + 3
    u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44), u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
    u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44), u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * PA_CHUNK, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * PA_CHUNK, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}

// Row r's running softmax over its first `seen` scores of the chunk (the rest are hidden: set to
// 0): s[0, seen) replaced by exp(s - max), max and sum updated; returns the factor for the earlier
// sums (1 when the row sees none of the chunk).
INLINE float pa_softmax(float *s, size_t seen, float *run_max, float *run_sum) {
  __m256 mx = _mm256_set1_ps(*run_max);
  size_t i = 0;
  for (; i + 8 <= seen; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (; i < seen; ++i) m = s[i] > m ? s[i] : m;
  float rescale = seen ? exp_scalar(*run_max - m) : 1.0f;  // 0 on the first chunk (exp(-inf) clamps to ~0)
  __m256 mv = _mm256_set1_ps(m), total = _mm256_setzero_ps();
  size_t j = 0;
  for (; j + 8 <= seen; j += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; j < seen; ++j) sum += s[j] = exp_scalar(s[j] - m);
  for (; j < PA_CHUNK; ++j) s[j] = 0.0f;
  *run_max = m;
  *run_sum = *run_sum * rescale + sum;
  return rescale;
}

// acc[r] [D] = acc[r] * rescale[r] + sum over the chunk's first n keys of p[r][j] v[j] (v[j] at
// v + j * slot): PA_Q rows by 16 dims of accumulators, then by 8.
INLINE void pa_values(float *acc, const float p[PA_Q][PA_CHUNK], const float rescale[PA_Q], const float *v,
                      size_t slot, size_t n, size_t D) {
  size_t d = 0;
  for (; d + 16 <= D; d += 16) {
    __m256 a[PA_Q][2];
    for (int r = 0; r < PA_Q; ++r) {
      __m256 f = _mm256_set1_ps(rescale[r]);
      a[r][0] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d), f);
      a[r][1] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d + 8), f);
    }
    for (size_t j = 0; j < n; ++j) {
      __m256 v0 = _mm256_loadu_ps(v + j * slot + d), v1 = _mm256_loadu_ps(v + j * slot + d + 8);
      for (int r = 0; r < PA_Q; ++r) {
        __m256 pr = _mm256_broadcast_ss(p[r] + j);
        a[r][0] = _mm256_fmadd_ps(pr, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pr, v1, a[r][1]);
      }
    }
    for (int r = 0; r < PA_Q; ++r) {
      _mm256_storeu_ps(acc + r * D + d, a[r][0]);
      _mm256_storeu_ps(acc + r * D + d + 8, a[r][1]);
    }
  }
  for (; d < D; d += 8) {
    __m256 a[PA_Q];
    for (int r = 0; r < PA_Q; ++r) a[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d), _mm256_set1_ps(rescale[r]));
    for (size_t j = 0; j < n; ++j) {
      __m256 v0 = _mm256_loadu_ps(v + j * slot + d);
      for (int r = 0; r < PA_Q; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p[r] + j), v0, a[r]);
    }
    for (int r = 0; r < PA_Q; ++r) _mm256_storeu_ps(acc + r * D + d, a[r]);
  }
}

INLINE void prefill_attention(const float *q, const float *k, const float *v, float *out, size_t S, size_t H,
                              size_t Hkv, size_t D, float scale, size_t window, size_t wg) {
  size_t blocks = (S + PREFILL_ROWS - 1) / PREFILL_ROWS, G = H / Hkv;
  if (D > PA_MAX_D || D % 8 || G * D > PA_MAX_GD) return;  // never traced: kernels routes only these
  size_t b = wg / (Hkv * blocks), g = wg / blocks % Hkv, block = blocks - 1 - wg % blocks;
  size_t slot = Hkv * D, p0 = block * PREFILL_ROWS, p1 = p0 + PREFILL_ROWS < S ? p0 + PREFILL_ROWS : S;
  const float *kb = k + b * S * slot + g * D, *vb = v + b * S * slot + g * D;
  // acc, run_max, run_sum: per query head h and position p0 + i, at h * PREFILL_ROWS + i
  float kt[PA_MAX_D * PA_CHUNK], s[PA_Q][PA_CHUNK], acc[PREFILL_ROWS * PA_MAX_GD];
  float run_max[PREFILL_ROWS * PA_MAX_GD / 8], run_sum[PREFILL_ROWS * PA_MAX_GD / 8], rescale[PA_Q];
  for (size_t i = 0; i < G * PREFILL_ROWS * D; ++i) acc[i] = 0.0f;  // a last tile's rows past p1 too
  for (size_t i = 0; i < G * PREFILL_ROWS; ++i) run_max[i] = -__builtin_inff(), run_sum[i] = 0.0f;
  // with a sliding window, position p sees keys (p - window, p]: chunks before the first row's go
  size_t c_first = window && p0 + 1 > window ? (p0 + 1 - window) / PA_CHUNK * PA_CHUNK : 0;
  for (size_t c0 = c_first; c0 < p1; c0 += PA_CHUNK) {
    size_t n = p1 - c0 < PA_CHUNK ? p1 - c0 : PA_CHUNK;  // keys [c0, c0 + n), K^T zero past n
    for (size_t j = 0; j < PA_CHUNK; j += 8)
      for (size_t d = 0; d < D; d += 8)
        pa_transpose8(kb + (c0 + j) * slot + d, slot, n > j ? n - j : 0, kt + d * PA_CHUNK + j);
    for (size_t h = 0; h < G; ++h)
      for (size_t t0 = p0; t0 < p1; t0 += PA_Q) {  // a tile: positions [t0, t0 + rows)
        size_t rows = p1 - t0 < PA_Q ? p1 - t0 : PA_Q, at = h * PREFILL_ROWS + t0 - p0;
        if (c0 > t0 + rows - 1) continue;  // the chunk is past all its positions
        const float *qr[PA_Q];
        for (size_t r = 0; r < PA_Q; ++r)  // rows past the tile repeat its last (computed, not kept)
          qr[r] = q + ((b * S + t0 + (r < rows ? r : rows - 1)) * H + g * G + h) * D;
        pa_scores(qr, kt, D, scale, s);
        size_t last = 0;  // keys of the chunk the tile's last row sees
        for (size_t r = 0; r < PA_Q; ++r) {
          size_t pos = t0 + (r < rows ? r : rows - 1), seen = pos + 1 > c0 ? pos + 1 - c0 : 0;
          seen = seen < n ? seen : n;
          last = seen > last ? seen : last;
          size_t lo = window && pos + 1 > window ? pos + 1 - window : 0;  // the row's first key
          if (lo > c0) {  // keys of the chunk before the row's window: none, or masked
            if (lo - c0 >= seen) seen = 0;
            for (size_t j = 0; j < lo - c0 && j < seen; ++j) s[r][j] = -__builtin_inff();
          }
          if (r < rows) {
            rescale[r] = pa_softmax(s[r], seen, run_max + at + r, run_sum + at + r);
          } else {
            rescale[r] = 1.0f;
            for (size_t j = 0; j < PA_CHUNK; ++j) s[r][j] = 0.0f;
          }
        }
        pa_values(acc + at * D, (const float(*)[PA_CHUNK])s, rescale, vb + c0 * slot, slot, last, D);
      }
  }
  for (size_t h = 0; h < G; ++h)
    for (size_t i = 0; i < p1 - p0; ++i) {
      const float *a = acc + (h * PREFILL_ROWS + i) * D;
      float *o = out + ((b * S + p0 + i) * H + g * G + h) * D;
      for (size_t d = 0; d < D; ++d) o[d] = a[d] / run_sum[h * PREFILL_ROWS + i];
    }
}

#if IN_PART(2)
void sharkport_prefill_attention(MEMREF(const float, q), MEMREF(const float, k), MEMREF(const float, v),
                                 MEMREF(float, out), size_t S, size_t H, size_t Hkv, size_t D, float scale,
                                 size_t window, size_t wg) {
  prefill_attention(BASE(q), BASE(k), BASE(v), BASE(out), S, H, Hkv, D, scale, window, wg);
}
#endif


// ---- A decode layer in one dispatch (or two): phases with a barrier between them ----
//
// sharkport_attention_block_<type> computes h + o(attention(q, k, v of n(h))): the q, k, v
// product of h RMS-normalized, attention with the cache write, the output projection with the
// residual add; sharkport_ffn_block_<type> h + down(silu(gate(n(h))) * up(n(h))); and
// sharkport_layer_block_<type> the one, then the other, in five phases. So a llama layer's five
// dispatches become one (two where only one block applies: Mixtral's experts, Qwen2's biases).
// IREE has no barrier inside a dispatch and does not promise that a dispatch's workgroups run at
// once (a worker may run them one after the other), so each workgroup runs every phase, and the
// work of a phase is shared out as items that any workgroup claims with atomics; a workgroup that
// finds a phase's items all claimed waits until they are finished (a counter), then goes on to the
// next phase. A workgroup never waits while it holds an unfinished item, and only a running
// workgroup claims one, so every claimed item gets finished, whether the workgroups run together
// or one at a time. The counters are an operand the dispatch updates in place (a global of the
// module, zero at first), which the last workgroup to leave zeroes again for the next call
// (cheaper than a fill before each dispatch). A workgroup waiting at the end of a phase fetches the
// weights it will likely take first in the next phase (await_items), so that its waiting reads
// ahead. The phases' work are functions of their own (NOINLINE), so that a workgroup's stack holds
// one phase's workspace at a time. Intermediate results go to the dispatch's result after the
// block's output y [M, E]. The logits are bit-identical to those of five dispatches a layer.
//
// A product's outputs are chunks of `chunk` rows (kernels.BLOCK_CHUNK_ROWS), in one span of
// consecutive chunks for each workgroup. A workgroup normalizes and quantizes x once for the
// phase, takes its own span's chunks from the front, in address order (one stream of weights,
// whose prefetch runs on from chunk to chunk), then whatever is left of the other spans from their
// back, and counts its chunks finished once, at the end. So a workgroup that runs ahead takes over
// what is left of the others' work rather than waiting for them at the phase's end (as with one
// item per workgroup), without smaller items, each quantizing x again and starting a stream of its
// own (which are slower). The logits do not depend on which workgroup takes a chunk.
//
// The layer block (one dispatch where the two blocks take two; a workgroup waiting at the end of
// the output projection fetches its first gate/up rows) gives logits bit-identical to theirs.
#define COUNTER_STRIDE 16

// The counters of a dispatch of P phases, each on a cache line of its own (COUNTER_STRIDE int32
// apart): of phase p, the span s of its product at line p (W + 1) + s (the chunks taken from its
// front and from its back, 16 bits each; the attention's items: a counter), those it finished at
// line p (W + 1) + W; of the workgroups that left, line P (W + 1); W workgroups
// (kernels.block_counters: the same).
#define SPAN_LINE(p, s, W) ((p) * ((W) + 1) + (s))
#define FINISHED_LINE(p, W) ((p) * ((W) + 1) + (W))
#define BLOCK_COUNTERS(P, W) (((P) * ((W) + 1) + 1) * COUNTER_STRIDE)
#define ATTENTION_PHASES 3  // q/k/v, attention, the output projection
#define FFN_PHASES 2        // gate/up with SiLU, down

// After its last phase each workgroup leaves, and the last of the `workgroups` to leave zeroes the
// counters of the dispatch's `phases` for its next call.
INLINE void leave(int32_t *counters, size_t phases, size_t workgroups) {
  size_t n = BLOCK_COUNTERS(phases, workgroups);
  if ((size_t)__atomic_add_fetch(counters + n - COUNTER_STRIDE, 1, __ATOMIC_ACQ_REL) == workgroups)
    for (size_t i = 0; i < n; ++i) __atomic_store_n(counters + i, 0, __ATOMIC_RELAXED);
}

INLINE size_t claim_item(int32_t *claimed) { return (size_t)__atomic_fetch_add(claimed, 1, __ATOMIC_RELAXED); }
INLINE void finish_items(int32_t *finished, size_t n) {
  if (n) __atomic_fetch_add(finished, (int32_t)n, __ATOMIC_RELEASE);
}

// Takes one of a span's `chunks` chunks (fewer than 65536, some two million outputs: far more than
// a layer's matrices have), from its front (the low 16 bits of *span count those taken there) or
// its back (the high 16 bits): its index in the span in *chunk, or 0 when none is left. An int32,
// as the counters are, so its alignment is theirs.
INLINE int claim_chunk(int32_t *span, size_t chunks, int back, size_t *chunk) {
  int32_t now = __atomic_load_n(span, __ATOMIC_RELAXED);
  for (;;) {
    size_t front = (uint32_t)now & 0xFFFF, taken_back = (uint32_t)now >> 16;
    if (front + taken_back >= chunks) return 0;
    int32_t next = (int32_t)((uint32_t)now + (back ? 1u << 16 : 1u));
    if (__atomic_compare_exchange_n(span, &now, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      *chunk = back ? chunks - 1 - taken_back : front;
      return 1;
    }
  }
}

// What a workgroup fetches while it waits at the end of a phase: the weights it will take first in
// the next phase (up to three planes).
typedef struct {
  const char *at[3];
  size_t bytes[3];
} upcoming;

// Rows [n, n + rows) of w [N, K] (n a multiple of 8 with interleaved rows): their values (the
// low bits, for Q5 and the K-quants), scales and offsets (or dmin).
INLINE upcoming weight_rows(int kind, const matrix *w, size_t n, size_t rows, size_t K) {
  size_t row = qs_row_bytes(kind, K), scales = (K / 32 * d_bytes256(kind)) >> 8;  // a row's bytes
  upcoming u = {{0}, {0}};
  u.at[0] = (const char *)w->qs + n * row, u.bytes[0] = rows * row;
  if (!FLOAT_WEIGHTS(kind)) u.at[1] = (const char *)w->d + n * scales, u.bytes[1] = rows * scales;
  if (w->m) u.at[2] = (const char *)w->m + n * scales, u.bytes[2] = rows * scales;
  return u;
}

// The chunks of a product of N outputs, and of each span.
INLINE size_t chunks_of(size_t N, size_t chunk) { return (N + chunk - 1) / chunk; }
INLINE size_t span_chunks(size_t N, size_t chunk, size_t W) { return (chunks_of(N, chunk) + W - 1) / W; }

// The rows of w [N, K] in workgroup wg's span: what it takes first.
INLINE upcoming own_span(int kind, const matrix *w, size_t K, size_t chunk, size_t W, size_t wg) {
  size_t n = wg * span_chunks(w->n, chunk, W) * chunk, end = n + span_chunks(w->n, chunk, W) * chunk;
  return weight_rows(kind, w, n < w->n ? n : w->n, (end < w->n ? end : w->n) - (n < w->n ? n : w->n), K);
}

INLINE void await_items(int32_t *finished, size_t items, upcoming next) {
  size_t plane = 0, offset = 0;
  while ((size_t)__atomic_load_n(finished, __ATOMIC_ACQUIRE) < items) {
    for (int lines = 0; lines < 4 && plane < 3;) {  // a few lines between looks at the counter
      if (offset >= next.bytes[plane]) {
        ++plane, offset = 0;
        continue;
      }
      _mm_prefetch(next.at[plane] + offset, _MM_HINT_T1);
      offset += 64, ++lines;
    }
    if (plane == 3) _mm_pause();
  }
}

// Phase p of a block, a product (see product_rows) of x [M, K] (normalized by g where not null)
// in chunks of `chunk` outputs, shared out in spans among W workgroups (this one wg); then waits
// until all its chunks are finished, fetching `next` meanwhile. Where the workspace cannot hold
// all of x quantized, x is prepared again for each chunk, so a span is then one chunk.
INLINE void product_phase(int kind, int op, const float *x, const float *g, float eps, const matrix *w, size_t count,
                          const float *r, float *y, size_t M, size_t N, size_t K, size_t chunk, int32_t *counters,
                          size_t p, size_t W, size_t wg, upcoming next) {
  if (K / 32 > MAX_BLOCKS || (g && M * K > XN_FLOATS)) return;  // never traced: kernels routes only these
  stack_space space;
  workspace ws = on_stack(&space);
  int whole = x_rows(kind, g, M, 0, K) == M;  // x prepared once for the phase
  const float *xm = whole ? prepare_x(kind, x, g, eps, K, 0, M, &ws) : x;
  if (!whole) chunk *= span_chunks(N, chunk, W);
  size_t per = span_chunks(N, chunk, W), total = chunks_of(N, chunk), done = 0;
  for (size_t k = 0; k < W; ++k) {  // its own span from the front, then the others' from their back
    size_t s = (wg + k) % W, lo = s * per, c;
    size_t chunks = lo < total ? (total - lo < per ? total - lo : per) : 0;
    while (claim_chunk(counters + SPAN_LINE(p, s, W) * COUNTER_STRIDE, chunks, k != 0, &c)) {
      size_t n0 = (lo + c) * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
      if (whole)
        product_rows(kind, op, &ws, xm, w, count, r, y, M, N, K, 0, M, n0, n1);
      else
        product_all_rows(kind, op, &ws, x, g, eps, w, count, r, y, M, N, K, 0, n0, n1);
      ++done;
    }
  }
  int32_t *finished = counters + FINISHED_LINE(p, W) * COUNTER_STRIDE;
  finish_items(finished, done);
  await_items(finished, total, next);
}

NOINLINE void attention_item(const int f16, const float *q, const float *knew, const float *vnew, void *cache,
                             const int64_t *pages, const int64_t *starts, const int64_t *lens, const int64_t *layer,
                             const float *rcos, const float *rsin, float *out, size_t blocks, size_t H, size_t Hkv,
                             size_t D, size_t L, size_t stride, size_t R, size_t interleaved, size_t hpw, float scale,
                             size_t window, size_t item, size_t split, size_t splits, float *part) {
  if (f16)
    attention(1, q, knew, vnew, cache, pages, starts, lens, layer, rcos, rsin, out, blocks, H, Hkv, D, L, stride, R,
              interleaved, hpw, scale, window, item, split, splits, part);
  else
    attention(0, q, knew, vnew, cache, pages, starts, lens, layer, rcos, rsin, out, blocks, H, Hkv, D, L, stride, R,
              interleaved, hpw, scale, window, item, split, splits, part);
}

// Phase p of a block: decode attention of q, k, v [M, Nq + 2 Nkv] into att [M, Nq], its M (Hkv /
// hpw) items each in `splits` parts of its pages (kernels.attention_splits: so that more
// workgroups than items share the work), claimed one at a time; then waits fetching `next`.
// Returns the attention's output for the next phase: att, or where the items were split, this
// workgroup's merge of their parts (kept in `split_scratch`): workgroup 0's into att, the others'
// into copies of their own after the parts.
INLINE const float *attention_phase(const int f16, const float *qkv, void *cache, const int64_t *pages,
                                    const int64_t *starts, const int64_t *lens, const int64_t *layer,
                                    const float *rcos, const float *rsin, float *att, float *split_scratch,
                                    size_t splits, size_t blocks, size_t M, size_t H, size_t Hkv, size_t D, size_t L,
                                    size_t stride, size_t R, size_t interleaved, size_t hpw, float scale,
                                    size_t window, int32_t *counters, size_t p, size_t W, size_t wg, upcoming next) {
  size_t Nq = H * D, Nkv = Hkv * D, items = M * (Hkv / hpw) * splits, per = hpw * (H / Hkv) * (D + 2);
  int32_t *claimed = counters + SPAN_LINE(p, 0, W) * COUNTER_STRIDE;
  size_t done = 0;
  for (size_t item; (item = claim_item(claimed)) < items; ++done)
    attention_item(f16, qkv, qkv + M * Nq, qkv + M * (Nq + Nkv), cache, pages, starts, lens, layer, rcos, rsin, att,
                   blocks, H, Hkv, D, L, stride, R, interleaved, hpw, scale, window, item / splits, item % splits,
                   splits, split_scratch + item * per);
  int32_t *finished = counters + FINISHED_LINE(p, W) * COUNTER_STRIDE;
  finish_items(finished, done);
  await_items(finished, items, next);
  if (splits == 1) return att;
  float *merged = wg ? split_scratch + items * per + (wg - 1) * M * Nq : att;
  merge_splits(split_scratch, merged, M, H, Hkv, D, hpw, splits);
  return merged;
}

// The block kernels of weight type T (the attention block's planes: q's, k's, v's, then the
// output projection's; the FFN block's: gate's, up's, down's; the layer block's: the attention
// block's, the FFN norm's weight, then the FFN block's), h [M, E], y [M, E] and then the
// intermediates; `chunk`: outputs a chunk of each product takes. The attention block's cache of
// element type C (uint16_t: float16) and its other operands are decode attention's; its attention
// phase's items are claimed one at a time from one counter.
#define DEFINE_PHASES(T, lower)                                                                                      \
  NOINLINE void concat_phase_##lower(const float *x, const float *g, float eps, const matrix *w, size_t count,       \
                                     const float *r, float *y, size_t M, size_t N, size_t K, size_t chunk,           \
                                     int32_t *counters, size_t p, size_t W, size_t wg, upcoming next) {              \
    product_phase(T, CONCAT, x, g, eps, w, count, r, y, M, N, K, chunk, counters, p, W, wg, next);                   \
  }                                                                                                                  \
  NOINLINE void swiglu_phase_##lower(const float *x, const float *g, float eps, const matrix *w, float *y, size_t M, \
                                     size_t N, size_t K, size_t chunk, int32_t *counters, size_t p, size_t W,        \
                                     size_t wg, upcoming next) {                                                     \
    product_phase(T, SWIGLU, x, g, eps, w, 2, 0, y, M, N, K, chunk, counters, p, W, wg, next);                       \
  }
#define DEFINE_BLOCK_KERNELS(T, lower)                                                                               \
  DEFINE_PHASES(T, lower)                                                                                            \
  /* Phases p and p + 1: out = h + down(silu(gate(n(h))) * up(n(h))), n(h) h normalized by g; act   \
     [M, I] holds silu(gate) * up. */                                                                                \
  INLINE void ffn_phases_##lower(const float *h, const float *g, float eps, const matrix *gate_up,                  \
                                 const matrix *down, float *act, float *out, size_t M, size_t E, size_t I,           \
                                 size_t chunk, int32_t *counters, size_t p, size_t W, size_t wg) {                   \
    const upcoming nothing = {{0}, {0}};                                                                             \
    swiglu_phase_##lower(h, g, eps, gate_up, act, M, I, E, chunk, counters, p, W, wg, own_span(T, down, I, chunk, W, wg)); \
    concat_phase_##lower(act, 0, 0, down, 1, h, out, M, E, I, chunk, counters, p + 1, W, wg, nothing);              \
  }                                                                                                                  \
  void sharkport_ffn_block_##lower(MEMREF(const float, x), MEMREF(const float, g), ARGS_##T(a), ARGS_##T(b),         \
                                   ARGS_##T(c), MEMREF(int32_t, phase_counters), MEMREF(float, y), size_t M, size_t E, \
                                   size_t I, size_t chunk, float eps, size_t workgroups, size_t wg) {                \
    matrix gate_up[2] = {MAT_##T(a, I), MAT_##T(b, I)}, down[1] = {MAT_##T(c, E)};                                   \
    float *out = BASE(y);                                                                                            \
    ffn_phases_##lower(BASE(x), BASE(g), eps, gate_up, down, out + M * E, out, M, E, I, chunk, BASE(phase_counters), \
                       0, workgroups, wg);                                                                           \
    leave(BASE(phase_counters), FFN_PHASES, workgroups);                                                             \
  }                                                                                                                  \
  ATTENTION_BLOCK(T, lower, float, 0, )                                                                              \
  ATTENTION_BLOCK(T, lower, uint16_t, 1, _f16)
// The attention block's operands (after x and g) and constants (before chunk), as its C functions
// take them: the q, k, v planes (a, b, c), decode attention's, the output projection's planes (o).
#define ATTENTION_OPERANDS(T, C)                                                                                     \
  ARGS_##T(a), ARGS_##T(b), ARGS_##T(c), MEMREF(C, cache), MEMREF(const int64_t, pages),                             \
      MEMREF(const int64_t, starts), MEMREF(const int64_t, lens), MEMREF(const int64_t, layer),                      \
      MEMREF(const float, rcos), MEMREF(const float, rsin), ARGS_##T(o)
#define ATTENTION_CONSTANTS                                                                                          \
  size_t blocks, size_t M, size_t E, size_t H, size_t Hkv, size_t D, size_t L, size_t stride, size_t R,             \
      size_t interleaved, size_t hpw, float scale, size_t window, size_t splits
#define ATTENTION_PHASES_CALL(lower, suffix, T, out, scratch, split_scratch, next)                                   \
  attention_phases_##lower##suffix(BASE(x), BASE(g), eps, (matrix[3]){MAT_##T(a, H * D), MAT_##T(b, Hkv * D),        \
                                   MAT_##T(c, Hkv * D)}, (matrix[1]){MAT_##T(o, E)}, BASE(cache), BASE(pages),       \
                                   BASE(starts), BASE(lens), BASE(layer), BASE(rcos), BASE(rsin), out, scratch,      \
                                   split_scratch, splits, blocks, M, E, H, Hkv, D, L, stride, R, interleaved, hpw,   \
                                   scale, window, chunk, BASE(phase_counters), workgroups, wg, next)
#define ATTENTION_BLOCK(T, lower, C, f16, suffix)                                                                    \
  /* Phases 0 to 2: out = h + o(attention(q, k, v of n(h))), q, k, v [M, Nq + 2 Nkv] and then the   \
     attention's output [M, Nq] in scratch (its split parts in split_scratch: see attention_phase);  \
     at the end a workgroup waits fetching `next`. */                                                                \
  INLINE void attention_phases_##lower##suffix(                                                                      \
      const float *h, const float *g, float eps, const matrix *qkv_w, const matrix *o_w, C *cache,                   \
      const int64_t *pages, const int64_t *starts, const int64_t *lens, const int64_t *layer, const float *rcos,     \
      const float *rsin, float *out, float *scratch, float *split_scratch, size_t splits, size_t blocks, size_t M,   \
      size_t E, size_t H, size_t Hkv, size_t D, size_t L, size_t stride, size_t R, size_t interleaved, size_t hpw,   \
      float scale, size_t window, size_t chunk, int32_t *counters, size_t W, size_t wg, upcoming next) {             \
    size_t Nq = H * D, Nkv = Hkv * D, Nqkv = Nq + 2 * Nkv;                                                           \
    float *qkv = scratch, *att = qkv + M * Nqkv;                                                                     \
    const upcoming nothing = {{0}, {0}};                                                                             \
    concat_phase_##lower(h, g, eps, qkv_w, 3, 0, qkv, M, Nqkv, E, chunk, counters, 0, W, wg, nothing);               \
    const float *merged = attention_phase(f16, qkv, cache, pages, starts, lens, layer, rcos, rsin, att,              \
                                          split_scratch, splits, blocks, M, H, Hkv, D, L, stride, R, interleaved,    \
                                          hpw, scale, window, counters, 1, W, wg, own_span(T, o_w, Nq, chunk, W, wg)); \
    concat_phase_##lower(merged, 0, 0, o_w, 1, h, out, M, E, Nq, chunk, counters, 2, W, wg, next);                   \
  }                                                                                                                  \
  void sharkport_attention_block_##lower##suffix(                                                                    \
      MEMREF(const float, x), MEMREF(const float, g), ATTENTION_OPERANDS(T, C), MEMREF(int32_t, phase_counters),     \
      MEMREF(float, y), ATTENTION_CONSTANTS, size_t chunk, float eps, size_t workgroups, size_t wg) {                \
    const upcoming nothing = {{0}, {0}};                                                                             \
    float *scratch = BASE(y) + M * E; /* q, k, v, the attention's output, then the split parts */                  \
    ATTENTION_PHASES_CALL(lower, suffix, T, BASE(y), scratch, scratch + M * (2 * H * D + 2 * Hkv * D), nothing);    \
    leave(BASE(phase_counters), ATTENTION_PHASES, workgroups);                                                       \
  }                                                                                                                  \
  /* A whole llama layer: the attention block's phases into h1, then the FFN block's on h1 (normed   \
     by g2, gate, up, down: the planes e, f, u); y holds the output, then h1, the attention's         \
     intermediates and the FFN's. While it waits at the end of the output projection a workgroup    \
     fetches the gate/up rows it takes first. */                                                                     \
  void sharkport_layer_block_##lower##suffix(                                                                        \
      MEMREF(const float, x), MEMREF(const float, g), ATTENTION_OPERANDS(T, C), MEMREF(const float, g2),             \
      ARGS_##T(e), ARGS_##T(f), ARGS_##T(u), MEMREF(int32_t, phase_counters), MEMREF(float, y),                      \
      ATTENTION_CONSTANTS, size_t I, size_t chunk, float eps, size_t workgroups, size_t wg) {                        \
    matrix gate_up[2] = {MAT_##T(e, I), MAT_##T(f, I)}, down[1] = {MAT_##T(u, E)};                                   \
    float *out = BASE(y), *h1 = out + M * E, *scratch = h1 + M * E;                                                  \
    float *act = scratch + M * (2 * H * D + 2 * Hkv * D);                                                            \
    ATTENTION_PHASES_CALL(lower, suffix, T, h1, scratch, act + M * I, own_span(T, gate_up, E, chunk, workgroups, wg)); \
    ffn_phases_##lower(h1, BASE(g2), eps, gate_up, down, act, out, M, E, I, chunk, BASE(phase_counters),             \
                       ATTENTION_PHASES, workgroups, wg);                                                            \
    leave(BASE(phase_counters), ATTENTION_PHASES + FFN_PHASES, workgroups);                                          \
  }

#if IN_PART(3)  // the block kernels, to the end of the file
DEFINE_BLOCK_KERNELS(Q8_0, q8_0)
DEFINE_BLOCK_KERNELS(Q4_0, q4_0)
DEFINE_BLOCK_KERNELS(Q4_1, q4_1)
DEFINE_BLOCK_KERNELS(Q4_0X8, q4_0x8)
DEFINE_BLOCK_KERNELS(Q4_1X8, q4_1x8)
DEFINE_BLOCK_KERNELS(Q8_0X8, q8_0x8)
DEFINE_BLOCK_KERNELS(F16, f16)
DEFINE_BLOCK_KERNELS(BF16, bf16)

// ---- blocks whose matrices' types differ ----
//
// llama.cpp's mixtures give a layer's matrices different types (SmolLM2's and Qwen2.5's: Q5_0
// beside a Q8_0 v and a Q4_K or Q6_K down). The layer block of mixed types takes such a layer as
// those of one type do: each matrix's planes in MIXED_SLOTS slots (kernels.PLANES order, the slots
// past its planes repeating one, unread) and its type as an index into MIXED_KINDS
// (kernels.MIXED_KINDS: the same order). q, k and v take a phase for each run of one type among
// them (q and k together, v apart, where only v's differs), so a layer takes up to seven phases.
// kernels takes it for layers of up to MIXED_LAYER_PLANES planes (IREE binds 32 buffers to a
// dispatch): not K-quant layers, a dispatch a product.
#define MIXED_KINDS(F)                                                                                               \
  F(Q8_0X8, q8_0x8) F(Q4_0X8, q4_0x8) F(Q4_1X8, q4_1x8) F(Q5_0X8, q5_0x8) F(Q5_1X8, q5_1x8) F(Q4_KX8, q4_kx8)      \
  F(Q5_KX8, q5_kx8) F(Q6_KX8, q6_kx8) F(Q2_KX8, q2_kx8) F(Q3_KX8, q3_kx8) F(IQ4_NLX8, iq4_nlx8)                   \
  F(IQ4_XSX8, iq4_xsx8) F(F16, f16) F(BF16, bf16)
#define MIXED_ATTENTION_PHASES 5  // at most: q, k and v apart, attention, the output projection

DEFINE_PHASES(Q5_0X8, q5_0x8)
DEFINE_PHASES(Q5_1X8, q5_1x8)
DEFINE_PHASES(Q4_KX8, q4_kx8)
DEFINE_PHASES(Q5_KX8, q5_kx8)
DEFINE_PHASES(Q6_KX8, q6_kx8)
DEFINE_PHASES(Q2_KX8, q2_kx8)
DEFINE_PHASES(Q3_KX8, q3_kx8)
DEFINE_PHASES(IQ4_NLX8, iq4_nlx8)
DEFINE_PHASES(IQ4_XSX8, iq4_xsx8)

#define KIND_OF(T, lower) T,
static const int mixed_kinds[] = {MIXED_KINDS(KIND_OF)};
#undef KIND_OF

// concat_phase_<type> and swiglu_phase_<type> of the weights' type `kind`.
NOINLINE void concat_phase_of(int kind, const float *x, const float *g, float eps, const matrix *w, size_t count,
                              const float *r, float *y, size_t M, size_t N, size_t K, size_t chunk, int32_t *counters,
                              size_t p, size_t W, size_t wg, upcoming next) {
#define CASE(T, lower)                                                                       \
  case T:                                                                                    \
    concat_phase_##lower(x, g, eps, w, count, r, y, M, N, K, chunk, counters, p, W, wg, next); \
    return;
  switch (kind) { MIXED_KINDS(CASE) }
#undef CASE
}
NOINLINE void swiglu_phase_of(int kind, const float *x, const float *g, float eps, const matrix *w, float *y, size_t M,
                              size_t N, size_t K, size_t chunk, int32_t *counters, size_t p, size_t W, size_t wg,
                              upcoming next) {
#define CASE(T, lower)                                                             \
  case T:                                                                          \
    swiglu_phase_##lower(x, g, eps, w, y, M, N, K, chunk, counters, p, W, wg, next); \
    return;
  switch (kind) { MIXED_KINDS(CASE) }
#undef CASE
}

// The bytes of an element of plane j of a matrix of `kind` (layout.PLANES' order; a slot past
// its planes repeats plane 0): float16 scales (d; Q4_1's and Q5_1's m, the K-quants' dmin, IQ4_XS's
// scales_h) and F16's and BF16's weights take two, every other plane one.
INLINE size_t plane_bytes(int kind, int j) {
  if (kind == F16 || kind == BF16 || j == 1) return 2;
  if (j == 2)
    return kind == Q4_1X8 || kind == Q5_1X8 || kind == Q4_KX8 || kind == Q5_KX8 || kind == Q2_KX8 || kind == IQ4_XSX8
               ? 2
               : 1;
  return 1;
}

// A matrix of `n` rows of weight type `kind` from its planes in kernels.PLANES order (as the MAT_
// macros take them).
INLINE matrix slot_matrix(int kind, const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3,
                          const uint8_t *p4, size_t n) {
  const uint16_t *d = (const uint16_t *)p1, *m = (const uint16_t *)p2;
  switch (kind) {
    case F16:
    case BF16: return (matrix){p0, 0, 0, n, 0, 0};
    case Q8_0X8:
    case Q4_0X8:
    case IQ4_NLX8: return (matrix){p0, d, 0, n, 0, 0};
    case Q4_1X8: return (matrix){p0, d, m, n, 0, 0};
    case Q5_0X8: return (matrix){p0, d, 0, n, p2, 0};
    case Q5_1X8: return (matrix){p0, d, m, n, p3, 0};
    case Q4_KX8:
    case Q2_KX8:
    case IQ4_XSX8: return (matrix){p0, d, m, n, 0, p3};  // dmin (IQ4_XS: scales_h) as m, the scales as s
    case Q5_KX8: return (matrix){p0, d, m, n, p4, p3};
    default: return (matrix){p0, d, 0, n, p2, p3};  // Q6_KX8 (ql, d, qh, scales), Q3_KX8 (qs, d, hmask, scales)
  }
}

// The attention block's phases from phase 0 with the matrices w (q, k, v, the output projection)
// of types `kind`: out = h + o(attention(q, k, v of n(h))), q, k, v [M, Nq + 2 Nkv] (plus `bias`,
// laid out as they are, where not null) and the attention's output [M, Nq] in scratch; at the end
// a workgroup waits fetching `next`. Returns the phases it took.
INLINE size_t mixed_attention_phases(const int f16, const float *h, const float *g, float eps, const matrix *w,
                                     const int *kind, const float *bias, void *cache, const int64_t *pages,
                                     const int64_t *starts, const int64_t *lens, const int64_t *layer,
                                     const float *rcos, const float *rsin, float *out, float *scratch,
                                     float *split_scratch, size_t splits, size_t blocks, size_t M, size_t E, size_t H,
                                     size_t Hkv, size_t D, size_t L, size_t stride, size_t R, size_t interleaved,
                                     size_t hpw, float scale, size_t window, size_t chunk, int32_t *counters,
                                     size_t W, size_t wg, upcoming next) {
  const upcoming nothing = {{0}, {0}};
  size_t Nq = H * D, Nkv = Hkv * D, p = 0;
  float *qkv = scratch, *att = qkv + M * (Nq + 2 * Nkv);
  for (size_t j = 0, first = 0, e; j < 3; j = e) {  // q, k, v: a phase for each run of one type
    size_t N = w[j].n;
    for (e = j + 1; e < 3 && kind[e] == kind[j]; ++e) N += w[e].n;
    upcoming ahead = e < 3 ? own_span(kind[e], &w[e], E, chunk, W, wg) : nothing;
    concat_phase_of(kind[j], h, g, eps, w + j, e - j, bias ? bias + first * M : 0, qkv + first * M, M, N, E, chunk,
                    counters, p++, W, wg, ahead);
    first += N;
  }
  const float *merged = attention_phase(f16, qkv, cache, pages, starts, lens, layer, rcos, rsin, att, split_scratch,
                                        splits, blocks, M, H, Hkv, D, L, stride, R, interleaved, hpw, scale, window,
                                        counters, p++, W, wg, own_span(kind[3], &w[3], Nq, chunk, W, wg));
  concat_phase_of(kind[3], merged, 0, 0, &w[3], 1, h, out, M, E, Nq, chunk, counters, p++, W, wg, next);
  return p;
}

// The FFN block's phases from phase p with gate, up and down w of types `kind`: out = h +
// down(silu(gate(n(h))) * up(n(h))), act [M, I] holding silu(gate) * up.
INLINE void mixed_ffn_phases(const float *h, const float *g, float eps, const matrix *w, const int *kind, float *act,
                             float *out, size_t M, size_t E, size_t I, size_t chunk, int32_t *counters, size_t p,
                             size_t W, size_t wg) {
  const upcoming nothing = {{0}, {0}};
  swiglu_phase_of(kind[0], h, g, eps, w, act, M, I, E, chunk, counters, p, W, wg,
                  own_span(kind[2], &w[2], I, chunk, W, wg));
  concat_phase_of(kind[2], act, 0, 0, &w[2], 1, h, out, M, E, I, chunk, counters, p + 1, W, wg, nothing);
}

#define SLOTS(p)                                                                                          \
  MEMREF(const uint8_t, p##0), MEMREF(const uint8_t, p##1), MEMREF(const uint8_t, p##2),                  \
      MEMREF(const uint8_t, p##3), MEMREF(const uint8_t, p##4)
// A slot's plane, whose memref counts its offset in elements of the plane's own type (the program
// passes typed planes; several planes often lie in one buffer, at offsets).
#define SLOT_BASE(p, j, kind) ((const uint8_t *)p##j##_aligned + p##j##_offset * plane_bytes(kind, j))
#define SLOT_MATRIX(p, t, rows)                                                                            \
  slot_matrix(mixed_kinds[t], SLOT_BASE(p, 0, mixed_kinds[t]), SLOT_BASE(p, 1, mixed_kinds[t]),           \
              SLOT_BASE(p, 2, mixed_kinds[t]), SLOT_BASE(p, 3, mixed_kinds[t]), SLOT_BASE(p, 4, mixed_kinds[t]), rows)
// The layer block of mixed types: the operands of sharkport_layer_block_<type>, each matrix's
// planes in slots, and after I each matrix's type (its index in MIXED_KINDS). y holds the output,
// then h1, q, k and v, the attention's output and silu(gate) * up. Its _bias twin takes after v's
// slots the biases of q, k and v (qwen2's), laid out as their products in y: [M, Nq] [M, Nkv]
// [M, Nkv] (each row of a bias repeated M times).
#define MIXED_LAYER_BLOCK(C, f16, name, bias_param, bias)                                                         \
  void name(                                                                                                      \
      MEMREF(const float, x), MEMREF(const float, g), SLOTS(a), SLOTS(b), SLOTS(c) UNPAREN bias_param,           \
      MEMREF(C, cache),                                                                                           \
      MEMREF(const int64_t, pages), MEMREF(const int64_t, starts), MEMREF(const int64_t, lens),                   \
      MEMREF(const int64_t, layer), MEMREF(const float, rcos), MEMREF(const float, rsin), SLOTS(o),             \
      MEMREF(const float, g2), SLOTS(e), SLOTS(f), SLOTS(u), MEMREF(int32_t, phase_counters), MEMREF(float, y),  \
      ATTENTION_CONSTANTS, size_t I, size_t tq, size_t tk, size_t tv, size_t to, size_t tg, size_t tu, size_t td, \
      size_t chunk, float eps, size_t workgroups, size_t wg) {                                                    \
    const int attention_kind[4] = {mixed_kinds[tq], mixed_kinds[tk], mixed_kinds[tv], mixed_kinds[to]};           \
    const int ffn_kind[3] = {mixed_kinds[tg], mixed_kinds[tu], mixed_kinds[td]};                                  \
    const matrix attention_w[4] = {SLOT_MATRIX(a, tq, H * D), SLOT_MATRIX(b, tk, Hkv * D),                       \
                                   SLOT_MATRIX(c, tv, Hkv * D), SLOT_MATRIX(o, to, E)};                          \
    const matrix ffn_w[3] = {SLOT_MATRIX(e, tg, I), SLOT_MATRIX(f, tu, I), SLOT_MATRIX(u, td, E)};                \
    float *out = BASE(y), *h1 = out + M * E, *scratch = h1 + M * E;                                               \
    float *act = scratch + M * (2 * H * D + 2 * Hkv * D);                                                         \
    size_t p = mixed_attention_phases(f16, BASE(x), BASE(g), eps, attention_w, attention_kind, bias, BASE(cache), \
                                      BASE(pages), BASE(starts), BASE(lens), BASE(layer), BASE(rcos), BASE(rsin), \
                                      h1, scratch, act + M * I, splits, blocks, M, E, H, Hkv, D, L, stride, R,   \
                                      interleaved, hpw, scale, window, chunk, BASE(phase_counters), workgroups,   \
                                      wg,                                                                         \
                                      own_span(ffn_kind[0], ffn_w, E, chunk, workgroups, wg));                    \
    mixed_ffn_phases(h1, BASE(g2), eps, ffn_w, ffn_kind, act, out, M, E, I, chunk, BASE(phase_counters), p,       \
                     workgroups, wg);                                                                             \
    leave(BASE(phase_counters), MIXED_ATTENTION_PHASES + FFN_PHASES, workgroups);                                 \
  }
MIXED_LAYER_BLOCK(float, 0, sharkport_layer_block_mixed, (), 0)
MIXED_LAYER_BLOCK(uint16_t, 1, sharkport_layer_block_mixed_f16, (), 0)
MIXED_LAYER_BLOCK(float, 0, sharkport_layer_block_mixed_bias, (, MEMREF(const float, qkv_bias)), BASE(qkv_bias))
MIXED_LAYER_BLOCK(uint16_t, 1, sharkport_layer_block_mixed_bias_f16, (, MEMREF(const float, qkv_bias)), BASE(qkv_bias))
#endif  // IN_PART(3)
