// Block-quantized matmuls: y (M, N) = x (M, K) @ w.T (+ bias) (+ residual) for float32 rows x and a weight in one of
// ggml's formats (models/quant.py), dequantized in registers, never in memory.
//
// As ggml does for its integer dot products, each row of x is first quantized by blocks of 32 inputs: q = round(x /
// d) in int8, d = max |x| / 127, kept with d and the sum of the block's q (a row's own numbers, so the row's result
// does not depend on the others). A weight block's integer dot product with it is then taken by the CPU's int8 dot
// product (AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw and vpmaddwd), and scaled in float32:
//   Q8_0: w = dw * qw               y += dw * d * sum(qw * q)
//   Q4_0: w = dw * (qw - 8)          y += dw * d * (sum(qw * q) - 8 * sum(q))
//   Q4_1: w = dw * qw + mw           y += dw * d * sum(qw * q) + mw * d * sum(q)
// The weight is packed (kernels/__init__.py `pack_quantized`) in blocks of 16 output columns, and within a column
// block by blocks of 32 inputs: the 16 columns' scales dw (float16), for Q4_1 their mins mw (float16), then the
// quants as the dot product takes them: groups of 4 inputs, each group the 16 columns' 4 bytes side by side. Q8_0
// groups are qw + 128 (unsigned, for vpdpbusd; AVX2 takes the sign back); a Q4 group's bytes hold inputs 4g .. 4g + 3
// in their low nibbles and 16 + 4g .. 16 + 4g + 3 in their high ones, as ggml's bytes 4g .. 4g + 3 do.
#include <vector>

#include "simd.h"

#ifdef VS_KERNELS
enum Format { Q8_0, Q4_0, Q4_1 };
static const int QCOLS = 16;  // output columns per weight block: one 16-lane accumulator per row
static const int QK = 32;     // inputs per block
// Bytes of weight asked into the L2 cache ahead of their use. The weight is read once, front to back; without this,
// one thread's stream of it ran well below the memory's rate, more so for several rows.
static const long FETCH_AHEAD = 16384;
template <Format F>
constexpr long block_bytes() {  // packed bytes per 16 columns x 32 inputs
  return (F == Q4_1 ? 64 : 32) + (F == Q8_0 ? 512 : 256);
}
#ifdef VS_AVX512
static const int QROWS = 8;  // rows a block takes at once: their integer and float accumulators stay in registers
static const int Q8_OFFSET = 128;  // Q8_0 quants are stored + 128 and taken unsigned
#else
static const int QROWS = 4;
static const int Q8_OFFSET = 0;  // AVX2 takes them signed
#endif

struct Rows {  // x's rows quantized by blocks: q (M, K), and d, sum(q) and d * sum(q) by (row, block)
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> sum;
};

static inline int32_t to_int8(vf v, int8_t* out) {  // v's 16 lanes rounded to the nearest int8 (ties to even); their sum
#ifdef VS_AVX512
  const __m512i i = _mm512_cvtps_epi32(v);
  _mm_storeu_si128((__m128i*)out, _mm512_cvtsepi32_epi8(i));
  return _mm512_reduce_add_epi32(i);
#else
  const __m256i i0 = _mm256_cvtps_epi32(v.lo), i1 = _mm256_cvtps_epi32(v.hi);
  const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8);
  _mm_storeu_si128((__m128i*)out, _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1)));
  __m256i s = _mm256_add_epi32(i0, i1);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
#endif
}

static void quantize_rows(const float* x, long ldx, long M, long K, Rows& r) {
  const long nb = K / QK;
  r.q.resize(M * K);
  r.d.resize(M * nb);
  r.ds.resize(M * nb);
  r.sum.resize(M * nb);
  for (long m = 0; m < M; m++)
    for (long b = 0; b < nb; b++) {
      const float* xb = x + m * ldx + b * QK;
      const vf a0 = load(xb), a1 = load(xb + 16);
      const float d = vtop(vmax(vabs(a0), vabs(a1))) / 127.0f, id = d ? 1.0f / d : 0.0f;
      int8_t* q = r.q.data() + m * K + b * QK;
      const int32_t sum = to_int8(vmul(a0, vset1(id)), q) + to_int8(vmul(a1, vset1(id)), q + 16);
      const long i = m * nb + b;
      r.d[i] = d, r.sum[i] = sum, r.ds[i] = d * (float)sum;
    }
}

static inline int32_t word(const int8_t* q) {  // four int8 as one lane's bytes
  int32_t w;
  memcpy(&w, q, 4);
  return w;
}

#ifdef VS_AVX512
// The 16 columns' integer dot products with a row's block q, one lane each.
template <Format F, int MR>
static inline void dots(const uint8_t* w, const int8_t* const* q, __m512i* isum) {
  for (int m = 0; m < MR; m++) isum[m] = _mm512_setzero_si512();
  if (F == Q8_0) {
    for (int g = 0; g < 8; g++) {
      const __m512i v = _mm512_loadu_si512(w + 64 * g);
      for (int m = 0; m < MR; m++) isum[m] = _mm512_dpbusd_epi32(isum[m], v, _mm512_set1_epi32(word(q[m] + 4 * g)));
    }
  } else {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int g = 0; g < 4; g++) {
      const __m512i v = _mm512_loadu_si512(w + 64 * g);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int m = 0; m < MR; m++) {
        isum[m] = _mm512_dpbusd_epi32(isum[m], lo, _mm512_set1_epi32(word(q[m] + 4 * g)));
        isum[m] = _mm512_dpbusd_epi32(isum[m], hi, _mm512_set1_epi32(word(q[m] + 16 + 4 * g)));
      }
    }
  }
}
static inline vf as_float(__m512i i) { return _mm512_cvtepi32_ps(i); }
static inline __m512i minus(__m512i i, int32_t k) { return _mm512_sub_epi32(i, _mm512_set1_epi32(k)); }
static inline vf halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
typedef __m512i ivec;
#else
struct ivec {
  __m256i lo, hi;
};
static inline __m256i half_dot(const uint8_t* w, const int8_t* q, Format F) {  // eight columns' dot products
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i t = _mm256_setzero_si256();
  if (F == Q8_0) {
    for (int g = 0; g < 8; g++) {
      const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + 64 * g)), _mm256_set1_epi8(-128));
      const __m256i a = _mm256_set1_epi32(word(q + 4 * g));  // qw * q as |qw| * (q with qw's sign)
      t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(a, v)), ones));
    }
  } else {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int g = 0; g < 4; g++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 64 * g));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(word(q + 4 * g))),
                                         _mm256_maddubs_epi16(hi, _mm256_set1_epi32(word(q + 16 + 4 * g))));
      t = _mm256_add_epi32(t, _mm256_madd_epi16(p, ones));
    }
  }
  return t;
}
template <Format F, int MR>
static inline void dots(const uint8_t* w, const int8_t* const* q, ivec* isum) {
  for (int m = 0; m < MR; m++) isum[m] = {half_dot(w, q[m], F), half_dot(w + 32, q[m], F)};
}
static inline vf as_float(ivec i) { return {_mm256_cvtepi32_ps(i.lo), _mm256_cvtepi32_ps(i.hi)}; }
static inline ivec minus(ivec i, int32_t k) {
  const __m256i v = _mm256_set1_epi32(k);
  return {_mm256_sub_epi32(i.lo, v), _mm256_sub_epi32(i.hi, v)};
}
static inline vf halves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))};
}
#endif

// MR rows (from row m0) by one block of 16 columns: every row takes the same instructions in the same order.
template <Format F, int MR>
static void block(const Rows& r, long m0, long K, const uint8_t* w, const float* bias, const float* res, long ldr,
                  float* y, long ldy, long cols) {
  const long nb = K / QK;
  vf acc[MR];
  for (int m = 0; m < MR; m++) acc[m] = vzero();
  for (long b = 0; b < nb; b++, w += block_bytes<F>()) {
    for (long line = 0; line < block_bytes<F>(); line += 64)
      _mm_prefetch((const char*)w + FETCH_AHEAD + line, _MM_HINT_T1);
    const int8_t* q[MR];
    for (int m = 0; m < MR; m++) q[m] = r.q.data() + (m0 + m) * K + b * QK;
    ivec isum[MR];
    dots<F, MR>(w + (F == Q4_1 ? 64 : 32), q, isum);
    const vf dw = halves(w), mw = F == Q4_1 ? halves(w + 32) : vzero();
    for (int m = 0; m < MR; m++) {
      const long i = (m0 + m) * nb + b;
      const ivec s = F == Q8_0 && Q8_OFFSET ? minus(isum[m], Q8_OFFSET * r.sum[i])
                     : F == Q4_0            ? minus(isum[m], 8 * r.sum[i])
                                            : isum[m];
      acc[m] = vfmadd(as_float(s), vmul(dw, vset1(r.d[i])), acc[m]);
      if (F == Q4_1) acc[m] = vfmadd(mw, vset1(r.ds[i]), acc[m]);
    }
  }
  for (int m = 0; m < MR; m++) {
    const vmask mk = lanes(cols);
    vf v = bias ? vadd(acc[m], load(bias, mk)) : acc[m];
    if (res) v = vadd(load(res + m * ldr, mk), v);
    store(y + m * ldy, v, mk);
  }
}

template <Format F>
static int qlinear(const int64_t* a) {  // a: x, ldx, w, bias, y, ldy, M, N, K, residual, ldr (as the float matmul)
  const float *x = ARG(const float*, 0), *bias = ARG(const float*, 3), *res = ARG(const float*, 9);
  const uint8_t* w = ARG(const uint8_t*, 2);
  float* y = ARG(float*, 4);
  const long ldx = a[1], ldy = a[5], M = a[6], N = a[7], K = a[8], ldr = a[10];
  if (K % QK) return -1;
  thread_local Rows rows;
  quantize_rows(x, ldx, M, K, rows);
  const long column_block = K / QK * block_bytes<F>();
  for (long n = 0; n < N; n += QCOLS) {
    const uint8_t* wb = w + n / QCOLS * column_block;
    const long cols = N - n < QCOLS ? N - n : QCOLS;
    const float* bn = bias ? bias + n : nullptr;
    in_row_blocks<QROWS>(M, [&](auto block_rows, long m) {
      block<F, decltype(block_rows)::value>(rows, m, K, wb, bn, res ? res + m * ldr + n : nullptr, ldr,
                                            y + m * ldy + n, ldy, cols);
    });
  }
  return 0;
}

extern "C" int vs_linear_q8_0(const int64_t* a) { return qlinear<Q8_0>(a); }
extern "C" int vs_linear_q4_0(const int64_t* a) { return qlinear<Q4_0>(a); }
extern "C" int vs_linear_q4_1(const int64_t* a) { return qlinear<Q4_1>(a); }
#endif
