// The matmul: y (M, N) = x (M, K) @ w.T (+ bias) (+ residual), w packed once (kernels/__init__.py `pack`) into
// blocks of COLS output columns and streamed once for every few rows: at one to four rows a forward is the time to
// read its weights. bfloat16 weights are packed as [N/COLS][K/2][COLS][2] (at each pair of inputs, the columns' two
// weights side by side, as AVX-512's dot-product instruction takes them), float32 ones as [N/COLS][K][COLS];
// zero-padded. A residual is added as `residual + linear(x)` would add it: to the product rounded to the dtype.
#include "pool.h"
#include "simd.h"

#ifdef VS_KERNELS
#ifdef VS_AVX512
static const int COLS = 64;  // output columns per weight block: four 16-lane accumulators per row
static const int MAX_ROWS = 6;  // rows a block takes: 24 accumulators and 4 weight vectors fill the 32 registers
#else
static const int COLS = 16;  // two 8-lane accumulators per row
static const int MAX_ROWS = 4;  // rows a block takes, in the 16 registers
#endif
static const int ACC = COLS / 16;  // 16-lane accumulators per row

template <int MR, typename T>
static inline void finish(vf (&acc)[MR][ACC], const float* bias, const T* res, long ldr, T* y, long ldy, long cols) {
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < ACC && j * 16 < cols; j++) {
      const vmask mk = lanes(cols - j * 16);
      vf v = bias ? vadd(acc[m][j], load(bias + j * 16, mk)) : acc[m][j];
      if (res) v = vadd(load(res + m * ldr + j * 16, mk), round_to(v, (const T*)0));
      store(y + m * ldy + j * 16, v, mk);
    }
}

static inline uint32_t pair_at(const bf16* x, long p, long K) {  // inputs 2p, 2p + 1; an odd K's last pair is (x, 0)
  uint32_t pair = x[2 * p];
  if (2 * p + 1 < K) memcpy(&pair, x + 2 * p, 4);
  return pair;
}

#ifdef VS_AVX512
template <int MR>
static void block(const bf16* x, long ldx, const bf16* w, const float* bias, const bf16* res, long ldr, bf16* y,
                  long ldy, long K, long cols) {
  vf acc[MR][ACC];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < ACC; j++) acc[m][j] = vzero();
  for (long p = 0; p < (K + 1) / 2; p++, w += 2 * COLS) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int m = 0; m < MR; m++) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair_at(x + m * ldx, p, K));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xv, w2);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], xv, w3);
    }
  }
  finish<MR>(acc, bias, res, ldr, y, ldy, cols);
}

template <int MR>
static void block(const float* x, long ldx, const float* w, const float* bias, const float* res, long ldr,
                  float* y, long ldy, long K, long cols) {
  vf acc[MR][ACC];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < ACC; j++) acc[m][j] = vzero();
  for (long k = 0; k < K; k++, w += COLS) {
    __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32),
           w3 = _mm512_loadu_ps(w + 48);
    for (int m = 0; m < MR; m++) {
      __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xv, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(xv, w3, acc[m][3]);
    }
  }
  finish<MR>(acc, bias, res, ldr, y, ldy, cols);
}
#else
// bfloat16 widened to float32: at each pair of inputs a 256-bit load holds eight columns' two weights, the even
// input's in the low half of each lane and the odd one's in the high half; the even product is added first.
template <int MR>
static void block(const bf16* x, long ldx, const bf16* w, const float* bias, const bf16* res, long ldr, bf16* y,
                  long ldy, long K, long cols) {
  vf acc[MR][ACC];
  for (int m = 0; m < MR; m++) acc[m][0] = vzero();
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  for (long p = 0; p < (K + 1) / 2; p++, w += 2 * COLS) {
    const __m256i v0 = _mm256_loadu_si256((const __m256i*)w), v1 = _mm256_loadu_si256((const __m256i*)(w + 16));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
    for (int m = 0; m < MR; m++) {
      const __m256i xp = _mm256_set1_epi32((int)pair_at(x + m * ldx, p, K));
      const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xp, 16)), xo = _mm256_castsi256_ps(_mm256_and_si256(xp, high));
      acc[m][0].lo = _mm256_fmadd_ps(xo, o0, _mm256_fmadd_ps(xe, e0, acc[m][0].lo));
      acc[m][0].hi = _mm256_fmadd_ps(xo, o1, _mm256_fmadd_ps(xe, e1, acc[m][0].hi));
    }
  }
  finish<MR>(acc, bias, res, ldr, y, ldy, cols);
}

template <int MR>
static void block(const float* x, long ldx, const float* w, const float* bias, const float* res, long ldr,
                  float* y, long ldy, long K, long cols) {
  vf acc[MR][ACC];
  for (int m = 0; m < MR; m++) acc[m][0] = vzero();
  for (long k = 0; k < K; k++, w += COLS) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    for (int m = 0; m < MR; m++) {
      const __m256 xv = _mm256_set1_ps(x[m * ldx + k]);
      acc[m][0].lo = _mm256_fmadd_ps(xv, w0, acc[m][0].lo);
      acc[m][0].hi = _mm256_fmadd_ps(xv, w1, acc[m][0].hi);
    }
  }
  finish<MR>(acc, bias, res, ldr, y, ldy, cols);
}
#endif

template <typename T>
static int linear(const int64_t* a, long block_size) {  // a: x, ldx, w, bias, y, ldy, M, N, K, residual, ldr
  const T *x = ARG(const T*, 0), *w = ARG(const T*, 2), *res = ARG(const T*, 9);
  const float* bias = ARG(const float*, 3);
  T* y = ARG(T*, 4);
  const long ldx = a[1], ldy = a[5], M = a[6], N = a[7], K = a[8], ldr = a[10];
  parallel((N + COLS - 1) / COLS, 1, [&](long first, long last) {
    for (long n = first * COLS; n < last * COLS && n < N; n += COLS) {
      const T* wb = w + n / COLS * block_size;
      const long cols = N - n < COLS ? N - n : COLS;
      const float* bn = bias ? bias + n : nullptr;
      in_row_blocks<MAX_ROWS>(M, [&](auto rows, long m) {
        block<decltype(rows)::value>(x + m * ldx, ldx, wb, bn, res ? res + m * ldr + n : nullptr, ldr,
                                     y + m * ldy + n, ldy, K, cols);
      });
    }
  });
  return 0;
}

extern "C" int vs_linear_bf16(const int64_t* a) { return linear<bf16>(a, (a[8] + 1) / 2 * 2 * COLS); }
extern "C" int vs_linear_f32(const int64_t* a) { return linear<float>(a, a[8] * COLS); }
extern "C" long vs_cols() { return COLS; }  // the weight blocks' width, which `pack` lays them out by
#endif
