// verispec's CPU kernels: a matmul that streams its weight once for up to six rows at a time, and attention over
// each row's own visible keys. Both are batch-invariant by construction: a row's result is computed by the same
// instructions in the same order whatever the other rows are, how many there are, and where its keys sit. That is
// what exact mode needs (models/row_floor.py measures it), and streaming the weight once is what a decoding step
// needs: at one to four rows a forward is the time to read its weights.
//
// Built at first use with the system's C++ compiler for this machine (-march=native; kernels/build.py) and called
// through ctypes on tensors' data pointers. Every function returns 0 on success, -1 where this build lacks the
// instructions (the caller then keeps PyTorch's kernels).
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <vector>

typedef uint16_t bf16;  // bfloat16 bits

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define VS_KERNELS 1
extern "C" int vs_available() { return 1; }
#else
extern "C" int vs_available() { return 0; }
#endif

#ifdef VS_KERNELS
static const int COLS = 64;  // output columns per weight block: four 16-lane accumulators per row

static inline __mmask16 lanes(long n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

static inline __m512 load_bf16(const bf16* p, __mmask16 m) {  // 16 bfloat16 -> float32, lanes past m read as 0
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 load_f32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void store(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline __m512 load(const bf16* p, __mmask16 m) { return load_bf16(p, m); }
static inline __m512 load(const float* p, __mmask16 m) { return load_f32(p, m); }

// ---- matmul: y (M, N) = x (M, K) @ w.T (+ bias), w packed by vs_pack_* --------------------------------------------
// bfloat16 weights are packed as [N/64][K/2][64][2]: at each pair of inputs, the 64 columns' two weights sit side by
// side, as the dot-product instruction takes them; float32 as [N/64][K][64]. The block's rows are zero-padded.

template <int MR>
static void block_bf16(const bf16* x, long ldx, const bf16* w, const float* bias, bf16* y, long ldy, long K,
                       long cols) {
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
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < 4 && j * 16 < cols; j++) {
      __mmask16 mk = lanes(cols - j * 16);
      __m512 v = bias ? _mm512_add_ps(acc[m][j], load_f32(bias + j * 16, mk)) : acc[m][j];
      store(y + m * ldy + j * 16, v, mk);
    }
}

template <int MR, typename T>
static void block_f32(const T* x, long ldx, const float* w, const float* bias, T* y, long ldy, long K, long cols) {
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
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < 4 && j * 16 < cols; j++) {
      __mmask16 mk = lanes(cols - j * 16);
      __m512 v = bias ? _mm512_add_ps(acc[m][j], load_f32(bias + j * 16, mk)) : acc[m][j];
      store(y + m * ldy + j * 16, v, mk);
    }
}

// Rows six at a time (24 accumulators and 4 weight vectors fill the 32 registers), then the last one to five: each
// accumulator sees the same instructions, in the same order, whatever block its row falls in.
#define ROWS_IN_SIXES(BLOCK, ...)                                        \
  long m = 0;                                                            \
  for (; m + 6 <= M; m += 6) BLOCK<6 __VA_ARGS__>(ARGS);                 \
  switch (M - m) {                                                       \
    case 5: BLOCK<5 __VA_ARGS__>(ARGS); break;                           \
    case 4: BLOCK<4 __VA_ARGS__>(ARGS); break;                           \
    case 3: BLOCK<3 __VA_ARGS__>(ARGS); break;                           \
    case 2: BLOCK<2 __VA_ARGS__>(ARGS); break;                           \
    case 1: BLOCK<1 __VA_ARGS__>(ARGS); break;                           \
  }
#define ARGS x + m * ldx, ldx, wb, bias ? bias + n : nullptr, y + m * ldy + n, ldy, K, cols

extern "C" int vs_linear_bf16(const bf16* x, long ldx, const bf16* w, const float* bias, bf16* y, long ldy, long M,
                              long N, long K) {
  const long block = (K + 1) / 2 * 2 * COLS;
  for (long n = 0; n < N; n += COLS) {
    const bf16* wb = w + n / COLS * block;
    const long cols = N - n < COLS ? N - n : COLS;
    ROWS_IN_SIXES(block_bf16)
  }
  return 0;
}

extern "C" int vs_linear_f32(const float* x, long ldx, const float* w, const float* bias, float* y, long ldy, long M,
                             long N, long K) {
  for (long n = 0; n < N; n += COLS) {
    const float* wb = w + n / COLS * K * COLS;
    const long cols = N - n < COLS ? N - n : COLS;
    ROWS_IN_SIXES(block_f32, , float)
  }
  return 0;
}
#undef ARGS

// ---- attention ---------------------------------------------------------------------------------------------------
// y[r, h] = softmax(q[r, h] . k[s] / sqrt(D) over the slots s that row r sees) @ v, with the keys taken in slot order
// and the unseen ones skipped, not masked: a row that sees the same keys (a token decoded alone, in a chain, in a
// tree whose nodes sit past their positions) adds the same numbers in the same order.

static inline __m512 exp_ps(__m512 x) {  // e^x for x <= 0, to about 2 ulp (Cephes' expf polynomial)
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

static const int MAX_LANES = 16;  // head_dim up to 256

// Sixteen vectors -> one: lane j holds the sum of a[j]'s lanes, by a fixed tree that mixes no two vectors.
static inline __m512 sum16(const __m512* a) {
  __m512 s[8], t[4];
  for (int i = 0; i < 8; i++)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(t[0], t[1]), _mm512_unpackhi_ps(t[0], t[1]));
  __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(t[2], t[3]), _mm512_unpackhi_ps(t[2], t[3]));
  __m512 v = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u1))),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u1))));
  // lane 4c + i now holds vector c + 4i
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, v);
}

// q . k as a vector whose lanes sum to it: bfloat16 pairs by the dot-product instruction, float32 by FMAs.
struct QueryBF16 {
  __m512bh part[MAX_LANES / 2];
  int n;
  long D;
  QueryBF16(const bf16* q, long D) : n((int)((D + 31) / 32)), D(D) {
    for (int i = 0; i < n; i++) part[i] = (__m512bh)_mm512_maskz_loadu_epi16(tail32(D - i * 32), q + i * 32);
  }
  static __mmask32 tail32(long left) { return left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << left) - 1); }
  __m512 dot(const bf16* k) const {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i++)
      acc = _mm512_dpbf16_ps(acc, part[i], (__m512bh)_mm512_maskz_loadu_epi16(tail32(D - i * 32), k + i * 32));
    return acc;
  }
};
struct QueryF32 {
  __m512 part[MAX_LANES];
  int n;
  long D;
  QueryF32(const float* q, long D) : n((int)((D + 15) / 16)), D(D) {
    for (int i = 0; i < n; i++) part[i] = load_f32(q + i * 16, lanes(D - i * 16));
  }
  __m512 dot(const float* k) const {
    __m512 acc = _mm512_mul_ps(part[0], load_f32(k, lanes(D)));
    for (int i = 1; i < n; i++) acc = _mm512_fmadd_ps(part[i], load_f32(k + i * 16, lanes(D - i * 16)), acc);
    return acc;
  }
};
template <typename T> struct Query;
template <> struct Query<bf16> { typedef QueryBF16 type; };
template <> struct Query<float> { typedef QueryF32 type; };

template <typename T>
static void attend(const T* q, long q_row, long q_head, const T* k, const T* v, long kv_head, const uint8_t* visible,
                   long S, T* y, long R, long H, long Hkv, long D) {
  const int nv = (int)((D + 15) / 16);
  const __m512 scale = _mm512_set1_ps(1.0f / sqrtf((float)D));
  std::vector<float> score(S + 16);
  std::vector<long> slot(S);
  for (long r = 0; r < R; r++) {
    long n = 0;
    for (long s = 0; s < S; s++)
      if (visible[r * S + s]) slot[n++] = s;
    for (long h = 0; h < H; h++) {
      const T* kh = k + h / (H / Hkv) * kv_head;
      const T* vh = v + h / (H / Hkv) * kv_head;
      const typename Query<T>::type query(q + r * q_row + h * q_head, D);
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (long j = 0; j < n; j += 16) {  // sixteen keys' scores at a time, each from its own dot product
        __m512 dots[16];
        for (int i = 0; i < 16; i++) dots[i] = j + i < n ? query.dot(kh + slot[j + i] * D) : _mm512_setzero_ps();
        __mmask16 mk = lanes(n - j);
        __m512 scores = _mm512_mul_ps(sum16(dots), scale);
        _mm512_mask_storeu_ps(score.data() + j, mk, scores);
        top = _mm512_mask_max_ps(top, mk, top, scores);
      }
      const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
      __m512 total = _mm512_setzero_ps();
      for (long j = 0; j < n; j += 16) {
        __mmask16 mk = lanes(n - j);
        __m512 e = _mm512_maskz_mov_ps(mk, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, score.data() + j), most)));
        _mm512_mask_storeu_ps(score.data() + j, mk, e);
        total = _mm512_add_ps(total, e);
      }
      __m512 out[MAX_LANES];
      for (int i = 0; i < nv; i++) out[i] = _mm512_setzero_ps();
      for (long j = 0; j < n; j++) {
        const T* vj = vh + slot[j] * D;
        __m512 p = _mm512_set1_ps(score[j]);
        for (int i = 0; i < nv; i++) out[i] = _mm512_fmadd_ps(p, load(vj + i * 16, lanes(D - i * 16)), out[i]);
      }
      __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
      for (int i = 0; i < nv; i++)
        store(y + (r * H + h) * D + i * 16, _mm512_mul_ps(out[i], inv), lanes(D - i * 16));
    }
  }
}

extern "C" int vs_attend_bf16(const bf16* q, long q_row, long q_head, const bf16* k, const bf16* v, long kv_head,
                              const uint8_t* visible, long S, bf16* y, long R, long H, long Hkv, long D) {
  if (D > 16 * MAX_LANES) return -1;
  attend(q, q_row, q_head, k, v, kv_head, visible, S, y, R, H, Hkv, D);
  return 0;
}

extern "C" int vs_attend_f32(const float* q, long q_row, long q_head, const float* k, const float* v, long kv_head,
                             const uint8_t* visible, long S, float* y, long R, long H, long Hkv, long D) {
  if (D > 16 * MAX_LANES) return -1;
  attend(q, q_row, q_head, k, v, kv_head, visible, S, y, R, H, Hkv, D);
  return 0;
}
// ---- RMSNorm and rotary: the elementwise work around the matmuls, one call each instead of a dozen ops ----------
// Rounded as the PyTorch model rounds (models/llama.py): RMSNorm in float32, cast to the dtype, times the weight;
// rotary as x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype.

static inline __m512 round_to(__m512 v, const bf16*) {  // to bfloat16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
static inline __m512 round_to(__m512 v, const float*) { return v; }

template <typename T>
static void rms_norm(const T* x, long ldx, const T* w, T* y, long ldy, long R, long D, float eps) {
  for (long r = 0; r < R; r++) {
    const T* xr = x + r * ldx;
    __m512 sum = _mm512_setzero_ps();
    for (long i = 0; i < D; i += 16) {
      __m512 h = load(xr + i, lanes(D - i));
      sum = _mm512_fmadd_ps(h, h, sum);
    }
    __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)D + eps));
    for (long i = 0; i < D; i += 16) {
      __mmask16 mk = lanes(D - i);
      __m512 h = round_to(_mm512_mul_ps(load(xr + i, mk), scale), (const T*)0);
      store(y + r * ldy + i, _mm512_mul_ps(load(w + i, mk), h), mk);
    }
  }
}

template <typename T>
static void rotary(T* x, long row, long head, long R, long H, long D, const T* cos, const T* sin) {
  const long half = D / 2;
  for (long r = 0; r < R; r++)
    for (long h = 0; h < H; h++) {
      T* xh = x + r * row + h * head;
      const T *c = cos + r * D, *s = sin + r * D;
      for (long i = 0; i < half; i += 16) {  // both halves at once: x1' = x1 c1 - x2 s1, x2' = x2 c2 + x1 s2
        __mmask16 mk = lanes(half - i);
        __m512 x1 = load(xh + i, mk), x2 = load(xh + half + i, mk);
        __m512 a1 = round_to(_mm512_mul_ps(x1, load(c + i, mk)), (const T*)0);
        __m512 b1 = round_to(_mm512_mul_ps(_mm512_xor_ps(x2, _mm512_set1_ps(-0.0f)), load(s + i, mk)), (const T*)0);
        __m512 a2 = round_to(_mm512_mul_ps(x2, load(c + half + i, mk)), (const T*)0);
        __m512 b2 = round_to(_mm512_mul_ps(x1, load(s + half + i, mk)), (const T*)0);
        store(xh + i, _mm512_add_ps(a1, b1), mk);
        store(xh + half + i, _mm512_add_ps(a2, b2), mk);
      }
    }
}

extern "C" int vs_rms_norm_bf16(const bf16* x, long ldx, const bf16* w, bf16* y, long ldy, long R, long D, float eps) {
  rms_norm(x, ldx, w, y, ldy, R, D, eps);
  return 0;
}
extern "C" int vs_rms_norm_f32(const float* x, long ldx, const float* w, float* y, long ldy, long R, long D,
                               float eps) {
  rms_norm(x, ldx, w, y, ldy, R, D, eps);
  return 0;
}
extern "C" int vs_rotary_bf16(bf16* x, long row, long head, long R, long H, long D, const bf16* cos, const bf16* sin) {
  if (D % 2) return -1;
  rotary(x, row, head, R, H, D, cos, sin);
  return 0;
}
extern "C" int vs_rotary_f32(float* x, long row, long head, long R, long H, long D, const float* cos,
                             const float* sin) {
  if (D % 2) return -1;
  rotary(x, row, head, R, H, D, cos, sin);
  return 0;
}
#else
extern "C" int vs_rms_norm_bf16(...) { return -1; }
extern "C" int vs_rms_norm_f32(...) { return -1; }
extern "C" int vs_rotary_bf16(...) { return -1; }
extern "C" int vs_rotary_f32(...) { return -1; }
extern "C" int vs_linear_bf16(...) { return -1; }
extern "C" int vs_linear_f32(...) { return -1; }
extern "C" int vs_attend_bf16(...) { return -1; }
extern "C" int vs_attend_f32(...) { return -1; }
#endif
