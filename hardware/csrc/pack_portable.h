// The portable path: block floats packed in plain C++ that any compiler builds for any CPU,
// from bfloat16 in whole-tile passes written so that it vectorises them (16-bit lanes, no
// variable shift, no branch), from float16 and float32 group by group.
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

// One bfloat16 tile of block floats into ``page``: the recipe of encode_group in 16-bit
// arithmetic (the AVX2 path does the same), in passes over the whole tile that a compiler
// vectorises for any target (SSE2, NEON): 16-bit lanes, no variable shift, no branch. A
// bfloat16's significand with the hidden bit is 8 bits, Y = 1.mmmmmmm; a = Y << (7 - k)
// for k = E - exp (the product of three factors 2, 4 and 16, or 1, picked by k's bits) is
// Y << 8 >> 1 >> k with all its bits whenever the code can be non-zero (k <= 7); for k >= 8
// (and for exp 0, a zero or denormal) the code is 0. Rounding a from 15 bits (dropping
// 15 - MAG) gives the 24-bit recipe's codes, and a + half stays below 0x8800.
template <int MAG>
HAWK_INLINE void pack_tile_bf16(const uint16_t* layer, const int64_t* rows, uint8_t* page,
                                const int64_t* ahead) {
  constexpr int drop = 15 - MAG, up = (1 << (drop - 1)) - 1, lim = (1 << MAG) - 1;
  constexpr int N = TILE * TILE, G = 2 * TILE;    // values, groups (in tile row order here)
  uint16_t x[N];
  int16_t exp[N], top[G][FACE / 2], shared[G];
  uint8_t codes[N];
  for (int r = 0; r < TILE; ++r) {                // tile row r: groups 2r and 2r + 1
    prefetch_row(layer, ahead, r);
    if (rows[r] < 0) std::memset(x + r * TILE, 0, sizeof(uint16_t) * TILE);
    else std::memcpy(x + r * TILE, layer + rows[r], sizeof(uint16_t) * TILE);
  }
  for (int i = 0; i < N; ++i) exp[i] = int16_t((x[i] >> 7) & 0xFF);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < FACE / 2; ++i)
      top[g][i] = std::max(exp[g * FACE + i], exp[g * FACE + FACE / 2 + i]);
  for (int g = 0; g < G; ++g) {
    int16_t e = top[g][0];
    for (int i = 1; i < FACE / 2; ++i) e = std::max(e, top[g][i]);
    shared[g] = e;
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < FACE; ++j) {
      const int i = g * FACE + j;
      const uint16_t k = uint16_t(shared[g] - exp[i]);
      const uint16_t by2 = uint16_t(2 - (k & 1)), by4 = uint16_t(4 - 3 * ((k >> 1) & 1)),
                     by16 = uint16_t(16 - 15 * ((k >> 2) & 1));
      uint16_t a = uint16_t(uint16_t((x[i] & 0x7F) | 0x80) * uint16_t(by2 * by4) * by16);
      a = uint16_t(a & uint16_t(-uint16_t((k < 8) & (exp[i] != 0))));
      const uint16_t sum = uint16_t(a + up + ((a >> drop) & 1));      // half to even
      const int16_t q = std::min(int16_t(sum >> drop), int16_t(lim));
      const int16_t sign = int16_t(((x[i] >> 15) & 1) << MAG);
      codes[i] = uint8_t(q | (q != 0 ? sign : int16_t(0)));
    }
  for (int g = 0; g < G; ++g) {                   // tile row order -> face order
    const int r = g / 2, to = ((r / FACE) * 2 + g % 2) * FACE + r % FACE;
    page[to] = uint8_t(shared[g]);
    const uint8_t* c = codes + g * FACE;
    if constexpr (MAG == 7) {
      std::memcpy(page + GROUPS + to * FACE, c, FACE);
    } else {                    // bfloat4_b: element 2m in the low nibble, 2m + 1 in the high
      uint8_t* out = page + GROUPS + to * (FACE / 2);
      for (int m = 0; m < FACE / 2; ++m) out[m] = uint8_t(c[2 * m] | (c[2 * m + 1] << 4));
    }
  }
}

// One tile of block floats from float16 or float32 into ``page`` (64 exponent bytes, then
// the codes).
template <int MAG, typename T>
HAWK_INLINE void pack_tile_wide(const T* layer, const int64_t* rows, uint8_t* page,
                                const int64_t* ahead) {
  static const T zeros[TILE] = {};
  uint8_t codes[FACE];
  for (int r = 0; r < TILE; ++r) {
    prefetch_row(layer, ahead, r);
    const T* x = rows[r] < 0 ? zeros : layer + rows[r];
    for (int fc = 0; fc < 2; ++fc) {
      const int g = ((r / FACE) * 2 + fc) * FACE + r % FACE;
      if constexpr (MAG == 7) {
        page[g] = encode_group<MAG>(x + fc * FACE, page + GROUPS + g * FACE);
      } else {                  // bfloat4_b: element 2m in the low nibble, 2m + 1 in the high
        page[g] = encode_group<MAG>(x + fc * FACE, codes);
        uint8_t* out = page + GROUPS + g * (FACE / 2);
        for (int m = 0; m < FACE / 2; ++m) out[m] = codes[2 * m] | (codes[2 * m + 1] << 4);
      }
    }
  }
}

template <int MAG, typename T>
HAWK_INLINE void pack_tile_portable(const T* layer, const int64_t* rows, uint8_t* page,
                                    const int64_t* ahead) {
  if constexpr (std::is_same_v<T, uint16_t>) pack_tile_bf16<MAG>(layer, rows, page, ahead);
  else pack_tile_wide<MAG, T>(layer, rows, page, ahead);
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
