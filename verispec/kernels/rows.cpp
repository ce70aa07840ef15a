// The row-wise work around the matmuls, one call each instead of a few PyTorch ops: RMSNorm (of rows, or in place of
// each head of q or k), rotary, silu(gate) * up and gelu_tanh(gate) * up, scaling rows in place, and the copies that a
// forward's kernels read from and write to (token embeddings and rotary tables by index, an embedding in ggml's blocks
// dequantized as its rows are looked up; new keys and values into the cache).
#include "pool.h"
#include "simd.h"

#ifdef VS_KERNELS
// Rounded as the PyTorch model rounds (models/llama.py): RMSNorm in float32, cast to the dtype, times the weight;
// rotary as x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype.

// One row: y = w * (x / sqrt(mean(x^2) + eps)), the normalised row rounded to T before the weight; plus `res` where
// given, added as `res + y` would be (rounded to T).
template <typename T>
static inline void norm_row(const T* x, const T* w, T* y, long D, float eps, const T* res) {
  vf sum = vzero();
  for (long i = 0; i < D; i += 16) {
    const vf h = load(x + i, lanes(D - i));
    sum = vfmadd(h, h, sum);
  }
  const vf scale = vset1(1.0f / sqrtf(vsum(sum) / (float)D + eps));
  for (long i = 0; i < D; i += 16) {
    const vmask mk = lanes(D - i);
    const vf h = round_to(vmul(load(x + i, mk), scale), (const T*)0);
    const vf out = vmul(load(w + i, mk), h);
    store(y + i, res ? vadd(load(res + i, mk), round_to(out, (const T*)0)) : out, mk);
  }
}

template <typename T>
static void rms_norm(const T* x, long ldx, const T* w, T* y, long ldy, long R, long D, float eps, const T* res,
                     long ldr) {
  parallel(R, 16, [&](long first, long last) {
    for (long r = first; r < last; r++) norm_row(x + r * ldx, w, y + r * ldy, D, eps, res ? res + r * ldr : nullptr);
  });
}

// Each head of x (H, R, D) in place (q or k inside a projection's output), as `rms_norm` normalises a row
template <typename T>
static void head_norm(T* x, long row, long head, long R, long H, long D, const T* w, float eps) {
  parallel(R, 8, [&](long first, long last) {
    for (long r = first; r < last; r++)
      for (long h = 0; h < H; h++) norm_row(x + r * row + h * head, w, x + r * row + h * head, D, eps, (const T*)0);
  });
}

template <typename T>
static void rotary(T* x, long row, long head, long R, long H, long D, const T* cos, const T* sin) {
  const long half = D / 2;
  parallel(R, 8, [&](long first, long last) {
    for (long r = first; r < last; r++)
      for (long h = 0; h < H; h++) {
        T* xh = x + r * row + h * head;
        const T *c = cos + r * D, *s = sin + r * D;
        for (long i = 0; i < half; i += 16) {  // both halves at once: x1' = x1 c1 - x2 s1, x2' = x2 c2 + x1 s2
          const vmask mk = lanes(half - i);
          const vf x1 = load(xh + i, mk), x2 = load(xh + half + i, mk);
          const vf a1 = round_to(vmul(x1, load(c + i, mk)), (const T*)0);
          const vf b1 = round_to(vmul(vneg(x2), load(s + i, mk)), (const T*)0);
          const vf a2 = round_to(vmul(x2, load(c + half + i, mk)), (const T*)0);
          const vf b2 = round_to(vmul(x1, load(s + half + i, mk)), (const T*)0);
          store(xh + i, vadd(a1, b1), mk);
          store(xh + half + i, vadd(a2, b2), mk);
        }
      }
  });
}

// act(gate) * up for x = [gate | up] (I each), act(g) = g / (1 + e^(-k(g))) rounded to T before the product: silu
// (k(g) = g), or gelu's tanh approximation (0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3))
enum class Act { SILU, GELU_TANH };
template <Act ACT, typename T>
static void gated(const T* x, long ldx, T* y, long ldy, long R, long I) {
  parallel(R, 2, [&](long first, long last) {
    for (long r = first; r < last; r++)
      for (long i = 0; i < I; i += 16) {
        const vmask mk = lanes(I - i);
        const vf g = load(x + r * ldx + i, mk), u = load(x + r * ldx + I + i, mk);
        vf k = g;
        if constexpr (ACT == Act::GELU_TANH)  // 2 sqrt(2 / pi) (g + 0.044715 g^3)
          k = vmul(vset1(1.5957691216057308f), vfmadd(vmul(vset1(0.044715f), vmul(g, g)), g, g));
        const vf s = vdiv(g, vadd(vset1(1.0f), exp_ps(vsub(vzero(), k))));
        store(y + r * ldy + i, vmul(round_to(s, (const T*)0), u), mk);
      }
  });
}

// x *= s in place, rows (R, D) at stride ldx: s rounded to T, as a T tensor holds it, and each product rounded to T
template <typename T>
static void scale_rows(T* x, long ldx, long R, long D, float s) {
  const vf scale = round_to(vset1(s), (const T*)0);
  parallel(R, 16, [&](long first, long last) {
    for (long r = first; r < last; r++)
      for (long i = 0; i < D; i += 16) {
        const vmask mk = lanes(D - i);
        store(x + r * ldx + i, vmul(load(x + r * ldx + i, mk), scale), mk);
      }
  });
}

// a: x, ldx, w, y, ldy, R, D, eps (float bits), residual (or null), its ld
extern "C" int vs_rms_norm_bf16(const int64_t* a) {
  rms_norm(ARG(const bf16*, 0), a[1], ARG(const bf16*, 2), ARG(bf16*, 3), a[4], a[5], a[6], float_arg(a, 7),
           ARG(const bf16*, 8), a[9]);
  return 0;
}
extern "C" int vs_rms_norm_f32(const int64_t* a) {
  rms_norm(ARG(const float*, 0), a[1], ARG(const float*, 2), ARG(float*, 3), a[4], a[5], a[6], float_arg(a, 7),
           ARG(const float*, 8), a[9]);
  return 0;
}
// a: x, row, head, R, H, D, w (D), eps (float bits)
extern "C" int vs_head_norm_bf16(const int64_t* a) {
  head_norm(ARG(bf16*, 0), a[1], a[2], a[3], a[4], a[5], ARG(const bf16*, 6), float_arg(a, 7));
  return 0;
}
extern "C" int vs_head_norm_f32(const int64_t* a) {
  head_norm(ARG(float*, 0), a[1], a[2], a[3], a[4], a[5], ARG(const float*, 6), float_arg(a, 7));
  return 0;
}
// a: x, row, head, R, H, D, cos, sin (R, D each)
extern "C" int vs_rotary_bf16(const int64_t* a) {
  if (a[5] % 2) return -1;
  rotary(ARG(bf16*, 0), a[1], a[2], a[3], a[4], a[5], ARG(const bf16*, 6), ARG(const bf16*, 7));
  return 0;
}
extern "C" int vs_rotary_f32(const int64_t* a) {
  if (a[5] % 2) return -1;
  rotary(ARG(float*, 0), a[1], a[2], a[3], a[4], a[5], ARG(const float*, 6), ARG(const float*, 7));
  return 0;
}
// a: x, ldx, y, ldy, R, I
extern "C" int vs_silu_mul_bf16(const int64_t* a) {
  gated<Act::SILU>(ARG(const bf16*, 0), a[1], ARG(bf16*, 2), a[3], a[4], a[5]);
  return 0;
}
extern "C" int vs_silu_mul_f32(const int64_t* a) {
  gated<Act::SILU>(ARG(const float*, 0), a[1], ARG(float*, 2), a[3], a[4], a[5]);
  return 0;
}
extern "C" int vs_gelu_tanh_mul_bf16(const int64_t* a) {
  gated<Act::GELU_TANH>(ARG(const bf16*, 0), a[1], ARG(bf16*, 2), a[3], a[4], a[5]);
  return 0;
}
extern "C" int vs_gelu_tanh_mul_f32(const int64_t* a) {
  gated<Act::GELU_TANH>(ARG(const float*, 0), a[1], ARG(float*, 2), a[3], a[4], a[5]);
  return 0;
}
// a: x, ldx, R, D, s (float bits)
extern "C" int vs_scale_bf16(const int64_t* a) {
  scale_rows(ARG(bf16*, 0), a[1], a[2], a[3], float_arg(a, 4));
  return 0;
}
extern "C" int vs_scale_f32(const int64_t* a) {
  scale_rows(ARG(float*, 0), a[1], a[2], a[3], float_arg(a, 4));
  return 0;
}
#endif

// Copies, for any dtype (`size` bytes an element); they check their indices first and copy nothing where one is out
// of range (-1), so that a bad token id or position is refused, never read past a table.

// a: table, rows (in the table), ld (elements), index (R int64), R, D, y, ldy, size
extern "C" int vs_gather(const int64_t* a) {
  const char* table = ARG(const char*, 0);
  const int64_t *index = ARG(const int64_t*, 3), rows = a[1], ld = a[2], R = a[4], D = a[5], ldy = a[7], size = a[8];
  char* y = ARG(char*, 6);
  for (long r = 0; r < R; r++)
    if (index[r] < 0 || index[r] >= rows) return -1;
  for (long r = 0; r < R; r++) memcpy(y + r * ldy * size, table + index[r] * ld * size, D * size);
  return 0;
}

// The same from a bfloat16 table into float32 rows (exact: a bfloat16 is a float32's top half), for a model that keeps
// a bfloat16 embedding table and runs in float32 (a quantized twin of a bfloat16 model, models/twin.py).
// a: table, rows, ld, index (R int64), R, D, y (float32), ldy
extern "C" int vs_gather_widen(const int64_t* a) {
  const uint16_t* table = ARG(const uint16_t*, 0);
  const int64_t *index = ARG(const int64_t*, 3), rows = a[1], ld = a[2], R = a[4], D = a[5], ldy = a[7];
  uint32_t* y = ARG(uint32_t*, 6);
  for (long r = 0; r < R; r++)
    if (index[r] < 0 || index[r] >= rows) return -1;
  for (long r = 0; r < R; r++)
    for (long i = 0; i < D; i++) y[r * ldy + i] = (uint32_t)table[index[r] * ld + i] << 16;
  return 0;
}

// Rows of a table kept as ggml's blocks (a GGUF's token embedding, memory-mapped), dequantized into float32 rows as
// they are looked up, as llama.cpp's get_rows does, rather than the whole table at load. Each value has the bits of
// gguf's numpy dequantization (gguf.quants.dequantize, ggml's reference in float32): the same float32 operations in
// the same order, each rounded on its own (-ffp-contract=off: no fused multiply-add). Scalar: a lookup is a few rows.

// float16 bits to float32, exactly as numpy's astype does it (a signaling NaN stays signaling, which F16C's
// conversion would quiet: a float16 table's rows keep their bits)
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = h & 0x7c00, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x7c00)
    bits = sign | 0x7f800000 | mant << 13;  // infinity or NaN, the payload kept
  else if (exp)
    bits = sign | (((uint32_t)(h & 0x7fff) << 13) + 0x38000000);  // normal: the exponent rebiased from 15 to 127
  else {
    const float sub = (float)mant * 5.9604645e-8f;  // zero or subnormal: mant * 2^-24, exact
    memcpy(&bits, &sub, 4);
    bits |= sign;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
static inline float half_at(const uint8_t* p) {  // a block's float16 field (little-endian, maybe unaligned)
  return half_to_float((uint16_t)(p[0] | p[1] << 8));
}

// One block of each format into its inputs (32, or 256 for a K-quant), as gguf/quants.py's dequantize_blocks
// computes them: d * q for Q8_0, Q4_0, Q5_0 (q centred); d * q + m for Q4_1, Q5_1; for Q4_K and Q5_K each sub-block
// of 32's (d * sc) * q - (dmin * m); for Q6_K (d * sc) * q by 16 inputs. The products are exact in float32 (a
// float16's 11 significant bits times at most 12 more, Q6_K's int8 scale's 7 and its quant's 5, far from float32's
// subnormals and overflow), so the one rounding is the add or subtract; the order is gguf's all the same.
static void block_q8_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}
static void block_q4_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; j++) {
    y[j] = d * (float)((qs[j] & 0xf) - 8);
    y[j + 16] = d * (float)((qs[j] >> 4) - 8);
  }
}
static void block_q4_1(const uint8_t* b, float* y) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; j++) {
    y[j] = d * (float)(qs[j] & 0xf) + m;
    y[j + 16] = d * (float)(qs[j] >> 4) + m;
  }
}
static inline uint32_t u32_at(const uint8_t* p) {  // a block's 32 fifth bits (little-endian, maybe unaligned)
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
static void block_q5_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint32_t qh = u32_at(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; j++) {
    y[j] = d * (float)((int)((qs[j] & 0xf) | ((qh >> j) & 1) << 4) - 16);
    y[j + 16] = d * (float)((int)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
  }
}
static void block_q5_1(const uint8_t* b, float* y) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint32_t qh = u32_at(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; j++) {
    y[j] = d * (float)((qs[j] & 0xf) | ((qh >> j) & 1) << 4) + m;
    y[j + 16] = d * (float)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
  }
}
// A K-quant's 6-bit scale and min of sub-block i (0..7) from its 12 bytes (ggml's get_scale_min_k4)
static inline void scale_min(const uint8_t* s, int i, int& sc, int& m) {
  if (i < 4) {
    sc = s[i] & 63;
    m = s[i + 4] & 63;
  } else {
    sc = (s[i + 4] & 0xf) | (s[i - 4] >> 6) << 4;
    m = (s[i + 4] >> 4) | (s[i] >> 6) << 4;
  }
}
// Q4_K (qh null) and Q5_K: d, dmin, 12 bytes of scales, (Q5_K: 32 bytes of fifth bits, bit i for sub-block i), then
// 128 bytes of nibbles, each 32 holding sub-blocks 2j (low) and 2j + 1 (high)
static void block_k(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  for (int i = 0; i < 8; i++) {
    int sc, m;
    scale_min(b + 4, i, sc, m);
    const float dl = d * (float)sc, ml = dmin * (float)m;
    const uint8_t* q = qs + 32 * (i / 2);
    const int shift = 4 * (i % 2);
    for (int l = 0; l < 32; l++) {
      const int high = qh ? ((qh[l] >> i) & 1) << 4 : 0;
      y[32 * i + l] = dl * (float)(((q[l] >> shift) & 0xf) | high) - ml;
    }
  }
}
static void block_q4_k(const uint8_t* b, float* y) { block_k(b, nullptr, b + 16, y); }
static void block_q5_k(const uint8_t* b, float* y) { block_k(b, b + 16, b + 48, y); }
// Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 inputs), then d. In each half of
// 128 inputs, input l + 32 k (k = 0..3) has its nibble in byte l (k even) or l + 32 (k odd), the high one for k >= 2,
// and its pair in byte l at bit 2 k: ggml's loop, by 16 inputs of one scale so that the compiler vectorizes it over
// l (a loop over r with r / 64 and r % 32 in it stayed scalar, and slow).
static void block_q6_k(const uint8_t* b, float* y) {
  const float d = half_at(b + 208);
  float dl[16];  // (d * sc) * q, as gguf's d = d * scales, then d * q
  for (int i = 0; i < 16; i++) dl[i] = d * (float)(int8_t)b[192 + i];
  for (int h = 0; h < 2; h++) {
    const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
    const float* sc = dl + 8 * h;
    float* yh = y + 128 * h;
    for (int is = 0; is < 2; is++) {
      const float s0 = sc[is], s1 = sc[is + 2], s2 = sc[is + 4], s3 = sc[is + 6];
      for (int l = 16 * is; l < 16 * is + 16; l++) {
        yh[l] = s0 * (float)(((ql[l] & 0xf) | (qh[l] & 3) << 4) - 32);
        yh[l + 32] = s1 * (float)(((ql[l + 32] & 0xf) | ((qh[l] >> 2) & 3) << 4) - 32);
        yh[l + 64] = s2 * (float)(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
        yh[l + 96] = s3 * (float)(((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
      }
    }
  }
}
// The unquantized tables: one input a "block"
static void block_f32(const uint8_t* b, float* y) { memcpy(y, b, 4); }
static void block_f16(const uint8_t* b, float* y) { *y = half_at(b); }
static void block_bf16(const uint8_t* b, float* y) {  // exact: a bfloat16 is a float32's top half
  const uint32_t bits = (uint32_t)(b[0] | b[1] << 8) << 16;
  memcpy(y, &bits, 4);
}

// Rows index[0..R-1] of the table, each D / INPUTS blocks of BYTES: -1 where an index is out of range (nothing
// written) or the row is shorter than D inputs. A template so that each format's block is inlined into its loop.
template <void (*BLOCK)(const uint8_t*, float*), long INPUTS, long BYTES>
static int gather_blocks(const uint8_t* blocks, long rows, long row_bytes, const int64_t* index, long R, long D,
                         float* y, long ldy) {
  if (D % INPUTS || D / INPUTS * BYTES > row_bytes) return -1;
  for (long r = 0; r < R; r++)
    if (index[r] < 0 || index[r] >= rows) return -1;
  for (long r = 0; r < R; r++) {
    const uint8_t* row = blocks + index[r] * row_bytes;
    for (long i = 0; i < D / INPUTS; i++) BLOCK(row + i * BYTES, y + r * ldy + i * INPUTS);
  }
  return 0;
}

// a: blocks (uint8, a row every row_bytes), rows (in the table), row_bytes, index (R int64), R, D (inputs a row, a
// multiple of the format's block), y (float32), ldy, format (ggml's type id: 0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 6 Q5_0,
// 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K, 30 BF16); -1 also for a format it does not take.
extern "C" int vs_gather_blocks(const int64_t* a) {
  const uint8_t* b = ARG(const uint8_t*, 0);
  const int64_t* index = ARG(const int64_t*, 3);
  const long rows = a[1], row_bytes = a[2], R = a[4], D = a[5], ldy = a[7];
  float* y = ARG(float*, 6);
  switch (a[8]) {
    case 0: return gather_blocks<block_f32, 1, 4>(b, rows, row_bytes, index, R, D, y, ldy);
    case 1: return gather_blocks<block_f16, 1, 2>(b, rows, row_bytes, index, R, D, y, ldy);
    case 30: return gather_blocks<block_bf16, 1, 2>(b, rows, row_bytes, index, R, D, y, ldy);
    case 2: return gather_blocks<block_q4_0, 32, 18>(b, rows, row_bytes, index, R, D, y, ldy);
    case 3: return gather_blocks<block_q4_1, 32, 20>(b, rows, row_bytes, index, R, D, y, ldy);
    case 6: return gather_blocks<block_q5_0, 32, 22>(b, rows, row_bytes, index, R, D, y, ldy);
    case 7: return gather_blocks<block_q5_1, 32, 24>(b, rows, row_bytes, index, R, D, y, ldy);
    case 8: return gather_blocks<block_q8_0, 32, 34>(b, rows, row_bytes, index, R, D, y, ldy);
    case 12: return gather_blocks<block_q4_k, 256, 144>(b, rows, row_bytes, index, R, D, y, ldy);
    case 13: return gather_blocks<block_q5_k, 256, 176>(b, rows, row_bytes, index, R, D, y, ldy);
    case 14: return gather_blocks<block_q6_k, 256, 210>(b, rows, row_bytes, index, R, D, y, ldy);
    default: return -1;
  }
}

// New keys and values (R rows, Hkv heads of D each, a row every `ld` elements) into the cache's slots start .. start
// + R - 1, read from *start (the cache's length) when the call runs: each layer's cache is (Hkv, S, D) contiguous.
// a: k, v, ld, R, Hkv, D, cache_k, cache_v, S, start (int64 *), size
extern "C" int vs_store_kv(const int64_t* a) {
  const char *k = ARG(const char*, 0), *v = ARG(const char*, 1);
  const long ld = a[2], R = a[3], Hkv = a[4], D = a[5], S = a[8], size = a[10];
  char *ck = ARG(char*, 6), *cv = ARG(char*, 7);
  const long start = *ARG(const int64_t*, 9);
  if (start < 0 || start + R > S) return -1;
  for (long r = 0; r < R; r++)
    for (long h = 0; h < Hkv; h++) {
      const long src = (r * ld + h * D) * size, dst = ((h * S + start + r) * D) * size;
      memcpy(ck + dst, k + src, D * size);
      memcpy(cv + dst, v + src, D * size);
    }
  return 0;
}

// The same from float32 rows into a float16 cache: each value saturated to float16's range and rounded to the nearest
// float16, ties to even, as models/cache.py `saturate_f16` and torch's .half() do. a: as vs_store_kv's, size unused
extern "C" int vs_store_kv_f16(const int64_t* a) {
  const float *k = ARG(const float*, 0), *v = ARG(const float*, 1);
  const long ld = a[2], R = a[3], Hkv = a[4], D = a[5], S = a[8];
  f16 *ck = ARG(f16*, 6), *cv = ARG(f16*, 7);
  const long start = *ARG(const int64_t*, 9);
  if (start < 0 || start + R > S) return -1;
  for (long r = 0; r < R; r++)
    for (long h = 0; h < Hkv; h++) {
      const long src = r * ld + h * D, dst = (h * S + start + r) * D;
      for (long i = 0; i < D; i += 16) {
        const vmask m = lanes(D - i);
        store(ck + dst + i, saturate_f16(load(k + src + i, m)), m);
        store(cv + dst + i, saturate_f16(load(v + src + i, m)), m);
      }
    }
  return 0;
}
