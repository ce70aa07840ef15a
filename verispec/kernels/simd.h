// What verispec's CPU kernels share: the vector helpers, and the calling convention.
//
// Every kernel is `extern "C" int vs_<name>(const int64_t* a)`: its arguments (pointers, counts, strides; a float's
// bits) in one array, so that Python calls it through ctypes with one argument and a captured forward (replay.cpp)
// replays a list of such calls without Python. It returns 0, or -1 where it cannot run this call.
// Every kernel is batch-invariant by construction: a row's result is computed by the same instructions in the same
// order whatever the other rows are, how many there are, and where its keys sit. That is what exact mode needs.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;  // bfloat16 bits

#define ARG(T, i) ((T)a[i])  // the i-th argument as a T
static inline float float_arg(const int64_t* a, int i) {  // a float passed as its 32 bits
  float f;
  uint32_t bits = (uint32_t)a[i];
  memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define VS_KERNELS 1

static inline __mmask16 lanes(long n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

static inline __m512 load_bf16(const bf16* p, __mmask16 m) {  // 16 bfloat16 -> float32, lanes past m read as 0
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 load_f32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void store(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline __m512 load(const bf16* p, __mmask16 m) { return load_bf16(p, m); }
static inline __m512 load(const float* p, __mmask16 m) { return load_f32(p, m); }

static inline __m512 round_to(__m512 v, const bf16*) {  // to bfloat16 and back, as storing and loading would
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
static inline __m512 round_to(__m512 v, const float*) { return v; }

static inline __m512 exp_ps(__m512 x) {  // e^x to about 2 ulp (Cephes' expf polynomial); 0 below -88
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif
