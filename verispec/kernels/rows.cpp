// The row-wise work around the matmuls, one call each instead of a few PyTorch ops: RMSNorm, rotary, silu(gate) * up,
// and the copies that a forward's kernels read from and write to (token embeddings and rotary tables by index; new
// keys and values into the cache).
#include "pool.h"
#include "simd.h"

#ifdef VS_KERNELS
// Rounded as the PyTorch model rounds (models/llama.py): RMSNorm in float32, cast to the dtype, times the weight;
// rotary as x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype.

template <typename T>
static void rms_norm(const T* x, long ldx, const T* w, T* y, long ldy, long R, long D, float eps) {
  parallel(R, 16, [&](long first, long last) {
    for (long r = first; r < last; r++) {
      const T* xr = x + r * ldx;
      vf sum = vzero();
      for (long i = 0; i < D; i += 16) {
        const vf h = load(xr + i, lanes(D - i));
        sum = vfmadd(h, h, sum);
      }
      const vf scale = vset1(1.0f / sqrtf(vsum(sum) / (float)D + eps));
      for (long i = 0; i < D; i += 16) {
        const vmask mk = lanes(D - i);
        const vf h = round_to(vmul(load(xr + i, mk), scale), (const T*)0);
        store(y + r * ldy + i, vmul(load(w + i, mk), h), mk);
      }
    }
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

template <typename T>
static void silu_mul(const T* x, long ldx, T* y, long ldy, long R, long I) {  // x: [gate | up], I each
  parallel(R, 2, [&](long first, long last) {
    for (long r = first; r < last; r++)
      for (long i = 0; i < I; i += 16) {
        const vmask mk = lanes(I - i);
        const vf g = load(x + r * ldx + i, mk), u = load(x + r * ldx + I + i, mk);
        const vf s = vdiv(g, vadd(vset1(1.0f), exp_ps(vsub(vzero(), g))));
        store(y + r * ldy + i, vmul(round_to(s, (const T*)0), u), mk);
      }
  });
}

// a: x, ldx, w, y, ldy, R, D, eps (float bits)
extern "C" int vs_rms_norm_bf16(const int64_t* a) {
  rms_norm(ARG(const bf16*, 0), a[1], ARG(const bf16*, 2), ARG(bf16*, 3), a[4], a[5], a[6], float_arg(a, 7));
  return 0;
}
extern "C" int vs_rms_norm_f32(const int64_t* a) {
  rms_norm(ARG(const float*, 0), a[1], ARG(const float*, 2), ARG(float*, 3), a[4], a[5], a[6], float_arg(a, 7));
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
  silu_mul(ARG(const bf16*, 0), a[1], ARG(bf16*, 2), a[3], a[4], a[5]);
  return 0;
}
extern "C" int vs_silu_mul_f32(const int64_t* a) {
  silu_mul(ARG(const float*, 0), a[1], ARG(float*, 2), a[3], a[4], a[5]);
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
