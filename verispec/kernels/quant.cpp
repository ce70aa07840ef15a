// Block-quantized matmuls: y (M, N) = x (M, K) @ w.T (+ bias) (+ residual) for float32 rows x and a weight in one of
// ggml's formats (models/quant.py), dequantized in registers, never in memory.
//
// As ggml does for its integer dot products, each row of x is first quantized by blocks of 32 inputs: q = round(x /
// d) in int8, d = max |x| / 127, kept with d and the sums of the block's q (a row's own numbers, so the row's result
// does not depend on the others). A weight block's integer dot product with it is then taken by the CPU's int8 dot
// product (AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw and vpmaddwd), and scaled in float32:
//   Q8_0: w = dw * qw                 y += dw * d * sum(qw * q)
//   Q4_0: w = dw * (qw - 8)           y += dw * d * (sum(qw * q) - 8 * sum(q))
//   Q5_0: w = dw * (qw - 16)          y += dw * d * (sum(qw * q) - 16 * sum(q))
//   Q4_1, Q5_1: w = dw * qw + mw      y += dw * d * sum(qw * q) + mw * d * sum(q)
//   Q4_K, Q5_K: as Q4_1, Q5_1 with dw = D * sc, mw = -M * m: D, M the super-block's (256 inputs), sc, m the
//     block's 6-bit ones
//   Q6_K: w = D * sc * (qw - 32), sc by 16 inputs: each half of the block as Q5_0, with its own sc and sum(q)
// (D * sc and M * m are exact in float32: a float16 times a 6- or 8-bit integer.)
// The weight is packed (kernels/pack.cpp) in blocks of 16 output columns, and within a column block by blocks
// of 32 inputs (a K-quant's super-block first has the 16 columns' D, then M, as float16): the 16 columns' scales (dw,
// then mw, as float16; a K-quant's sc, then m or the second half's sc, as bytes), then the quants as the dot product
// takes them: groups of 4 inputs, each group the 16 columns' 4 bytes side by side. Q8_0's are qw + 128 (unsigned,
// for vpdpbusd; AVX2 takes the sign back). The others' group bytes hold inputs 4g .. 4g + 3 in their low nibbles and
// 16 + 4g .. 16 + 4g + 3 in their high ones, as ggml's Q4_0 bytes 4g .. 4g + 3 do; then the higher bits: Q5's bit 4
// as bit planes, a 64-byte vector whose byte i holds it for group g's byte i in bit 2g (the low nibble's input) and
// 2g + 1 (the high one's), so that a shift and a mask take a group's bits out; Q6_K's bits 4 and 5 as two bits per
// group byte, a 64-byte vector for two groups (bits 0-1 the first group's low nibbles' inputs, 2-3 its high ones', 4-5
// and 6-7 the second group's).
#include <vector>

#include "pool.h"
#include "simd.h"

#ifdef VS_KERNELS
enum Format { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };
static const int QCOLS = 16;  // output columns per weight block: one 16-lane accumulator per row
static const int QK = 32;     // inputs per block
// Bytes of weight asked into the L2 cache ahead of their use, by the blocks of rows `fetches` names. The weight is read
// once, front to back. A block of many rows takes long over each part of it, and without this its stream ran well
// below the memory's rate; for one row the hardware's own prefetchers stream it faster alone, and these requests
// slowed them (docs/threads.md, "The weight's prefetch").
static const long FETCH_AHEAD = 16384;
constexpr bool k_quant(Format F) { return F == Q4_K || F == Q5_K || F == Q6_K; }
constexpr bool has_min(Format F) { return F == Q4_1 || F == Q5_1 || F == Q4_K || F == Q5_K; }
constexpr bool five_bit(Format F) { return F == Q5_0 || F == Q5_1 || F == Q5_K; }
constexpr bool k_min(Format F) { return F == Q4_K || F == Q5_K; }  // dw = D * sc, mw = M * m
constexpr long head_bytes(Format F) { return F == Q4_1 || F == Q5_1 ? 64 : 32; }  // per block, before the quants
constexpr long high_bytes(Format F) { return five_bit(F) ? 64 : F == Q6_K ? 128 : 0; }
constexpr long block_bytes(Format F) { return head_bytes(F) + (F == Q8_0 ? 512 : 256) + high_bytes(F); }
constexpr int SUPER = 8;  // blocks per K-quant super-block
constexpr long super_bytes(Format F) { return k_min(F) ? 64 : F == Q6_K ? 32 : 0; }  // its header: D (and M)
constexpr int32_t offset(Format F) { return F == Q4_0 ? 8 : F == Q5_0 ? 16 : F == Q6_K ? 32 : 0; }  // qw - offset
// Q5's bit 4 of a group's bytes from its bit plane b (0..7) of v, as 0x10 or 0. The shifts are of 16-bit lanes: one
// left by at most 4 or right by at most 3 brings no bit of one byte to the other's bit 4.
template <typename V>
static inline V plane_bits(V v, int b) {
#ifdef VS_AVX512
  return _mm512_and_si512(b < 4 ? _mm512_slli_epi16(v, 4 - b) : _mm512_srli_epi16(v, b - 4), _mm512_set1_epi8(0x10));
#else
  return _mm256_and_si256(b < 4 ? _mm256_slli_epi16(v, 4 - b) : _mm256_srli_epi16(v, b - 4), _mm256_set1_epi8(0x10));
#endif
}
#ifdef VS_AVX512
static const int QROWS = 8;  // rows a block takes at once: their integer and float accumulators stay in registers
static const int SPLIT_ROWS = QROWS + 1;  // never: 32 registers hold both loops' values
static const int Q8_OFFSET = 128;  // Q8_0 quants are stored + 128 and taken unsigned
#else
static const int QROWS = 4;
static const int SPLIT_ROWS = 4;  // blocks of this many rows and more take the integer and float loops apart (block)
#ifdef VS_AVX_VNNI
static const int Q8_OFFSET = 128;  // taken unsigned, as on AVX-512
#else
static const int Q8_OFFSET = 0;  // AVX2 takes them signed
#endif
#endif
static const int FETCH_ROWS = QROWS / 2 + 1;  // blocks of this many rows and more prefetch (FETCH_AHEAD)
static const long FETCH_INPUTS = 16384;  // and from two rows, blocks whose rows hold this many inputs (MR * K) or more
// Whether a block of MR rows asks for its weight ahead: from FETCH_ROWS rows; from two, Q6_K's (its stream the
// slowest to unpack) and rows of many inputs (Qwen2.5's down projection, K = 8960: half the L1 cache and more of
// int8 inputs beside the weight), where the hardware's prefetchers fell behind alone; never for one row.
template <Format F, int MR>
static inline bool fetches(long K) {
  return MR >= FETCH_ROWS || (MR >= 2 && (F == Q6_K || MR * K >= FETCH_INPUTS));
}
// How far above their values a format's quants are stored (qw - k: the integer dot products start at -k * sum(q))
constexpr int32_t stored_offset(Format F) { return F == Q8_0 ? Q8_OFFSET : offset(F); }

// x's rows quantized by blocks: q (M, K); d and d * sum(q) by (row, block); and where the weight's quants are stored
// k above their values, the starting values of each block's integer dot products, -k * sum(q) (two a block: over the
// block and unused, or Q6_K's by halves of 16 inputs), so that they end at sum((qw - k) * q) with nothing subtracted
// after (integers: the same sums either way)
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> start;
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

// Row m by blocks of 32 inputs, for a weight whose quants are stored k above their values (`Rows`; Q6_K's `halves`)
static void quantize_row(const float* x, long ldx, long m, long K, Rows& r, int32_t k, bool halves) {
  const long nb = K / QK;
  for (long b = 0; b < nb; b++) {
    const float* xb = x + m * ldx + b * QK;
    const vf a0 = load(xb), a1 = load(xb + 16);
    const float d = vtop(vmax(vabs(a0), vabs(a1))) / 127.0f, id = d ? 1.0f / d : 0.0f;
    int8_t* q = r.q.data() + m * K + b * QK;
    const long i = m * nb + b;
    const int32_t first = to_int8(vmul(a0, vset1(id)), q), second = to_int8(vmul(a1, vset1(id)), q + 16);
    r.d[i] = d, r.ds[i] = d * (float)(first + second);
    if (k) r.start[2 * i] = -k * (halves ? first : first + second), r.start[2 * i + 1] = -k * second;
  }
}

static void quantize_rows(const float* x, long ldx, long M, long K, Rows& r, int32_t k, bool halves) {
  const long nb = K / QK;
  r.q.resize(M * K);
  r.d.resize(M * nb);
  r.ds.resize(M * nb);
  r.start.resize(k ? M * nb * 2 : 0);
  parallel(M, 16, [&](long first, long last) {  // each row alone; on the pool for a prefill's many
    for (long m = first; m < last; m++) quantize_row(x, ldx, m, K, r, k, halves);
  });
}

static inline int32_t word(const int8_t* q) {  // four int8 as one lane's bytes
  int32_t w;
  memcpy(&w, q, 4);
  return w;
}

#ifdef VS_AVX512
typedef __m512i ivec;
// Group g's quants of the 16 columns as unsigned bytes: the inputs of the low nibbles (lo), of the high ones (hi).
template <Format F>
static inline void group(const uint8_t* w, int g, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_loadu_si512(w + 64 * g), low = _mm512_set1_epi8(0x0f);
  lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  const uint8_t* h = w + 256;  // the higher bits
  if (five_bit(F)) {
    const __m512i planes = _mm512_loadu_si512(h);
    lo = _mm512_or_si512(lo, plane_bits(planes, 2 * g)), hi = _mm512_or_si512(hi, plane_bits(planes, 2 * g + 1));
  } else if (F == Q6_K) {  // bits 4-5 from a 2-bit field: (v << s) & 0x30 in 16-bit lanes, masked within each byte
    const __m512i v2 = _mm512_loadu_si512(h + 64 * (g / 2)), top = _mm512_set1_epi8(0x30);
    const __m512i l2 = g % 2 ? v2 : _mm512_slli_epi16(v2, 4), h2 = g % 2 ? _mm512_srli_epi16(v2, 2) : _mm512_slli_epi16(v2, 2);
    lo = _mm512_or_si512(lo, _mm512_and_si512(l2, top)), hi = _mm512_or_si512(hi, _mm512_and_si512(h2, top));
  }
}
// The 16 columns' integer dot products with a row's block q, one lane each: over the block (isum[0]), or, for
// Q6_K, over its first 16 inputs (isum[0]) and its last 16 (isum[1]); from the row's starting values (Rows).
template <Format F, int MR>
static inline void dots(const uint8_t* w, const int8_t* const* q, const int32_t* const* start, ivec (*isum)[MR]) {
  for (int p = 0; p < (F == Q6_K ? 2 : 1); p++)
    for (int m = 0; m < MR; m++)
      isum[p][m] = stored_offset(F) ? _mm512_set1_epi32(start[m][p]) : _mm512_setzero_si512();
  if (F == Q8_0) {
    for (int g = 0; g < 8; g++) {
      const __m512i v = _mm512_loadu_si512(w + 64 * g);
      for (int m = 0; m < MR; m++) isum[0][m] = _mm512_dpbusd_epi32(isum[0][m], v, _mm512_set1_epi32(word(q[m] + 4 * g)));
    }
    return;
  }
  for (int g = 0; g < 4; g++) {
    __m512i lo, hi;
    group<F>(w, g, lo, hi);
    for (int m = 0; m < MR; m++) {
      isum[0][m] = _mm512_dpbusd_epi32(isum[0][m], lo, _mm512_set1_epi32(word(q[m] + 4 * g)));
      ivec& second = isum[F == Q6_K][m];
      second = _mm512_dpbusd_epi32(second, hi, _mm512_set1_epi32(word(q[m] + 16 + 4 * g)));
    }
  }
}
static inline vf as_float(__m512i i) { return _mm512_cvtepi32_ps(i); }
static inline vf halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
template <typename T>
static inline vf bytes(const uint8_t* p) {  // 16 uint8 or int8 as floats
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  return _mm512_cvtepi32_ps(std::is_signed_v<T> ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}
#else
struct ivec {
  __m256i lo, hi;
};
// Group g's quants of 8 columns (the half at byte `at` of the group's 64) as unsigned bytes: the inputs of the low
// nibbles (lo), of the high ones (hi), with Q5's and Q6_K's higher bits.
template <Format F>
static inline void half_group(const uint8_t* w, int g, long at, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
  const uint8_t* h = w + 256;
  const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 64 * g + at));
  lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  if (five_bit(F)) {
    const __m256i planes = _mm256_loadu_si256((const __m256i*)(h + at));
    lo = _mm256_or_si256(lo, plane_bits(planes, 2 * g)), hi = _mm256_or_si256(hi, plane_bits(planes, 2 * g + 1));
  } else if (F == Q6_K) {
    const __m256i v2 = _mm256_loadu_si256((const __m256i*)(h + 64 * (g / 2) + at));
    const __m256i l2 = g % 2 ? v2 : _mm256_slli_epi16(v2, 4), h2 = g % 2 ? _mm256_srli_epi16(v2, 2) : _mm256_slli_epi16(v2, 2);
    lo = _mm256_or_si256(lo, _mm256_and_si256(l2, top)), hi = _mm256_or_si256(hi, _mm256_and_si256(h2, top));
  }
}
#ifdef VS_AVX_VNNI
// The 16 columns' integer dot products with MR rows' blocks q, by halves of 8 columns, as AVX-512's (vpdpbusd: four
// unsigned quants times four signed inputs, summed into a 32-bit lane), each group of a half unpacked once for all the
// rows; both halves at once where their sums fit in registers (2 * P * MR of them, at most 8). Over the block
// (isum[0]), or, for Q6_K, over its two halves (isum[0], isum[1]); from the row's starting values (Rows).
template <Format F, int MR>
static inline void dots(const uint8_t* w, const int8_t* const* q, const int32_t* const* start, ivec (*isum)[MR]) {
  constexpr int P = F == Q6_K ? 2 : 1;
  constexpr int C = 2 * P * MR <= 8 ? 2 : 1;  // halves taken together
#pragma GCC unroll 2
  for (int c0 = 0; c0 < 2; c0 += C) {
    __m256i t[C][P][MR];
    for (int c = 0; c < C; c++)
      for (int p = 0; p < P; p++)
        for (int m = 0; m < MR; m++)
          t[c][p][m] = stored_offset(F) ? _mm256_set1_epi32(start[m][p]) : _mm256_setzero_si256();
    if (F == Q8_0) {
      for (int g = 0; g < 8; g++)
        for (int c = 0; c < C; c++) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 64 * g + 32 * (c0 + c)));
          for (int m = 0; m < MR; m++)
            t[c][0][m] = _mm256_dpbusd_avx_epi32(t[c][0][m], v, _mm256_set1_epi32(word(q[m] + 4 * g)));
        }
    } else {
#pragma GCC unroll 4
      for (int g = 0; g < 4; g++) {
        __m256i lo[C], hi[C];
        for (int c = 0; c < C; c++) half_group<F>(w, g, 32 * (c0 + c), lo[c], hi[c]);
        for (int m = 0; m < MR; m++) {
          const __m256i ql = _mm256_set1_epi32(word(q[m] + 4 * g)), qh = _mm256_set1_epi32(word(q[m] + 16 + 4 * g));
          for (int c = 0; c < C; c++) {
            t[c][0][m] = _mm256_dpbusd_avx_epi32(t[c][0][m], lo[c], ql);
            t[c][P - 1][m] = _mm256_dpbusd_avx_epi32(t[c][P - 1][m], hi[c], qh);
          }
        }
      }
    }
    for (int c = 0; c < C; c++)
      for (int p = 0; p < P; p++)
        for (int m = 0; m < MR; m++) (c0 + c ? isum[p][m].hi : isum[p][m].lo) = t[c][p][m];
  }
}
#else
// Groups whose 16-bit products (a vpmaddubsw lane: two u8 quants times s8 inputs, |.| <= 2 * 127 * the largest quant)
// add up in 16 bits before vpmaddwd widens them, with no lane past 32767: 4-bit quants all 4 groups (8 x 2 x 127 x 15
// = 30480), 5-bit 2 (31496), Q6_K 2 a half (32004). Integers, so the same sums either way, in fewer instructions.
constexpr int short_groups(Format F) { return five_bit(F) || F == Q6_K ? 2 : 4; }
// The 16 columns' integer dot products with MR rows' blocks q, by halves of 8 columns: each group of a half is
// unpacked once for all the rows. Over the block (isum[0]), or, for Q6_K, over its two halves (isum[0], isum[1]).
// For several rows, where the sums of both halves fit in registers (2 * P * MR of them, at most 8), the halves are
// taken together, so that a row's inputs are broadcast once for both; else one after the other (and for one row, where
// sharing its one broadcast saves less than holding both halves' sums costs). From the row's starting values (Rows).
template <Format F, int MR>
static inline void dots(const uint8_t* w, const int8_t* const* q, const int32_t* const* start, ivec (*isum)[MR]) {
  constexpr int P = F == Q6_K ? 2 : 1;
  constexpr int G = short_groups(F);
  constexpr int C = F != Q8_0 && MR > 1 && 2 * P * MR <= 8 ? 2 : 1;  // halves taken together
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 2  // whole, so that s and t are registers, not a stack array indexed by the loop's counters
  for (int c0 = 0; c0 < 2; c0 += C) {
    __m256i t[C][P][MR], s[C][P][MR];  // s: 16-bit sums of the products since the last widening to 32 bits
    if (F == Q8_0) {
      for (int m = 0; m < MR; m++) t[0][0][m] = _mm256_setzero_si256();
      for (int g = 0; g < 8; g++) {
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + 64 * g + 32 * c0)), _mm256_set1_epi8(-128));
        const __m256i magnitude = _mm256_abs_epi8(v);
        for (int m = 0; m < MR; m++) {  // qw * q as |qw| * (q with qw's sign)
          const __m256i a = _mm256_sign_epi8(_mm256_set1_epi32(word(q[m] + 4 * g)), v);
          t[0][0][m] = _mm256_add_epi32(t[0][0][m], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, a), ones));
        }
      }
    } else {
#pragma GCC unroll 4
      for (int g = 0; g < 4; g++) {
        __m256i lo[C], hi[C];
        for (int c = 0; c < C; c++) half_group<F>(w, g, 32 * (c0 + c), lo[c], hi[c]);
        for (int m = 0; m < MR; m++) {
          const __m256i ql = _mm256_set1_epi32(word(q[m] + 4 * g)), qh = _mm256_set1_epi32(word(q[m] + 16 + 4 * g));
          for (int c = 0; c < C; c++) {
            const __m256i pl = _mm256_maddubs_epi16(lo[c], ql), ph = _mm256_maddubs_epi16(hi[c], qh);
            const __m256i x[2] = {F == Q6_K ? pl : _mm256_add_epi16(pl, ph), ph};
            for (int p = 0; p < P; p++) {
              s[c][p][m] = g % G ? _mm256_add_epi16(s[c][p][m], x[p]) : x[p];
              if (g % G < G - 1) continue;
              const __m256i wide = _mm256_madd_epi16(s[c][p][m], ones);
              const __m256i first = stored_offset(F) ? _mm256_add_epi32(_mm256_set1_epi32(start[m][p]), wide) : wide;
              t[c][p][m] = g < G ? first : _mm256_add_epi32(t[c][p][m], wide);  // (every t is set by the first widening)
            }
          }
        }
      }
    }
    for (int c = 0; c < C; c++)
      for (int p = 0; p < P; p++)
        for (int m = 0; m < MR; m++) (c0 + c ? isum[p][m].hi : isum[p][m].lo) = t[c][p][m];
  }
}
#endif  // VS_AVX_VNNI
static inline vf as_float(ivec i) { return {_mm256_cvtepi32_ps(i.lo), _mm256_cvtepi32_ps(i.hi)}; }
static inline vf halves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))};
}
template <typename T>
static inline vf bytes(const uint8_t* p) {  // 16 uint8 or int8 as floats
  const __m128i b0 = _mm_loadl_epi64((const __m128i*)p), b1 = _mm_loadl_epi64((const __m128i*)(p + 8));
  if (std::is_signed_v<T>) return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1))};
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b0)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b1))};
}
#endif

// MR rows (from row m0) by one block of 16 columns: every row takes the same instructions in the same order. On
// AVX2, for the full blocks of QROWS rows, every block's integer dot products come first (into `sums`), then their
// float sums: apart, each loop's values fit in AVX2's 16 registers (together they spilled). The same instructions
// per row either way, so the same bits.
template <Format F, int MR>
static void block(const Rows& r, long m0, long K, const uint8_t* w0, const float* bias, const float* res, long ldr,
                  float* y, long ldy, long cols) {
  const long nb = K / QK;
  constexpr bool apart = SPLIT_ROWS <= MR;
  constexpr int P = F == Q6_K ? 2 : 1;  // dot products per row and block (Q6_K: one per half)
  const bool fetch = fetches<F, MR>(K);
  const auto take = [&](long b, const uint8_t* w, ivec (*isum)[MR]) {  // block b's (at w) integer dot products
    if (fetch)
      for (long line = 0; line < block_bytes(F); line += 64)
        _mm_prefetch((const char*)w + FETCH_AHEAD + line, _MM_HINT_T1);
    const int8_t* q[MR];
    const int32_t* start[MR];
    for (int m = 0; m < MR; m++) {
      q[m] = r.q.data() + (m0 + m) * K + b * QK;
      start[m] = stored_offset(F) ? r.start.data() + 2 * ((m0 + m) * nb + b) : nullptr;
    }
    dots<F, MR>(w + head_bytes(F), q, start, isum);
  };
  ivec* sums = nullptr;  // apart: every block's integer dot products, P * MR a block
  const uint8_t* w = w0;
  if constexpr (apart) {
    thread_local std::vector<char> space;  // (a char buffer aligned by hand: ivec is over-aligned)
    space.resize(nb * P * MR * sizeof(ivec) + 64);
    sums = (ivec*)(((uintptr_t)space.data() + 63) & ~(uintptr_t)63);
    for (long b = 0; b < nb; b++, w += block_bytes(F)) {
      if (k_quant(F) && b % SUPER == 0) w += super_bytes(F);
      take(b, w, (ivec(*)[MR])(sums + b * P * MR));
    }
    w = w0;
  }
  vf acc[MR], D = vzero(), M = vzero();
  for (int m = 0; m < MR; m++) acc[m] = vzero();
  for (long b = 0; b < nb; b++, w += block_bytes(F)) {
    if (k_quant(F) && b % SUPER == 0) {  // a super-block's header
      D = halves(w);
      if (k_min(F)) M = halves(w + 32);
      w += super_bytes(F);
    }
    ivec here[2][MR];
    if constexpr (!apart) take(b, w, here);
    const ivec(*isum)[MR] = apart ? (const ivec(*)[MR])(sums + b * P * MR) : here;
    // The block's scales: dw (and mw, or for Q6_K the second half's dw)
    const vf dw = k_min(F) ? vmul(D, bytes<uint8_t>(w)) : F == Q6_K ? vmul(D, bytes<int8_t>(w)) : halves(w);
    const vf mw = k_min(F) ? vmul(M, bytes<uint8_t>(w + 16)) : F == Q6_K ? vmul(D, bytes<int8_t>(w + 16))
                  : has_min(F) ? halves(w + 32) : vzero();
    for (int m = 0; m < MR; m++) {
      const long i = (m0 + m) * nb + b;
      const vf d = vset1(r.d[i]);
      acc[m] = vfmadd(as_float(isum[0][m]), vmul(dw, d), acc[m]);
      if (F == Q6_K) {
        acc[m] = vfmadd(as_float(isum[1][m]), vmul(mw, d), acc[m]);
        continue;
      }
      if (k_min(F)) acc[m] = vfnmadd(mw, vset1(r.ds[i]), acc[m]);
      else if (has_min(F)) acc[m] = vfmadd(mw, vset1(r.ds[i]), acc[m]);
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
  if (K % (k_quant(F) ? QK * SUPER : QK)) return -1;
  thread_local Rows mine;
  Rows& rows = mine;  // (the caller's, also where the pool's threads read it: a thread-local named there is theirs)
  quantize_rows(x, ldx, M, K, rows, stored_offset(F), F == Q6_K);
  const long column_block = K / QK * block_bytes(F) + (k_quant(F) ? K / (QK * SUPER) * super_bytes(F) : 0);
  parallel((N + QCOLS - 1) / QCOLS, 4, [&](long first, long last) {  // column blocks on the pool
    for (long n = first * QCOLS; n < last * QCOLS && n < N; n += QCOLS) {
      const uint8_t* wb = w + n / QCOLS * column_block;
      const long cols = N - n < QCOLS ? N - n : QCOLS;
      const float* bn = bias ? bias + n : nullptr;
      in_row_blocks<QROWS>(M, [&](auto block_rows, long m) {
        block<F, decltype(block_rows)::value>(rows, m, K, wb, bn, res ? res + m * ldr + n : nullptr, ldr,
                                              y + m * ldy + n, ldy, cols);
      });
    }
  });
  return 0;
}

extern "C" int vs_linear_q8_0(const int64_t* a) { return qlinear<Q8_0>(a); }
extern "C" int vs_linear_q4_0(const int64_t* a) { return qlinear<Q4_0>(a); }
extern "C" int vs_linear_q4_1(const int64_t* a) { return qlinear<Q4_1>(a); }
extern "C" int vs_linear_q5_0(const int64_t* a) { return qlinear<Q5_0>(a); }
extern "C" int vs_linear_q5_1(const int64_t* a) { return qlinear<Q5_1>(a); }
extern "C" int vs_linear_q4_k(const int64_t* a) { return qlinear<Q4_K>(a); }
extern "C" int vs_linear_q5_k(const int64_t* a) { return qlinear<Q5_K>(a); }
extern "C" int vs_linear_q6_k(const int64_t* a) { return qlinear<Q6_K>(a); }
#endif
