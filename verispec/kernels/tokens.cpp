// What a decoding step does around a captured forward, so that no Python runs between forwards: the rows' positions
// and visible slots of a causal forward, read from the cache's length when it runs; the argmax of its logits
// (PyTorch's is scalar in bfloat16); and the step from one token of a greedy chain to the next (the chain is
// models/execution.py's `chain`, replayed as one program by models/captured.py's `replay_chain`).
#include <string.h>

#include "simd.h"

#ifdef VS_KERNELS
// The first index of the largest of x[0 .. V - 1], a NaN counting as the largest, as torch.argmax.
template <typename T>
static int64_t argmax(const T* x, long V) {
  vf best = vset1(-INFINITY);
  uint32_t nan = 0;
  for (long j = 0; j < V; j += 16) {
    const vmask m = lanes(V - j);
    const vf v = load(x + j, m);
    nan |= vnan_bits(m, v);
    best = vmax_in(m, best, v);
  }
  const vf top = vset1(vtop(best));
  for (long j = 0; j < V; j += 16) {
    const vmask m = lanes(V - j);
    const vf v = load(x + j, m);
    const uint32_t hit = nan ? vnan_bits(m, v) : veq_bits(m, v, top);
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;  // V == 0
}

// a: x, ldx, R, V, out (int64 *): out[r] = argmax of row r's first V values
template <typename T>
static int argmax_rows(const int64_t* a) {
  const T* x = ARG(const T*, 0);
  const long ldx = a[1], R = a[2], V = a[3];
  int64_t* out = ARG(int64_t*, 4);
  for (long r = 0; r < R; r++) out[r] = argmax(x + r * ldx, V);
  return 0;
}

// After a forward of a chain stored `stored` tokens (at the cache's slots from *length on): the token after them is
// the argmax of its last row's first V logits (ids[argmax] where the logits are over the tokens `ids`, else the
// argmax itself); it becomes out[i] and the next forward's input (*token at *position + 1, seeing the slots up to its
// own), and the cache holds `stored` more. a: logits, V, out (int64 *), i, token (int64 *), position (int64 *),
// visible (uint8 *, the next row's S slots), length (int64 *), S, stored, ids (int64 *, V, or null)
template <typename T>
static int next_token(const int64_t* a) {
  const long V = a[1], i = a[3], S = a[8], stored = a[9];
  int64_t *out = ARG(int64_t*, 2), *token = ARG(int64_t*, 4), *position = ARG(int64_t*, 5);
  int64_t* length = ARG(int64_t*, 7);
  uint8_t* visible = ARG(uint8_t*, 6);
  const int64_t* ids = ARG(const int64_t*, 10);
  const int64_t best = argmax(ARG(const T*, 0), V);
  out[i] = *token = ids ? ids[best] : best;
  *position += 1;
  *length += stored;
  if (*length < S) visible[*length] = 1;  // the next forward's own slot (store_kv refuses one past the cache)
  return 0;
}

// The inputs of a causal forward of R rows after the cache's *length + offset slots (in slot order): row r at
// position *length + offset + r, seeing slots 0 .. that position and no other. Refuses rows past the S slots.
// a: position (int64 *, R), visible (uint8 *, R x S), S, R, length (int64 *), offset
extern "C" int vs_causal_rows(const int64_t* a) {
  int64_t* position = ARG(int64_t*, 0);
  uint8_t* visible = ARG(uint8_t*, 1);
  const long S = a[2], R = a[3], at = *ARG(const int64_t*, 4) + a[5];
  if (at < 0 || at + R > S) return 1;
  for (long r = 0; r < R; r++) {
    position[r] = at + r;
    memset(visible + r * S, 1, at + r + 1);
    memset(visible + r * S + at + r + 1, 0, S - (at + r + 1));
  }
  return 0;
}

extern "C" int vs_argmax_bf16(const int64_t* a) { return argmax_rows<bf16>(a); }
extern "C" int vs_argmax_f32(const int64_t* a) { return argmax_rows<float>(a); }
extern "C" int vs_next_token_bf16(const int64_t* a) { return next_token<bf16>(a); }
extern "C" int vs_next_token_f32(const int64_t* a) { return next_token<float>(a); }
#endif
