// The matmul: y (M, N) = x (M, K) @ w.T (+ bias) (+ residual), w packed once (kernels/__init__.py `pack`) into
// blocks of 64 output columns and streamed once for every six rows: at one to four rows a forward is the time to
// read its weights. bfloat16 weights are packed as [N/64][K/2][64][2] (at each pair of inputs, the 64 columns' two
// weights side by side, as the dot-product instruction takes them), float32 ones as [N/64][K][64]; zero-padded.
// A residual is added as `residual + linear(x)` would add it: to the product rounded to the dtype.
#include "simd.h"

#ifdef VS_KERNELS
static const int COLS = 64;  // output columns per weight block: four 16-lane accumulators per row

template <int MR, typename T>
static inline void finish(__m512 (&acc)[MR][4], const float* bias, const T* res, long ldr, T* y, long ldy, long cols) {
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < 4 && j * 16 < cols; j++) {
      __mmask16 mk = lanes(cols - j * 16);
      __m512 v = bias ? _mm512_add_ps(acc[m][j], load_f32(bias + j * 16, mk)) : acc[m][j];
      if (res) v = _mm512_add_ps(load(res + m * ldr + j * 16, mk), round_to(v, (const T*)0));
      store(y + m * ldy + j * 16, v, mk);
    }
}

template <int MR>
static void block(const bf16* x, long ldx, const bf16* w, const float* bias, const bf16* res, long ldr, bf16* y,
                       long ldy, long K, long cols) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
  for (long p = 0; p < (K + 1) / 2; p++, w += 2 * COLS) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int m = 0; m < MR; m++) {
      uint32_t pair = x[m * ldx + 2 * p];  // an odd K's last pair is (x, 0)
      if (2 * p + 1 < K) memcpy(&pair, x + m * ldx + 2 * p, 4);
      __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
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
  __m512 acc[MR][4];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
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

// Rows six at a time (24 accumulators and 4 weight vectors fill the 32 registers), then the last one to five: each
// accumulator sees the same instructions, in the same order, whatever block its row falls in.
template <typename T>
static int linear(const int64_t* a, long block_size) {  // a: x, ldx, w, bias, y, ldy, M, N, K, residual, ldr
  const T *x = ARG(const T*, 0), *w = ARG(const T*, 2), *res = ARG(const T*, 9);
  const float* bias = ARG(const float*, 3);
  T* y = ARG(T*, 4);
  const long ldx = a[1], ldy = a[5], M = a[6], N = a[7], K = a[8], ldr = a[10];
  for (long n = 0; n < N; n += COLS) {
    const T* wb = w + n / COLS * block_size;
    const long cols = N - n < COLS ? N - n : COLS;
    const float* bn = bias ? bias + n : nullptr;
#define BLOCK(MR) \
  block<MR>(x + m * ldx, ldx, wb, bn, res ? res + m * ldr + n : nullptr, ldr, y + m * ldy + n, ldy, K, cols)
    long m = 0;
    for (; m + 6 <= M; m += 6) BLOCK(6);
    switch (M - m) {
      case 5: BLOCK(5); break;
      case 4: BLOCK(4); break;
      case 3: BLOCK(3); break;
      case 2: BLOCK(2); break;
      case 1: BLOCK(1); break;
    }
#undef BLOCK
  }
  return 0;
}

extern "C" int vs_linear_bf16(const int64_t* a) { return linear<bf16>(a, (a[8] + 1) / 2 * 2 * COLS); }
extern "C" int vs_linear_f32(const int64_t* a) { return linear<float>(a, a[8] * COLS); }
#endif
