// The portable path: block floats packed in plain C++ that any compiler builds for any CPU,
// the bfloat16 loops written so that it vectorises them (16-bit lanes, constant shifts and
// selects only), and the values as they are copied tile row by tile row.
#pragma once

#include <algorithm>
#include <type_traits>

#include "common.h"

namespace hawk {

// One group of 16 values -> its shared exponent and 16 one-byte sign-magnitude codes, the
// integer recipe of hardware.tiles.bfp_encode: E = max biased exponent; each 24-bit
// significand is shifted right by E - exp (dropped bits are lost), rounded half to even to
// MAG bits and saturated; negative zero and zero magnitudes give code 0.
template <int MAG, typename T>
HAWK_INLINE uint8_t encode_group(const T* x, uint8_t* codes) {
  constexpr uint32_t drop = 24 - MAG, half = 1u << (drop - 1), lim = (1u << MAG) - 1;
  uint32_t bits[FACE], exp[FACE], code[FACE], shared = 0;
  for (int i = 0; i < FACE; ++i) {
    bits[i] = f32_bits(x[i]);
    exp[i] = (bits[i] >> 23) & 0xFF;
  }
  for (int i = 0; i < FACE; ++i) shared = std::max(shared, exp[i]);
  for (int i = 0; i < FACE; ++i) {
    uint32_t mant = exp[i] ? (bits[i] & 0x7FFFFF) | 0x800000 : 0;
    uint32_t aligned = mant >> std::min(shared - exp[i], 31u);
    uint32_t q = std::min((aligned + (half - 1) + ((aligned >> drop) & 1)) >> drop, lim);
    code[i] = q ? ((bits[i] >> 31) << MAG) | q : 0;
  }
  for (int i = 0; i < FACE; ++i) codes[i] = uint8_t(code[i]);
  return uint8_t(shared);
}

// The same recipe for bfloat16 in 16-bit arithmetic (the AVX2 path does the same). A
// bfloat16's significand with the hidden bit is 8 bits; put at the top of a 16-bit lane,
// Y = 1.mmmmmmm << 8, and halved (a = Y >> 1 >> k for k = E - exp), it keeps all its bits
// whenever the code can be non-zero (k <= 7); for k >= 8 (and for exp 0, a zero or denormal)
// a is below half and the code is 0. Rounding a from 15 bits (dropping 15 - MAG) gives the
// 24-bit recipe's codes, and a + half stays below 0x8800, so a signed 16-bit lane never
// overflows. Written for the compiler to vectorise on any target: signed 16-bit lanes (SSE2
// has their max and compares), the maximum as a tree, the shift by k as three constant
// shifts under masks, no branches and no stores that may alias the input.
template <int MAG>
HAWK_INLINE uint8_t encode_group_bf16(const uint16_t* __restrict in, uint8_t* __restrict out) {
  constexpr int drop = 15 - MAG, up = (1 << (drop - 1)) - 1, lim = (1 << MAG) - 1;
  int16_t x[FACE], exp[FACE], top[FACE / 2];
  uint8_t codes[FACE];
  std::memcpy(x, in, sizeof x);
  for (int i = 0; i < FACE; ++i) exp[i] = int16_t((x[i] >> 7) & 0xFF);
  for (int i = 0; i < FACE / 2; ++i) top[i] = std::max(exp[i], exp[i + FACE / 2]);
  for (int w = FACE / 4; w; w /= 2)
    for (int i = 0; i < w; ++i) top[i] = std::max(top[i], top[i + w]);
  const int16_t shared = top[0];
  for (int i = 0; i < FACE; ++i) {
    const int k = shared - exp[i];
    int a = ((x[i] & 0x7F) << 7) | 0x4000;                              // Y >> 1
    int m = -(k & 1);
    a = ((a >> 1) & m) | (a & ~m);
    m = -((k >> 1) & 1);
    a = ((a >> 2) & m) | (a & ~m);
    m = -((k >> 2) & 1);
    a = ((a >> 4) & m) | (a & ~m);
    a &= -int((k < 8) & (exp[i] != 0));
    const int q = std::min((a + up + ((a >> drop) & 1)) >> drop, lim);
    codes[i] = uint8_t(q | (q != 0 ? ((x[i] >> 15) & 1) << MAG : 0));
  }
  std::memcpy(out, codes, FACE);
  return uint8_t(shared);
}

template <int MAG, typename T>
HAWK_INLINE uint8_t encode_any(const T* x, uint8_t* codes) {
  if constexpr (std::is_same_v<T, uint16_t>) return encode_group_bf16<MAG>(x, codes);
  else return encode_group<MAG>(x, codes);
}

// One tile of block floats into ``page`` (64 exponent bytes, then the codes).
template <int MAG, typename T>
HAWK_INLINE void pack_tile_portable(const T* layer, const int64_t* rows, uint8_t* page,
                        const int64_t* ahead) {
  static const T zeros[TILE] = {};
  uint8_t codes[FACE];
  for (int r = 0; r < TILE; ++r) {
    prefetch_row(layer, ahead, r);
    const T* x = rows[r] < 0 ? zeros : layer + rows[r];
    for (int fc = 0; fc < 2; ++fc) {
      const int g = ((r / FACE) * 2 + fc) * FACE + r % FACE;
      if constexpr (MAG == 7) {
        page[g] = encode_any<MAG>(x + fc * FACE, page + GROUPS + g * FACE);
      } else {                  // bfloat4_b: element 2m in the low nibble, 2m + 1 in the high
        page[g] = encode_any<MAG>(x + fc * FACE, codes);
        uint8_t* out = page + GROUPS + g * (FACE / 2);
        for (int m = 0; m < FACE / 2; ++m) out[m] = codes[2 * m] | (codes[2 * m + 1] << 4);
      }
    }
  }
}

// Pages [begin, end) in order, each asking for the tile rows of the page AHEAD on (see
// each_page). HAWK_INLINE all the way down, so that the vector paths can compile this same
// code for their own targets (float16 and float32 caches there).
template <int MAG, typename T>
HAWK_INLINE void pack_pages_portable(const void* layer, const int64_t* rows,
                                     const int64_t* send_rows, uint8_t* out, int64_t begin,
                                     int64_t end, int64_t stride) {
  const T* src = static_cast<const T*>(layer);
  for (int64_t p = begin; p < end; ++p)
    pack_tile_portable<MAG, T>(src, rows + p * TILE, out + send_rows[p] * stride,
                               p + AHEAD < end ? rows + (p + AHEAD) * TILE : nullptr);
}

template <int MAG, typename T>
void pack_range_portable(const void* layer, const int64_t* rows, const int64_t* send_rows,
                         uint8_t* out, int64_t begin, int64_t end, int64_t stride) {
  pack_pages_portable<MAG, T>(layer, rows, send_rows, out, begin, end, stride);
}

}  // namespace hawk
