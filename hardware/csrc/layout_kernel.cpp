// The HAWK transformation's per-layer pass on the CPU, fused: every page (one tile) is built
// by reading its 32 tile rows straight from the layer's scattered GPU blocks and writing its
// send row once, tilized and packed (bfloat16 / float32 bits as they are, or bfloat8_b /
// bfloat4_b). Byte-exact with hardware.tiles (FACTS.md 1-2). Pages are visited in page order,
// so the tiles of one TT block (the same 32 tokens) follow each other while those tokens are
// in cache; their send rows (grouped by DRAM bank) are far apart, each written whole.
//
// Layout of one tile (1024 elements): four 16x16 faces (top-left, top-right, bottom-left,
// bottom-right), each row-major. Tile row r (0..31) holds elements 0..31 of one token's head
// row; its columns 0..15 are face row (r / 16) * 2 + 0, row r % 16, and columns 16..31 are
// face (r / 16) * 2 + 1, row r % 16. A face row of 16 elements is one block-float group:
// group g = face * 16 + row owns exponent byte g and codes g * 16 .. g * 16 + 15.
//
// sources [n, 32] (int64): element offset in the layer of each page's tile rows, or -1 for
// tile padding (tokens past the request), which reads as zeros; send_rows [n]: the row of
// ``out`` each page fills.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int TILE = 32, FACE = 16, GROUPS = 64;
constexpr int64_t AHEAD = 16;       // pages prefetched ahead (two TT blocks of 8 pages)

// float32 bit pattern of a source element (bfloat16 and float16 widen exactly).
inline uint32_t f32_bits(uint16_t bf16) { return uint32_t(bf16) << 16; }
inline uint32_t f32_bits(c10::Half h) {
  float f = static_cast<float>(h);
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
inline uint32_t f32_bits(uint32_t f32) { return f32; }

// One group of 16 values -> its shared exponent and 16 one-byte sign-magnitude codes, the
// integer recipe of hardware.tiles.bfp_encode: E = max biased exponent; each 24-bit
// significand is shifted right by E - exp (dropped bits are lost), rounded half to even to
// MAG bits and saturated; negative zero and zero magnitudes give code 0.
template <int MAG, typename T>
inline uint8_t encode_group(const T* x, uint8_t* codes) {
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

// One tile of block floats into ``page`` (64 exponent bytes, then the codes).
template <int MAG, typename T>
void pack_tile(const T* layer, const int64_t* rows, uint8_t* page) {
  static const T zeros[TILE] = {};
  uint8_t codes[FACE];
  for (int r = 0; r < TILE; ++r) {
    const T* x = rows[r] < 0 ? zeros : layer + rows[r];
    for (int fc = 0; fc < 2; ++fc) {
      const int g = ((r / FACE) * 2 + fc) * FACE + r % FACE;
      if (MAG == 7) {
        page[g] = encode_group<MAG>(x + fc * FACE, page + GROUPS + g * FACE);
      } else {                  // bfloat4_b: element 2m in the low nibble, 2m + 1 in the high
        page[g] = encode_group<MAG>(x + fc * FACE, codes);
        uint8_t* out = page + GROUPS + g * (FACE / 2);
        for (int m = 0; m < FACE / 2; ++m) out[m] = codes[2 * m] | (codes[2 * m + 1] << 4);
      }
    }
  }
}

// Copy one face row (16 elements, 32 or 64 bytes). STREAM: with non-temporal stores, which
// skip reading the destination's cache lines first (``to`` must be 32-byte aligned).
template <int BYTES, bool STREAM>
inline void copy_face_row(uint8_t* to, const uint8_t* from) {
#if defined(__AVX__)
  if constexpr (STREAM) {
    for (int i = 0; i < BYTES; i += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(to + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i)));
    return;
  }
#endif
  std::memcpy(to, from, BYTES);
}

// One tile with the values as they are (T: an unsigned integer of the element's size): two
// face rows per tile row.
template <typename T, bool STREAM>
void copy_tile(const T* layer, const int64_t* rows, uint8_t* page) {
  constexpr int ESIZE = sizeof(T), face_row = FACE * ESIZE;
  for (int r = 0; r < TILE; ++r) {
    uint8_t* lo = page + ((r / FACE) * 2 * FACE * FACE + (r % FACE) * FACE) * ESIZE;
    uint8_t* hi = lo + FACE * FACE * ESIZE;      // the face to the right
    if (rows[r] < 0) {
      std::memset(lo, 0, face_row);
      std::memset(hi, 0, face_row);
    } else {
      const auto* x = reinterpret_cast<const uint8_t*>(layer + rows[r]);
      copy_face_row<face_row, STREAM>(lo, x);
      copy_face_row<face_row, STREAM>(hi, x + face_row);
    }
  }
}

// Visit the pages in order, asking for the tile rows of the page AHEAD pages on while this
// one is built: the rows of a TT block are scattered over GPU blocks, so the hardware
// prefetcher alone leaves the loads waiting on memory.
template <typename T, typename Tile>
void each_page(const T* layer, const int64_t* rows, const int64_t* send_rows, uint8_t* out,
               int64_t n, int64_t stride, Tile tile) {
  for (int64_t p = 0; p < n; ++p) {
    if (p + AHEAD < n) {
      const int64_t* next = rows + (p + AHEAD) * TILE;
      for (int r = 0; r < TILE; ++r) {
        if (next[r] >= 0) {               // a tile row: 32 elements, 64 or 128 bytes
          __builtin_prefetch(layer + next[r]);
          __builtin_prefetch(layer + next[r] + TILE - 1);
        }
      }
    }
    tile(layer, rows + p * TILE, out + send_rows[p] * stride);
  }
}

template <typename T>
void pack_all(const void* layer, const int64_t* rows, const int64_t* send_rows, uint8_t* out,
              int64_t n, int64_t stride, int64_t mag_bits) {
  const T* src = static_cast<const T*>(layer);
  if (mag_bits == 7) each_page(src, rows, send_rows, out, n, stride,
                               [](auto... a) { pack_tile<7, T>(a...); });
  else each_page(src, rows, send_rows, out, n, stride,
                 [](auto... a) { pack_tile<3, T>(a...); });
}

// layer: the GPU layer (contiguous); sources: [n, 32] int64; send_rows: [n] int64; out:
// uint8 [rows, >= tile bytes] with contiguous rows; mag_bits: 0 (values as they are), 7
// (bfloat8_b) or 3 (bfloat4_b).
void pack_layer(const at::Tensor& layer, const at::Tensor& sources,
                const at::Tensor& send_rows, const at::Tensor& out, int64_t mag_bits) {
  TORCH_CHECK(layer.is_cpu() && layer.is_contiguous(), "layer must be contiguous on the CPU");
  TORCH_CHECK(sources.scalar_type() == at::kLong && sources.is_contiguous() &&
                  sources.dim() == 2 && sources.size(1) == TILE,
              "sources must be contiguous int64 [n, 32]");
  TORCH_CHECK(send_rows.scalar_type() == at::kLong && send_rows.is_contiguous() &&
                  send_rows.numel() == sources.size(0),
              "send_rows must be contiguous int64, one per page");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.dim() == 2 && out.stride(1) == 1,
              "out must be uint8 [rows, bytes] with contiguous rows");
  TORCH_CHECK(mag_bits == 0 || mag_bits == 7 || mag_bits == 3, "mag_bits ", mag_bits);
  const int64_t n = sources.size(0), stride = out.stride(0), esize = layer.element_size();
  const int64_t need = mag_bits ? GROUPS + TILE * TILE * (mag_bits + 1) / 8 : TILE * TILE * esize;
  TORCH_CHECK(out.size(1) >= need, "send rows of ", out.size(1), " bytes, need ", need);
  const int64_t* rows = sources.data_ptr<int64_t>();
  const int64_t* dest = send_rows.data_ptr<int64_t>();
  const int64_t last = layer.numel() - TILE;
  for (int64_t i = 0; i < n * TILE; ++i)
    TORCH_CHECK(rows[i] <= last, "source offset ", rows[i], " past the layer");
  for (int64_t p = 0; p < n; ++p)
    TORCH_CHECK(dest[p] >= 0 && dest[p] < out.size(0), "send row ", dest[p], " out of range");
  uint8_t* dst = out.data_ptr<uint8_t>();
  const void* src = layer.data_ptr();
  if (mag_bits == 0) {
    TORCH_CHECK(esize == 2 || esize == 4, "values of ", esize, " bytes");
    const auto* u16 = static_cast<const uint16_t*>(src);
    const auto* u32 = static_cast<const uint32_t*>(src);
#if defined(__AVX__)
    if (reinterpret_cast<uintptr_t>(dst) % 32 == 0 && stride % 32 == 0) {   // streamed
      if (esize == 2) each_page(u16, rows, dest, dst, n, stride, copy_tile<uint16_t, true>);
      else each_page(u32, rows, dest, dst, n, stride, copy_tile<uint32_t, true>);
      _mm_sfence();                          // the streamed stores, visible before returning
      return;
    }
#endif
    if (esize == 2) each_page(u16, rows, dest, dst, n, stride, copy_tile<uint16_t, false>);
    else each_page(u32, rows, dest, dst, n, stride, copy_tile<uint32_t, false>);
    return;
  }
  switch (layer.scalar_type()) {
    case at::kBFloat16: return pack_all<uint16_t>(src, rows, dest, dst, n, stride, mag_bits);
    case at::kHalf: return pack_all<c10::Half>(src, rows, dest, dst, n, stride, mag_bits);
    case at::kFloat: return pack_all<uint32_t>(src, rows, dest, dst, n, stride, mag_bits);
    default: TORCH_CHECK(false, "block floats from ", layer.scalar_type(), " are not supported");
  }
}

}  // namespace

TORCH_LIBRARY(hawk_layout, m) {
  m.def("pack_layer(Tensor layer, Tensor sources, Tensor send_rows, Tensor(a!) out, "
        "int mag_bits) -> ()");
}

TORCH_LIBRARY_IMPL(hawk_layout, CPU, m) { m.impl("pack_layer", &pack_layer); }
