// A block-quantized weight packed for the quantized matmul, once at load: ggml's blocks, row by row, laid out as
// quant.cpp's header describes (by blocks of 16 output columns; in each block of 32 inputs, the 16 columns' scales,
// then their quants in groups of 4 inputs side by side, then the bits above the nibbles). Each column block is packed
// alone, on the pool, column by column (each row's blocks read front to back, a stream, where block by block across
// the 16 rows the reads would jump between rows), its quants moved 4 or 8 bytes at a time, never bit by bit, so that
// packing keeps up with reading the weights (numpy, taking them apart and putting them back, made loading slow).
#include "pool.h"
#include "simd.h"

namespace {
enum Format { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };  // quant.cpp's, in kernels.QUANTIZED's order
const int QCOLS = 16;  // output columns per packed block
const int SUPER = 8;   // blocks of 32 inputs per K-quant super-block
constexpr bool k_quant(Format F) { return F == Q4_K || F == Q5_K || F == Q6_K; }
constexpr bool has_min(Format F) { return F == Q4_1 || F == Q5_1; }  // (of the formats by 32 inputs)
constexpr long ggml_bytes(Format F) {  // a ggml block's (a K-quant's super-block's)
  return F == Q8_0 ? 34 : F == Q4_0 ? 18 : F == Q4_1 ? 20 : F == Q5_0 ? 22 : F == Q5_1 ? 24 : F == Q4_K ? 144
         : F == Q5_K ? 176 : 210;
}
// A packed block of 32 inputs: the scales, 16 columns' 2 bytes each (a K-quant's: 1 byte, twice); the quants; the
// higher bits (a Q5's bit planes, Q6_K's 2-bit fields)
constexpr long head_bytes(Format F) { return has_min(F) ? 64 : 32; }
constexpr long block_bytes(Format F) {
  return head_bytes(F) + (F == Q8_0 ? 512 : 256) + (F == Q6_K ? 128 : F == Q5_0 || F == Q5_1 || F == Q5_K ? 64 : 0);
}
constexpr long super_bytes(Format F) { return F == Q6_K ? 32 : 64; }  // a K-quant super-block's header: D (and M)
constexpr long packed_bytes(Format F) {  // per ggml block (super-block) of the 16 columns
  return k_quant(F) ? super_bytes(F) + SUPER * block_bytes(F) : block_bytes(F);
}
const uint8_t ZERO_BLOCK[256] = {};  // a padding row's every block: zero scales, zero quants

inline uint32_t load4(const uint8_t* p) {
  uint32_t w;
  memcpy(&w, p, 4);
  return w;
}
inline uint64_t load8(const uint8_t* p) {
  uint64_t w;
  memcpy(&w, p, 8);
  return w;
}
inline void store4(uint8_t* p, uint32_t w) { memcpy(p, &w, 4); }

// A column's 16 bytes of nibbles as the groups of 4 inputs hold them: bytes 4g .. 4g + 3 in group g (64 bytes each).
inline void groups(uint8_t* quants, int c, uint64_t first, uint64_t second) {
  store4(quants + 4 * c, (uint32_t)first);
  store4(quants + 64 + 4 * c, (uint32_t)(first >> 32));
  store4(quants + 128 + 4 * c, (uint32_t)second);
  store4(quants + 192 + 4 * c, (uint32_t)(second >> 32));
}

// ggml's Q4_0 bytes (input t in byte t's low nibble, t + 16 in its high) from 32 nibbles held in the low (shift 0)
// or high (shift 4) nibbles of 32 bytes at q, inputs 0..15 and 16..31, into the groups.
inline void nibbles(uint8_t* quants, int c, const uint8_t* q, int shift) {
  const uint64_t low = 0x0f0f0f0f0f0f0f0full;
  auto bytes = [&](int t) { return ((load8(q + t) >> shift) & low) | (((load8(q + 16 + t) >> shift) & low) << 4); };
  groups(quants, c, bytes(0), bytes(8));
}

// A column's bit 4 of its 32 inputs as Q5's bit planes, from `bit` (k: inputs 4k .. 4k + 3's, one per byte, as 0 or
// 1): byte i holds group g's input 4g + i in bit 2g, 16 + 4g + i in bit 2g + 1.
template <typename Bits>
inline void planes(uint8_t* high, int c, Bits bit) {
  uint32_t w = 0;
  for (int g = 0; g < 4; g++) w |= bit(g) << 2 * g | bit(4 + g) << (2 * g + 1);
  store4(high + 4 * c, w);
}

inline uint32_t spread(uint32_t nibble) { return (nibble * 0x00204081u) & 0x01010101u; }  // bit i to byte i's bit 0

// The scales, quants and higher bits of one column's ggml block `s` (a K-quant's super-block) into its packed one, o.
template <Format F>
inline void column(const uint8_t* s, int c, uint8_t* o) {
  if constexpr (F == Q8_0) {
    memcpy(o + 2 * c, s, 2);
    for (int g = 0; g < 8; g++) store4(o + 32 + 64 * g + 4 * c, load4(s + 2 + 4 * g) ^ 0x80808080u);  // q + 128
  } else if constexpr (!k_quant(F)) {
    memcpy(o + 2 * c, s, 2);  // d (Q4_1, Q5_1: then m)
    if (has_min(F)) memcpy(o + 32 + 2 * c, s + 2, 2);
    uint8_t* quants = o + head_bytes(F);
    const uint8_t* q = s + ggml_bytes(F) - 16;
    groups(quants, c, load8(q), load8(q + 8));
    if constexpr (F == Q5_0 || F == Q5_1) {
      const uint32_t qh = load4(s + (has_min(F) ? 4 : 2));  // bit j: input j's bit 4
      planes(quants + 256, c, [&](int k) { return spread((qh >> 4 * k) & 15); });
    }
  } else if constexpr (F == Q4_K || F == Q5_K) {
    memcpy(o + 2 * c, s, 2);  // D, M
    memcpy(o + 32 + 2 * c, s + 2, 2);
    const uint8_t* k = s + 4;  // 8 six-bit sc and m in 12 bytes (ggml's get_scale_min_k4)
    const uint8_t* q = s + ggml_bytes(F) - 128;  // 64 inputs per 32 bytes: the low nibbles, then the high ones
    for (int j = 0; j < SUPER; j++) {
      uint8_t* b = o + super_bytes(F) + j * block_bytes(F);
      b[c] = j < 4 ? k[j] & 63 : (k[j + 4] & 15) | (k[j - 4] >> 6) << 4;
      b[16 + c] = j < 4 ? k[j + 4] & 63 : (k[j + 4] >> 4) | (k[j] >> 6) << 4;
      nibbles(b + 32, c, q + 32 * (j / 2), 4 * (j % 2));
      if constexpr (F == Q5_K)  // byte l of qh: bit 4 of input l of each block, block j's in bit j
        planes(b + 288, c, [&](int i) { return (load4(s + 16 + 4 * i) >> j) & 0x01010101u; });
    }
  } else {  // Q6_K: input 128h + 32r + l from ql[64h + 32(r % 2) + l]'s nibble r / 2 and qh[32h + l]'s bits 2r, 2r + 1
    memcpy(o + 2 * c, s + 208, 2);  // D
    for (int j = 0; j < SUPER; j++) {
      uint8_t* b = o + super_bytes(F) + j * block_bytes(F);
      const int h = j / 4, r = j % 4;
      b[c] = s[192 + 2 * j], b[16 + c] = s[193 + 2 * j];  // int8 sc of each 16 inputs
      nibbles(b + 32, c, s + 64 * h + 32 * (r % 2), 4 * (r / 2));
      const uint8_t* qh = s + 128 + 32 * h;
      auto bits = [&](int l) { return (load4(qh + l) >> 2 * r) & 0x03030303u; };  // inputs l .. l + 3's, 0 to 3
      for (int pair = 0; pair < 2; pair++)  // two groups: 2g's low nibbles' inputs, its high ones', then 2g + 1's
        store4(b + 288 + 64 * pair + 4 * c, bits(8 * pair) | bits(16 + 8 * pair) << 2 | bits(8 * pair + 4) << 4 |
                                                 bits(20 + 8 * pair) << 6);
    }
  }
}

template <Format F>
int pack(const int64_t* a) {  // a: blocks, N, ld (bytes), blocks per row, format, out
  const uint8_t* w = ARG(const uint8_t*, 0);
  const long N = a[1], ld = a[2], nb = a[3];
  uint8_t* out = ARG(uint8_t*, 5);
  parallel((N + QCOLS - 1) / QCOLS, 1, [&](long first, long last) {  // column blocks, each written by one thread
    for (long cb = first; cb < last; cb++)
      for (int c = 0; c < QCOLS; c++) {
        const long n = cb * QCOLS + c;
        uint8_t* o = out + cb * nb * packed_bytes(F);
        for (long b = 0; b < nb; b++, o += packed_bytes(F))
          column<F>(n < N ? w + n * ld + b * ggml_bytes(F) : ZERO_BLOCK, c, o);
      }
  });
  return 0;
}
}  // namespace

// ggml's blocks (N rows of `nb` blocks, a row every `ld` bytes; only read) into `out`, (N / 16 rounded up, nb,
// packed_bytes): quant.cpp's layout, the columns past N zero (as their blocks were all zero bytes).
// a: blocks, N, ld (bytes), nb, format (kernels.QUANTIZED's index), out
extern "C" int vs_pack_quantized(const int64_t* a) {
  switch (a[4]) {
    case Q8_0: return pack<Q8_0>(a);
    case Q4_0: return pack<Q4_0>(a);
    case Q4_1: return pack<Q4_1>(a);
    case Q5_0: return pack<Q5_0>(a);
    case Q5_1: return pack<Q5_1>(a);
    case Q4_K: return pack<Q4_K>(a);
    case Q5_K: return pack<Q5_K>(a);
    case Q6_K: return pack<Q6_K>(a);
  }
  return -1;
}
