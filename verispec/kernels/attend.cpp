// Attention over each row's own visible keys.
#include <array>
#include <utility>
#include <vector>

#include "pool.h"
#include "simd.h"

#ifdef VS_KERNELS
// y[r, h] = softmax(q[r, h] . k[s] / sqrt(scalar) over the slots s that row r sees) @ v, with the keys taken in slot
// order and the unseen ones skipped, not masked: a row that sees the same keys (a token decoded alone, in a chain, in a
// tree whose nodes sit past their positions) adds the same numbers in the same order. A sliding window of W keys: a
// row sees only the last W of its slots (its slots hold its positions in order, so those are its last W positions).

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
  vf dot(const bf16* key) const {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < N; i++)
      acc = _mm512_dpbf16_ps(acc, part[i], (__m512bh)_mm512_maskz_loadu_epi16(mask[i], key + i * 32));
    return acc;
  }
  // dots[c] = q . key c for c < count, 0 beyond, each key's sum in the order of its parts (as `dot` takes them); a
  // whole block with the parts outermost, so that the 16 sums run side by side in registers
  void dots(const bf16* const* key, int count, vf* dots) const {
    if (count == 16) {
      for (int c = 0; c < 16; c++) dots[c] = _mm512_setzero_ps();
      for (int i = 0; i < N; i++)
        for (int c = 0; c < 16; c++)
          dots[c] = _mm512_dpbf16_ps(dots[c], part[i], (__m512bh)_mm512_maskz_loadu_epi16(mask[i], key[c] + i * 32));
      return;
    }
    for (int c = 0; c < 16; c++) dots[c] = c < count ? dot(key[c]) : _mm512_setzero_ps();
  }
};
#else
// Eight vectors -> one: lane c holds vsum(a[c]), by the very pairs vsum adds (lanes j and j + 8, then hsum8's j and
// j + 4, j and j + 2, 0 and 1), eight of them side by side: the same sums, so the same bits, without eight
// horizontal sums.
static inline __m256 sum8(const vf* a) {
  __m256 t[4];
  for (int i = 0; i < 4; i++) {  // t[i]: vectors 2i and 2i + 1, lanes j and j + 4 added, in the two halves
    const __m256 x = _mm256_add_ps(a[2 * i].lo, a[2 * i].hi), y = _mm256_add_ps(a[2 * i + 1].lo, a[2 * i + 1].hi);
    t[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  }
  // lanes j and j + 2: vectors 0 2 | 1 3 (and 4 6 | 5 7), two lanes each
  const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
  const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
  // lanes 0 and 1: vectors 0 2 4 6 | 1 3 5 7
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x88), _mm256_shuffle_ps(u0, u1, 0xDD));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
// Sixteen vectors -> one: lane j holds the sum of a[j]'s lanes, each by vsum's fixed tree.
static inline vf sum16(const vf* a) { return {sum8(a), sum8(a + 8)}; }
#endif

// q . k as a vector whose lanes sum to it, by FMAs over 16-lane vectors (bfloat16 and float16 widened to float32):
// a query of T, keys of K (float16 keys for float32 queries: a float16 cache).
template <typename T, typename K, int NV>
struct QueryFMA {
  vf part[NV];
  vmask mask[NV];
  QueryFMA(const T* q, long D) {
    for (int i = 0; i < NV; i++) {
      mask[i] = lanes(D - i * 16);
      part[i] = load(q + i * 16, mask[i]);
    }
  }
  vf dot(const K* key) const {
    vf acc = vmul(part[0], load(key, mask[0]));
    for (int i = 1; i < NV; i++) acc = vfmadd(part[i], load(key + i * 16, mask[i]), acc);
    return acc;
  }
  // dots[c] = q . key c for c < count, 0 beyond, each key's sum in the order of its parts. A whole block of 16 on
  // AVX-512 (32 registers) takes the parts outermost, so that the keys' sums run side by side in registers.
  void dots(const K* const* key, int count, vf* dots) const {
#ifdef VS_AVX512
    if (count == 16) {
      for (int c = 0; c < 16; c++) dots[c] = vmul(part[0], load(key[c], mask[0]));
      for (int i = 1; i < NV; i++)
        for (int c = 0; c < 16; c++) dots[c] = vfmadd(part[i], load(key[c] + i * 16, mask[i]), dots[c]);
      return;
    }
#endif
    for (int c = 0; c < 16; c++) dots[c] = c < count ? dot(key[c]) : vzero();
  }
};

#ifdef VS_AVX512
// dots[h][c] = q[h] . key c for NT heads and a whole block of 16 keys of a float16 cache, each key widened once for
// all the heads rather than once a head (the widening takes as many vector uops as the dot product): each sum in
// the order of QueryFMA's, so the same bits.
template <int NV, int NT>
static inline void widened_once(const float* const* q, const vmask* m, const f16* const* key, vf (*dots)[16]) {
  vf part[NT][NV];
  for (int h = 0; h < NT; h++)
    for (int i = 0; i < NV; i++) part[h][i] = load(q[h] + i * 16, m[i]);
  for (int c = 0; c < 16; c++) {
    vf k[NV];
    for (int i = 0; i < NV; i++) k[i] = load(key[c] + i * 16, m[i]);
    for (int h = 0; h < NT; h++) {
      vf acc = vmul(part[h][0], k[0]);
      for (int i = 1; i < NV; i++) acc = vfmadd(part[h][i], k[i], acc);
      dots[h][c] = acc;
    }
  }
}
#endif

template <typename T, typename K, int NV> struct Query;  // a query of T over keys of K
#ifdef VS_AVX512
template <int NV> struct Query<bf16, bf16, NV> { typedef QueryBF16<NV> type; };
#else
template <int NV> struct Query<bf16, bf16, NV> { typedef QueryFMA<bf16, bf16, NV> type; };
#endif
template <int NV> struct Query<float, float, NV> { typedef QueryFMA<float, float, NV> type; };
template <int NV> struct Query<float, f16, NV> { typedef QueryFMA<float, f16, NV> type; };

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

// Ahead of its use, the D values of a key or value row: into the L1 cache a few rows before it is read (the keys are
// read by blocks of 16 and the loads of a block by parts, which the hardware's prefetchers do not follow), and into
// the L2 cache a pass before: a group's values while its keys are read, the next group's keys while its
// values are, so that the memory streams the cache the whole time rather than each pass starting cold.
static const long AHEAD = 32;
enum Cache { L1 = 3, L2 = 2 };  // __builtin_prefetch's locality: prefetcht0, prefetcht1
template <Cache INTO = L1, typename T>
static inline void fetch(const T* row, long D) {
  for (long b = 0; b < D * (long)sizeof(T); b += 64) __builtin_prefetch((const char*)row + b, 0, INTO);
}

// out[t] += p[t][j] * v[slot[j]] over the seen slots j in order, for NH heads of one group at once: each value row is
// loaded once for them all, and their sums (each in the one order a head alone would take) run side by side.
template <typename T, int NV, int NH>
static void weigh(const T* vh, const long* slot, long n, const float* const* p, long D, const vmask* m,
                  vf (*out)[NV], const T* next) {
  vf sum[NH][NV];  // local, not out, so that they stay in registers (a vector type may alias what the loop reads)
  for (int t = 0; t < NH; t++)
    for (int i = 0; i < NV; i++) sum[t][i] = vzero();
  for (long j = 0; j < n; j++) {
    const T* vj = vh + slot[j] * D;
    if (j + AHEAD < n) fetch(vh + slot[j + AHEAD] * D, D);
    if (next) fetch<L2>(next + slot[j] * D, D);
    vf value[NV];
    for (int i = 0; i < NV; i++) value[i] = load(vj + i * 16, m[i]);
    for (int t = 0; t < NH; t++) {
      const vf weight = vset1(p[t][j]);
      for (int i = 0; i < NV; i++) sum[t][i] = vfmadd(weight, value[i], sum[t][i]);
    }
  }
  for (int t = 0; t < NH; t++)
    for (int i = 0; i < NV; i++) out[t][i] = sum[t][i];
}

// Row r's heads t_lo .. t_hi - 1 of key head g's group (of G): a block of 16 keys is read from memory once, for the
// first of them, and from the L1 cache for the rest.
template <typename T, typename K, int NV, bool FULL>
static void attend_heads(const T* q, long q_row, long q_head, const K* k, const K* v, long kv_head,
                         const uint8_t* visible, long S, T* y, long r, long g, long t_lo, long t_hi, long H, long G,
                         long D_, long window, float scalar, bool fetch_next) {
  const long D = FULL ? NV * 16 : D_;  // a whole number of vectors: the masks are constants
  constexpr int NH = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;  // heads weighed at once: their sums and a value row in registers
  const vf scale = vset1(1.0f / sqrtf(scalar));
  const long stride = S + 16;
  thread_local std::vector<float> score;  // G rows of `stride`; grown, never cleared: every entry read is written first
  thread_local std::vector<long> slot;
  thread_local std::vector<float> top, totals;  // each head's running maximum (16 lanes), and its sum of weights
  if ((long)score.size() < G * stride) score.resize(G * stride);
  if ((long)slot.size() < S) slot.resize(S);
  if ((long)top.size() < G * 16) top.resize(G * 16);
  if ((long)totals.size() < G) totals.resize(G);
  vmask vmasks[NV];
  for (int i = 0; i < NV; i++) vmasks[i] = lanes(D - i * 16);
  long n = seen(visible + r * S, S, slot.data());
  const long* const slots = slot.data() + (window > 0 && n > window ? n - window : 0);  // the window's: the last
  n -= slots - slot.data();
  const K* kh = k + g * kv_head;
  const K* vh = v + g * kv_head;
  const T* qg = q + r * q_row + g * G * q_head;
  for (long t = t_lo; t < t_hi; t++) store(top.data() + t * 16, vset1(-INFINITY), lanes(16));
  for (long j = 0; j < n; j += 16) {  // sixteen keys' scores at a time, each from its own dot product
    const int count = n - j < 16 ? (int)(n - j) : 16;
    const K* key[16];
    for (int c = 0; c < count; c++) key[c] = kh + slots[j + c] * D;
    for (long c = j + AHEAD; c < j + AHEAD + 16 && c < n; c++) fetch(kh + slots[c] * D, D);
    for (int c = 0; c < count; c++) fetch<L2>(vh + slots[j + c] * D, D);
    const vmask mk = lanes(count);
    const auto keep = [&](long t, const vf* dots) {  // head t's scores of the block, and its running maximum
      const vf scores = vmul(sum16(dots), scale);
      store(score.data() + t * stride + j, scores, mk);
      store(top.data() + t * 16, vmax_in(mk, load(top.data() + t * 16), scores), lanes(16));
    };
#ifdef VS_AVX512
    if constexpr (std::is_same_v<K, f16> && NV <= 8) {
      if (count == 16) {  // the group's heads NQ at a time: their query parts and a key in registers
        constexpr int NQ = NV <= 4 ? 4 : 2;
        in_row_blocks<NQ>(t_hi - t_lo, [&](auto heads, long t0) {
          t0 += t_lo;
          constexpr int NT = decltype(heads)::value;
          const float* q[NT];
          for (int h = 0; h < NT; h++) q[h] = qg + (t0 + h) * q_head;
          vf dots[NT][16];
          widened_once<NV, NT>(q, vmasks, key, dots);
          for (int h = 0; h < NT; h++) keep(t0 + h, dots[h]);
        });
        continue;
      }
    }
#endif
    for (long t = t_lo; t < t_hi; t++) {
      const typename Query<T, K, NV>::type query(qg + t * q_head, D);
      vf dots[16];
      query.dots(key, count, dots);
      keep(t, dots);
    }
  }
  for (long t = t_lo; t < t_hi; t++) {
    float* row = score.data() + t * stride;
    const vf most = vset1(vtop(load(top.data() + t * 16)));
    vf total = vzero();
    for (long j = 0; j < n; j += 16) {
      const vmask mk = lanes(n - j);
      const vf e = vkeep(mk, exp_ps(vsub(load(row + j, mk), most)));
      store(row + j, e, mk);
      total = vadd(total, e);
    }
    totals[t] = vsum(total);
  }
  in_row_blocks<NH>(t_hi - t_lo, [&](auto heads, long t0) {  // NH heads at a time, then the rest at once
    t0 += t_lo;
    constexpr int NT = decltype(heads)::value;
    vf out[NT][NV];
    const float* p[NT];
    for (int t = 0; t < NT; t++) p[t] = score.data() + (t0 + t) * stride;
    weigh<K, NV, NT>(vh, slots, n, p, D, vmasks, out, t0 == t_lo && fetch_next ? kh + kv_head : nullptr);
    for (int t = 0; t < NT; t++) {
      const vf inv = vset1(1.0f / totals[t0 + t]);
      T* yh = y + (r * H + g * G + t0 + t) * D;
      for (int i = 0; i < NV; i++) store(yh + i * 16, vmul(out[t][i], inv), vmasks[i]);
    }
  });
}

// Heads that share a key head are taken together: a block of 16 keys is read from memory once, for the first of
// them, and from the L1 cache for the rest. Each head's numbers are the same as if it were alone, so the work is
// split on the pool by rows, key heads and parts of their groups of heads. Queries and outputs are T, keys and values K.
template <typename T, typename K, int NV, bool FULL>
static void attend(const T* q, long q_row, long q_head, const K* k, const K* v, long kv_head, const uint8_t* visible,
                   long S, T* y, long R, long H, long Hkv, long D_, long window, float scalar) {
  const long G = H / Hkv;  // query heads per key head
  // a group's heads in parts where rows and key heads alone are too few to share among the threads
  const long wanted = pool_threads() > 1 ? (2 * pool_threads() + R * Hkv - 1) / (R * Hkv) : 1;
  const long parts = wanted < 1 ? 1 : wanted > G ? G : wanted, per_part = (G + parts - 1) / parts;
  parallel(R * Hkv * parts, 1, [&](long first, long last) {
    for (long item = first; item < last; item++) {
      const long r = item / (Hkv * parts), g = item / parts % Hkv, part = item % parts;
      const long t_lo = part * per_part, t_hi = t_lo + per_part < G ? t_lo + per_part : G;
      if (t_lo < t_hi) attend_heads<T, K, NV, FULL>(q, q_row, q_head, k, v, kv_head, visible, S, y, r, g, t_lo, t_hi, H, G, D_,
                                              window, scalar, g + 1 < Hkv && part + 1 == parts);
    }
  });
}

template <typename T, typename K>
using Attend = void (*)(const T*, long, long, const K*, const K*, long, const uint8_t*, long, T*, long, long, long, long,
                        long, float);
template <typename T, typename K, bool FULL, int... I>
static constexpr std::array<Attend<T, K>, MAX_LANES> by_vectors(std::integer_sequence<int, I...>) {
  return {attend<T, K, I + 1, FULL>...};  // [vectors a head - 1]
}

template <typename T, typename K>
static int attend(const int64_t* a) {  // a: q, q_row, q_head, k, v, kv_head, visible, S, y, R, H, Hkv, D, window
  // (0: none), scalar (float bits)
  static const std::array<Attend<T, K>, MAX_LANES> table[2] = {  // [D a whole number of vectors]
      by_vectors<T, K, false>(std::make_integer_sequence<int, MAX_LANES>()),
      by_vectors<T, K, true>(std::make_integer_sequence<int, MAX_LANES>())};
  const long D = a[12];
  if (D < 1 || D > 16 * MAX_LANES) return -1;
  table[D % 16 == 0][(D + 15) / 16 - 1](ARG(const T*, 0), a[1], a[2], ARG(const K*, 3), ARG(const K*, 4), a[5],
                                        ARG(const uint8_t*, 6), a[7], ARG(T*, 8), a[9], a[10], a[11], D, a[13],
                                        float_arg(a, 14));
  return 0;
}

// Each type's kernels make a third of the compile: build.py compiles them as three units side by side (VS_ATTEND)
#if !defined(VS_ATTEND) || VS_ATTEND == 0
extern "C" int vs_attend_bf16(const int64_t* a) { return attend<bf16, bf16>(a); }
#endif
#if !defined(VS_ATTEND) || VS_ATTEND == 1
extern "C" int vs_attend_f32(const int64_t* a) { return attend<float, float>(a); }
#endif
#if !defined(VS_ATTEND) || VS_ATTEND == 2
extern "C" int vs_attend_f32_f16(const int64_t* a) { return attend<float, f16>(a); }  // a float16 cache
#endif
#endif
