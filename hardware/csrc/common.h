// What every path of the layout kernel shares: the tile's geometry, the CPU's instruction-set
// targets (each vector path is compiled for its own target and chosen at run time, so one
// build runs on any x86-64 CPU), prefetching and the visit of a range of pages.
//
// Layout of one tile (1024 elements): four 16x16 faces (top-left, top-right, bottom-left,
// bottom-right), each row-major. Tile row r (0..31) holds elements 0..31 of one token's head
// row; its columns 0..15 are face row (r / 16) * 2 + 0, row r % 16, and columns 16..31 are
// face (r / 16) * 2 + 1, row r % 16. A face row of 16 elements is one block-float group:
// group g = face * 16 + row owns exponent byte g and codes g * 16 .. g * 16 + 15 (bfloat8_b,
// one byte each) or g * 8 .. g * 8 + 7 (bfloat4_b, two codes a byte: 2m low, 2m + 1 high).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define HAWK_X86 1
#include <immintrin.h>
// Functions of a vector path carry their target: the rest of the build stays x86-64 baseline.
#define HAWK_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define HAWK_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi,bmi2")))
#endif

// Inlined wherever called, also into a function compiled for a wider target, which then
// compiles it for that target.
#define HAWK_INLINE inline __attribute__((always_inline))

namespace hawk {

constexpr int TILE = 32, FACE = 16, GROUPS = 64;
constexpr int64_t AHEAD = 16;       // pages asked for ahead (two TT blocks of 8 pages)
constexpr int PAGE_GROUP = 8;       // block floats: pages built together (a TT block)
constexpr int64_t GRAIN = 256;      // pages one thread takes at least

// Paths that pack block floats; AUTO is the fastest the CPU has.
enum Path : int64_t { AUTO = 0, PORTABLE = 1, AVX2 = 2, AVX512 = 3 };

// float32 bit pattern of a source element (bfloat16 and float16 widen exactly).
HAWK_INLINE uint32_t f32_bits(uint16_t bf16) { return uint32_t(bf16) << 16; }
HAWK_INLINE uint32_t f32_bits(c10::Half h) {
  float f = static_cast<float>(h);
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
HAWK_INLINE uint32_t f32_bits(uint32_t f32) { return f32; }

// Ask for tile row r of the page ``ahead`` (32 elements: one or two 64-byte lines), into
// every cache level (LEVEL 3) or into L2 and below (LEVEL 2: sixteen pages ahead fill the L1).
template <int LEVEL = 3, typename T>
HAWK_INLINE void prefetch_row(const T* layer, const int64_t* ahead, int r) {
  if (ahead && ahead[r] >= 0) {
    __builtin_prefetch(layer + ahead[r], 0, LEVEL);
    if (sizeof(T) * TILE > 64) __builtin_prefetch(layer + ahead[r] + TILE - 1, 0, LEVEL);
  }
}

// Fills the send rows of pages [begin, end): page p reads the tile rows at
// rows[p * 32 .. + 31] of ``layer`` and writes out + send_rows[p] * stride.
using Range = void (*)(const void* layer, const int64_t* rows, const int64_t* send_rows,
                       uint8_t* out, int64_t begin, int64_t end, int64_t stride);

// Visit pages [begin, end) in order; each tile function asks for the tile rows of the page
// AHEAD pages on while it builds this one, one row per row it builds (``ahead``, null near the
// end): the rows of a TT block are scattered over GPU blocks, so the hardware prefetcher alone
// leaves the loads waiting on memory, and spread out the requests do not queue up behind each
// other.
template <typename T, typename Tile>
inline void each_page(const T* layer, const int64_t* rows, const int64_t* send_rows,
                      uint8_t* out, int64_t begin, int64_t end, int64_t stride, Tile tile) {
  for (int64_t p = begin; p < end; ++p)
    tile(layer, rows + p * TILE, out + send_rows[p] * stride,
         p + AHEAD < end ? rows + (p + AHEAD) * TILE : nullptr);
}

}  // namespace hawk
