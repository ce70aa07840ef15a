// Attention over each row's own visible keys.
#include <vector>

#include "simd.h"

#ifdef VS_KERNELS
// y[r, h] = softmax(q[r, h] . k[s] / sqrt(D) over the slots s that row r sees) @ v, with the keys taken in slot order
// and the unseen ones skipped, not masked: a row that sees the same keys (a token decoded alone, in a chain, in a
// tree whose nodes sit past their positions) adds the same numbers in the same order.

static const int MAX_LANES = 16;  // head_dim up to 256

#ifdef VS_AVX512
// Sixteen vectors -> one: lane j holds the sum of a[j]'s lanes, by a fixed tree that mixes no two vectors.
static inline vf sum16(const vf* a) {
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

// q . k as a vector whose lanes sum to it: bfloat16 pairs by the dot-product instruction, float32 by FMAs. NV: the
// head's 16-lane vectors, a compile-time count so that the query and the accumulators stay in registers.
template <int NV>
struct QueryBF16 {
  static const int N = (NV + 1) / 2;  // 32 bfloat16 a part
  __m512bh part[N];
  __mmask32 mask[N];
  QueryBF16(const bf16* q, long D) {
    for (int i = 0; i < N; i++) {
      const long left = D - i * 32;
      mask[i] = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << left) - 1);
      part[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask[i], q + i * 32);
    }
  }
  vf dot(const bf16* k) const {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < N; i++)
      acc = _mm512_dpbf16_ps(acc, part[i], (__m512bh)_mm512_maskz_loadu_epi16(mask[i], k + i * 32));
    return acc;
  }
};
#else
// Sixteen vectors -> one: lane j holds the sum of a[j]'s lanes, each summed alone by the same fixed tree.
static inline vf sum16(const vf* a) {
  float s[16];
  for (int i = 0; i < 16; i++) s[i] = vsum(a[i]);
  return load(s);
}
#endif

// q . k as a vector whose lanes sum to it, by FMAs over 16-lane vectors (bfloat16 widened to float32).
template <typename T, int NV>
struct QueryFMA {
  vf part[NV];
  vmask mask[NV];
  QueryFMA(const T* q, long D) {
    for (int i = 0; i < NV; i++) {
      mask[i] = lanes(D - i * 16);
      part[i] = load(q + i * 16, mask[i]);
    }
  }
  vf dot(const T* k) const {
    vf acc = vmul(part[0], load(k, mask[0]));
    for (int i = 1; i < NV; i++) acc = vfmadd(part[i], load(k + i * 16, mask[i]), acc);
    return acc;
  }
};
template <typename T, int NV> struct Query;
#ifdef VS_AVX512
template <int NV> struct Query<bf16, NV> { typedef QueryBF16<NV> type; };
#else
template <int NV> struct Query<bf16, NV> { typedef QueryFMA<bf16, NV> type; };
#endif
template <int NV> struct Query<float, NV> { typedef QueryFMA<float, NV> type; };

// The slots a row sees, in order: slot[j] for j < the count returned. A whole block of unseen slots costs one test.
static inline long seen(const uint8_t* visible, long S, long* slot) {
  long n = 0, s = 0;
#ifdef VS_AVX512
  for (; s + 64 <= S; s += 64) {
    uint64_t bits = _mm512_test_epi8_mask(_mm512_loadu_si512(visible + s), _mm512_set1_epi8(-1));
    for (; bits; bits &= bits - 1) slot[n++] = s + __builtin_ctzll(bits);
  }
#else
  for (; s + 32 <= S; s += 32) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(visible + s));
    uint32_t bits = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_setzero_si256()));
    for (; bits; bits &= bits - 1) slot[n++] = s + __builtin_ctz(bits);
  }
#endif
  for (; s < S; s++)
    if (visible[s]) slot[n++] = s;
  return n;
}

template <typename T, int NV>
static void attend(const T* q, long q_row, long q_head, const T* k, const T* v, long kv_head, const uint8_t* visible,
                   long S, T* y, long R, long H, long Hkv, long D) {
  const vf scale = vset1(1.0f / sqrtf((float)D));
  thread_local std::vector<float> score;  // grown, never cleared: every entry read is written first
  thread_local std::vector<long> slot;
  if ((long)score.size() < S + 16) score.resize(S + 16);
  if ((long)slot.size() < S) slot.resize(S);
  vmask vmasks[NV];
  for (int i = 0; i < NV; i++) vmasks[i] = lanes(D - i * 16);
  for (long r = 0; r < R; r++) {
    const long n = seen(visible + r * S, S, slot.data());
    for (long h = 0; h < H; h++) {
      const T* kh = k + h / (H / Hkv) * kv_head;
      const T* vh = v + h / (H / Hkv) * kv_head;
      const typename Query<T, NV>::type query(q + r * q_row + h * q_head, D);
      vf top = vset1(-INFINITY);
      for (long j = 0; j < n; j += 16) {  // sixteen keys' scores at a time, each from its own dot product
        vf dots[16];
        for (int i = 0; i < 16; i++) dots[i] = j + i < n ? query.dot(kh + slot[j + i] * D) : vzero();
        const vmask mk = lanes(n - j);
        const vf scores = vmul(sum16(dots), scale);
        store(score.data() + j, scores, mk);
        top = vmax_in(mk, top, scores);
      }
      const vf most = vset1(vtop(top));
      vf total = vzero();
      for (long j = 0; j < n; j += 16) {
        const vmask mk = lanes(n - j);
        const vf e = vkeep(mk, exp_ps(vsub(load(score.data() + j, mk), most)));
        store(score.data() + j, e, mk);
        total = vadd(total, e);
      }
      vf out[NV];
      for (int i = 0; i < NV; i++) out[i] = vzero();
      for (long j = 0; j < n; j++) {
        const T* vj = vh + slot[j] * D;
        const vf p = vset1(score[j]);
        for (int i = 0; i < NV; i++) out[i] = vfmadd(p, load(vj + i * 16, vmasks[i]), out[i]);
      }
      const vf inv = vset1(1.0f / vsum(total));
      for (int i = 0; i < NV; i++) store(y + (r * H + h) * D + i * 16, vmul(out[i], inv), vmasks[i]);
    }
  }
}

template <typename T>
static int attend(const int64_t* a) {  // a: q, q_row, q_head, k, v, kv_head, visible, S, y, R, H, Hkv, D
  typedef void (*Attend)(const T*, long, long, const T*, const T*, long, const uint8_t*, long, T*, long, long, long,
                         long);
  static const Attend by_vectors[MAX_LANES] = {attend<T, 1>,  attend<T, 2>,  attend<T, 3>,  attend<T, 4>,
                                               attend<T, 5>,  attend<T, 6>,  attend<T, 7>,  attend<T, 8>,
                                               attend<T, 9>,  attend<T, 10>, attend<T, 11>, attend<T, 12>,
                                               attend<T, 13>, attend<T, 14>, attend<T, 15>, attend<T, 16>};
  const long D = a[12];
  if (D < 1 || D > 16 * MAX_LANES) return -1;
  by_vectors[(D + 15) / 16 - 1](ARG(const T*, 0), a[1], a[2], ARG(const T*, 3), ARG(const T*, 4), a[5],
                                ARG(const uint8_t*, 6), a[7], ARG(T*, 8), a[9], a[10], a[11], D);
  return 0;
}

extern "C" int vs_attend_bf16(const int64_t* a) { return attend<bf16>(a); }
extern "C" int vs_attend_f32(const int64_t* a) { return attend<float>(a); }
#endif
