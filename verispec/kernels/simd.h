// What verispec's CPU kernels share: a 16-lane float vector for each instruction set, and the calling convention.
//
// Every kernel is `extern "C" int vs_<name>(const int64_t* a)`: its arguments (pointers, counts, strides; a float's
// bits) in one array, so that Python calls it through ctypes with one argument and a captured forward (replay.cpp)
// replays a list of such calls without Python. It returns 0, or -1 where it cannot run this call.
// Every kernel is batch-invariant by construction: a row's result is computed by the same instructions in the same
// order whatever the other rows are, how many there are, and where its keys sit. That is what exact mode needs.
//
// The library is built once per instruction set (kernels/build.py), from the same sources:
// - VS_AVX512: AVX-512 (F, BW, VL, DQ) with bfloat16 dot products and VNNI (Zen 4, Sapphire Rapids and later);
// - VS_AVX2: x86-64-v3 (AVX2, FMA, F16C): `vf` is two 8-lane halves, bfloat16 is widened to float32; with AVX-VNNI
//   (VS_AVX_VNNI: Intel Alder Lake and later) the quantized matmul's int8 dot products take vpdpbusd on 256 bits.
// The kernels are written once against `vf` (16 float lanes) and `vmask` (the first n lanes); what only one set
// does fast (the matmuls' inner loops, the attention's score reduction) has a version for each.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

typedef uint16_t bf16;  // bfloat16 bits
enum class f16 : uint16_t {};  // float16 bits (a type of its own: loads and stores convert by the type)

#define ARG(T, i) ((T)a[i])  // the i-th argument as a T
// AVX2's vf is a struct of two 256-bit halves: passed by value to a call that is not inlined, GCC 12 can leave it on a
// stack slot it then reads as 32-byte aligned when it is not (a crash once the pool ran the kernels); always inlined,
// it never is.
#define VS_INLINE inline __attribute__((always_inline))
static inline float float_arg(const int64_t* a, int i) {  // a float passed as its 32 bits
  float f;
  uint32_t bits = (uint32_t)a[i];
  memcpy(&f, &bits, 4);
  return f;
}

// M rows in blocks: `block(rows, m)` for rows m .. m + rows - 1, MAX rows at a time, then the last M % MAX at once,
// `rows` a compile-time count (std::integral_constant) so that a block's accumulators stay in registers. A row takes
// the same instructions in the same order whatever block it falls in: the matmuls' batch invariance.
template <int N, typename Block>
static inline void last_rows(long left, long m, Block& block) {
  if constexpr (N > 0) {
    if (left == N)
      block(std::integral_constant<int, N>(), m);
    else
      last_rows<N - 1>(left, m, block);
  }
}
template <int MAX, typename Block>
static inline void in_row_blocks(long M, Block block) {
  long m = 0;
  for (; m + MAX <= M; m += MAX) block(std::integral_constant<int, MAX>(), m);
  last_rows<MAX - 1>(M - m, m, block);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define VS_KERNELS 1
#define VS_AVX512 1
static const char VS_ISA[] = "avx512";

typedef __m512 vf;
typedef __mmask16 vmask;

static inline vmask lanes(long n) { return n >= 16 ? (vmask)0xffff : (vmask)((1u << n) - 1); }
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, rounded once
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, rounded once
static inline vf vneg(vf a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.0f)); }
static inline vf vabs(vf a) { return _mm512_andnot_ps(_mm512_set1_ps(-0.0f), a); }
static inline vf vkeep(vmask m, vf a) { return _mm512_maskz_mov_ps(m, a); }  // a's lanes in m, 0 elsewhere
static inline vf vmax_in(vmask m, vf a, vf b) { return _mm512_mask_max_ps(a, m, a, b); }  // max in m, a elsewhere
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vtop(vf a) { return _mm512_reduce_max_ps(a); }
static inline uint32_t vnan_bits(vmask m, vf a) { return _mm512_mask_cmp_ps_mask(m, a, a, _CMP_UNORD_Q); }
static inline uint32_t veq_bits(vmask m, vf a, vf b) { return _mm512_mask_cmp_ps_mask(m, a, b, _CMP_EQ_OQ); }

static inline vf load(const float* p, vmask m) { return _mm512_maskz_loadu_ps(m, p); }
static inline vf load(const bf16* p, vmask m) {  // lanes past m read as 0
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline void store(float* p, vf v, vmask m) { _mm512_mask_storeu_ps(p, m, v); }
static inline void store(bf16* p, vf v, vmask m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline vf load(const f16* p, vmask m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
static inline void store(f16* p, vf v, vmask m) {  // to nearest even, as torch's .half() (saturate_f16 first)
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf round_to(vf v, const bf16*) {  // to bfloat16 and back, as storing and loading would
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VS_KERNELS 1
#define VS_AVX2 1
#ifdef __AVXVNNI__
#define VS_AVX_VNNI 1  // AVX-VNNI: the int8 dot product of 4 bytes on 256 bits (vpdpbusd, VEX)
static const char VS_ISA[] = "avx2vnni";
#else
static const char VS_ISA[] = "avx2";
#endif

struct vf {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
struct vmask {
  __m256i lo, hi;  // all ones in the lanes taken
  int n;           // the first n lanes
};

static VS_INLINE vmask lanes(long n) {
  const int k = n >= 16 ? 16 : (int)n;
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return {_mm256_cmpgt_epi32(_mm256_set1_epi32(k), index), _mm256_cmpgt_epi32(_mm256_set1_epi32(k - 8), index), k};
}
#define VS_2(op) \
  { op(a.lo, b.lo), op(a.hi, b.hi) }
static VS_INLINE vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static VS_INLINE vf vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static VS_INLINE vf vadd(vf a, vf b) { return VS_2(_mm256_add_ps); }
static VS_INLINE vf vsub(vf a, vf b) { return VS_2(_mm256_sub_ps); }
static VS_INLINE vf vmul(vf a, vf b) { return VS_2(_mm256_mul_ps); }
static VS_INLINE vf vdiv(vf a, vf b) { return VS_2(_mm256_div_ps); }
static VS_INLINE vf vmax(vf a, vf b) { return VS_2(_mm256_max_ps); }
static VS_INLINE vf vmin(vf a, vf b) { return VS_2(_mm256_min_ps); }
static VS_INLINE vf vfmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static VS_INLINE vf vfnmadd(vf a, vf b, vf c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static VS_INLINE vf vneg(vf a) { return {_mm256_xor_ps(a.lo, _mm256_set1_ps(-0.0f)), _mm256_xor_ps(a.hi, _mm256_set1_ps(-0.0f))}; }
static VS_INLINE vf vabs(vf a) {
  return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.lo), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.hi)};
}
static VS_INLINE vf vkeep(vmask m, vf a) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(m.lo)), _mm256_and_ps(a.hi, _mm256_castsi256_ps(m.hi))};
}
static VS_INLINE vf vmax_in(vmask m, vf a, vf b) {
  return {_mm256_blendv_ps(a.lo, _mm256_max_ps(a.lo, b.lo), _mm256_castsi256_ps(m.lo)),
          _mm256_blendv_ps(a.hi, _mm256_max_ps(a.hi, b.hi), _mm256_castsi256_ps(m.hi))};
}
static VS_INLINE vf vround(vf a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
static VS_INLINE __m256 scale2(__m256 p, __m256 n) {  // p * 2^n for integral n in [-256, 256], as two powers in range
  const __m256i e = _mm256_cvtps_epi32(n), e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, _mm256_set1_epi32(127)), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
static VS_INLINE vf vscale2(vf p, vf n) { return {scale2(p.lo, n.lo), scale2(p.hi, n.hi)}; }
static VS_INLINE float hsum8(__m256 a) {  // lanes summed by halves, as _mm512_reduce_add_ps does on AVX-512
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static VS_INLINE float hmax8(__m256 a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static VS_INLINE float vsum(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
static VS_INLINE float vtop(vf a) { return hmax8(_mm256_max_ps(a.lo, a.hi)); }
static VS_INLINE uint32_t bits(__m256 lo, __m256 hi) {
  return (uint32_t)_mm256_movemask_ps(lo) | (uint32_t)_mm256_movemask_ps(hi) << 8;
}
static VS_INLINE uint32_t vnan_bits(vmask m, vf a) {
  return bits(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)) & ((1u << m.n) - 1);
}
static VS_INLINE uint32_t veq_bits(vmask m, vf a, vf b) {
  return bits(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)) & ((1u << m.n) - 1);
}

static VS_INLINE __m256 widen(__m128i h) {  // 8 bfloat16 -> float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static VS_INLINE __m128i narrow(__m256 v) {  // 8 float32 -> bfloat16, rounded to nearest even (NaN -> 0x7fc0, as torch)
  const __m256i x = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
static VS_INLINE vf load(const float* p, vmask m) {
  if (m.n == 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)};
}
static VS_INLINE vf load(const bf16* p, vmask m) {  // lanes past m read as 0
  if (m.n < 16) {  // (the copy zeroed only here: hoisted, zeroing it cost every full load two stores)
    bf16 part[16] = {0};
    return load((const bf16*)memcpy(part, p, 2 * m.n), lanes(16));
  }
  return {widen(_mm_loadu_si128((const __m128i*)p)), widen(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
static VS_INLINE void store(float* p, vf v, vmask m) {
  if (m.n == 16) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
  } else {
    _mm256_maskstore_ps(p, m.lo, v.lo);
    _mm256_maskstore_ps(p + 8, m.hi, v.hi);
  }
}
static VS_INLINE void store_halves(void* p, __m256i both, vmask m) {  // the first m.n of 16 two-byte lanes
  if (m.n == 16) {
    _mm256_storeu_si256((__m256i*)p, both);
  } else {
    uint16_t part[16];
    _mm256_storeu_si256((__m256i*)part, both);
    memcpy(p, part, 2 * m.n);
  }
}
static VS_INLINE void store(bf16* p, vf v, vmask m) { store_halves(p, _mm256_set_m128i(narrow(v.hi), narrow(v.lo)), m); }
static VS_INLINE vf round_to(vf v, const bf16*) { return {widen(narrow(v.lo)), widen(narrow(v.hi))}; }
static VS_INLINE vf load(const f16* p, vmask m) {  // lanes past m read as 0
  if (m.n < 16) {  // (as bfloat16's: the copy zeroed only where it is made)
    f16 part[16] = {};
    return load((const f16*)memcpy(part, p, 2 * m.n), lanes(16));
  }
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
static VS_INLINE void store(f16* p, vf v, vmask m) {  // to nearest even, as torch's .half() (saturate_f16 first)
  store_halves(p, _mm256_set_m128i(_mm256_cvtps_ph(v.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                   _mm256_cvtps_ph(v.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), m);
}
#undef VS_2
#endif

#ifdef VS_KERNELS
static inline vf load(const float* p) { return load(p, lanes(16)); }
// Into float16's finite range (a NaN stays NaN: maxps and minps return their second operand then), as
// models/cache.py `saturate_f16` does: a cache slot never holds an infinity, which PyTorch's attention, multiplying
// the zero weights of unseen slots by their values, would turn into NaN.
static inline vf saturate_f16(vf v) { return vmin(vset1(65504.0f), vmax(vset1(-65504.0f), v)); }
static inline vf round_to(vf v, const float*) { return v; }

static inline vf exp_ps(vf x) {  // e^x to about 2 ulp (Cephes' expf polynomial); 0 below -88, inf past 88.7
  x = vmax(x, vset1(-88.0f));
  x = vmin(x, vset1(128.0f));  // n stays in the range vscale2 takes
  vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  vf p = vset1(1.9875691500e-4f);
  p = vfmadd(p, r, vset1(1.3981999507e-3f));
  p = vfmadd(p, r, vset1(8.3334519073e-3f));
  p = vfmadd(p, r, vset1(4.1665795894e-2f));
  p = vfmadd(p, r, vset1(1.6666665459e-1f));
  p = vfmadd(p, r, vset1(5.0000001201e-1f));
  p = vfmadd(vmul(p, r), r, vadd(r, vset1(1.0f)));
  return vscale2(p, n);
}
#endif
