// The HAWK transformation's per-layer pass on the CPU, fused: every page (one tile) is built
// by reading its 32 tile rows straight from the layer's scattered GPU blocks and writing its
// send row once, tilized and packed (bfloat16 / float32 bits as they are, or bfloat8_b /
// bfloat4_b). Byte-exact with hardware.tiles (docs/facts.md 1-2). Pages are visited in page order,
// so the tiles of one TT block (the same 32 tokens) follow each other while those tokens are
// in cache; their send rows (grouped by DRAM bank) are far apart, each written whole.
//
// Block floats take one of three paths, all giving the same bytes: AVX-512 (pack_avx512.h)
// or AVX2 (pack_avx2.h), each compiled for its own target and chosen at run time by asking
// the CPU, or the portable one (pack_portable.h). The vector paths pack bfloat16 caches with
// intrinsics, float16 and float32 ones with the portable code compiled for their target. The
// build itself is x86-64 baseline, so it runs on any such CPU.
//
// sources [n, 32] (int64): element offset in the layer of each page's tile rows, or -1 for
// tile padding (tokens past the request), which reads as zeros; send_rows [n]: the row of
// ``out`` each page fills.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "pack_avx2.h"
#include "pack_avx512.h"
#include "pack_portable.h"

namespace hawk {
namespace {

// Copy one face row (16 elements, 32 or 64 bytes). STREAM: with non-temporal stores, which
// skip reading the destination's cache lines first (``to`` must be 16-byte aligned).
template <int BYTES, bool STREAM>
inline void copy_face_row(uint8_t* to, const uint8_t* from) {
#if defined(HAWK_X86)
  if constexpr (STREAM) {
    for (int i = 0; i < BYTES; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i)));
    return;
  }
#endif
  std::memcpy(to, from, BYTES);
}

// One tile with the values as they are (T: an unsigned integer of the element's size): two
// face rows per tile row.
template <typename T, bool STREAM>
void copy_tile(const T* layer, const int64_t* rows, uint8_t* page, const int64_t* ahead) {
  constexpr int ESIZE = sizeof(T), face_row = FACE * ESIZE;
  for (int r = 0; r < TILE; ++r) {
    prefetch_row(layer, ahead, r);
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

// Values as they are; STREAM: non-temporal stores (every send row 16-byte aligned).
template <typename T, bool STREAM>
void copy_range(const void* layer, const int64_t* rows, const int64_t* send_rows, uint8_t* out,
                int64_t begin, int64_t end, int64_t stride) {
  each_page(static_cast<const T*>(layer), rows, send_rows, out, begin, end, stride,
            copy_tile<T, STREAM>);
#if defined(HAWK_X86)
  if constexpr (STREAM) _mm_sfence();      // the streamed stores, visible before returning
#endif
}

// Whether this CPU runs ``path`` (AUTO: always).
bool cpu_has(int64_t path) {
#if defined(HAWK_X86)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (path == AVX2) return avx2;
  if (path == AVX512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#endif
  return path == AUTO || path == PORTABLE;
}

// The fastest path this CPU runs.
int64_t best_path() {
  for (int64_t path : {AVX512, AVX2})
    if (cpu_has(path)) return path;
  return PORTABLE;
}

// Block floats of MAG magnitude bits from a cache of T by ``path``: the vector paths pack
// bfloat16 caches with their own code, float16 and float32 ones with the portable code
// compiled for their target.
template <int MAG, typename T>
Range block_float_range(int64_t path) {
#if defined(HAWK_X86)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (path == AVX512) return pack_range_avx512<MAG>;
    if (path == AVX2) return pack_range_avx2<MAG>;
  } else {
    if (path == AVX512) return pack_range_wide_avx512<MAG, T>;
    if (path == AVX2) return pack_range_wide_avx2<MAG, T>;
  }
#endif
  return pack_range_portable<MAG, T>;
}

template <typename T>
Range block_float_range(int64_t mag_bits, int64_t path) {
  return mag_bits == 7 ? block_float_range<7, T>(path) : block_float_range<3, T>(path);
}

// layer: the GPU layer (contiguous); sources: [n, 32] int64; send_rows: [n] int64, each row
// at most once; out: uint8 [rows, >= tile bytes] with contiguous rows; mag_bits: 0 (values
// as they are), 7 (bfloat8_b) or 3 (bfloat4_b); path: AUTO, or the one to take (refused where
// the CPU lacks it).
// Pages are split over torch's intra-op threads (at::parallel_for, in PAGE_GROUP units of at
// least GRAIN pages: in this thread where torch has one or the layer is small); no two pages
// write the same send row, so the bytes do not depend on the split.
void pack_layer(const at::Tensor& layer, const at::Tensor& sources, const at::Tensor& send_rows,
                const at::Tensor& out, int64_t mag_bits, int64_t path) {
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
  TORCH_CHECK(path >= AUTO && path <= AVX512, "path ", path, " (0 auto, 1 portable, 2 avx2, "
              "3 avx512)");
  TORCH_CHECK(cpu_has(path), "path ", path, " needs instructions this CPU lacks");
  const int64_t n = sources.size(0), stride = out.stride(0), esize = layer.element_size();
  const int64_t need = mag_bits ? GROUPS + TILE * TILE * (mag_bits + 1) / 8 : TILE * TILE * esize;
  TORCH_CHECK(out.size(1) >= need, "send rows of ", out.size(1), " bytes, need ", need);
  const int64_t* rows = sources.data_ptr<int64_t>();
  const int64_t* dest = send_rows.data_ptr<int64_t>();
  const int64_t last = layer.numel() - TILE;
  for (int64_t i = 0; i < n * TILE; ++i)
    TORCH_CHECK(rows[i] <= last, "source offset ", rows[i], " past the layer");
  std::vector<uint8_t> filled(out.size(0), 0);
  for (int64_t p = 0; p < n; ++p) {
    TORCH_CHECK(dest[p] >= 0 && dest[p] < out.size(0), "send row ", dest[p], " out of range");
    TORCH_CHECK(!filled[dest[p]]++, "send row ", dest[p], " is given to two pages");
  }
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (path == AUTO) path = best_path();
  Range range = nullptr;
  if (mag_bits == 0) {
    TORCH_CHECK(esize == 2 || esize == 4, "values of ", esize, " bytes");
    const bool stream = reinterpret_cast<uintptr_t>(dst) % 16 == 0 && stride % 16 == 0;
    if (esize == 2) range = stream ? copy_range<uint16_t, true> : copy_range<uint16_t, false>;
    else range = stream ? copy_range<uint32_t, true> : copy_range<uint32_t, false>;
  } else {
    switch (layer.scalar_type()) {
      case at::kBFloat16: range = block_float_range<uint16_t>(mag_bits, path); break;
      case at::kHalf: range = block_float_range<c10::Half>(mag_bits, path); break;
      case at::kFloat: range = block_float_range<uint32_t>(mag_bits, path); break;
      default: TORCH_CHECK(false, "block floats from ", layer.scalar_type(), " are not supported");
    }
  }
  const void* src = layer.data_ptr();
  at::parallel_for(0, (n + PAGE_GROUP - 1) / PAGE_GROUP, GRAIN / PAGE_GROUP,
                   [&](int64_t begin, int64_t end) {
                     range(src, rows, dest, dst, begin * PAGE_GROUP,
                           std::min(end * PAGE_GROUP, n), stride);
                   });
}

bool supports(int64_t path) { return path >= AUTO && path <= AVX512 && cpu_has(path); }

}  // namespace
}  // namespace hawk

// Built twice (hardware/layout_kernel.py): serial as torch.ops.hawk_layout, and with -fopenmp
// as torch.ops.hawk_layout_omp (HAWK_LIB), whose at::parallel_for splits the pages over
// threads (its OpenMP pragma is in a header, so only code built with -fopenmp runs it).
#ifndef HAWK_LIB
#define HAWK_LIB hawk_layout
#endif
#define HAWK_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define HAWK_TORCH_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

HAWK_TORCH_LIBRARY(HAWK_LIB, m) {
  m.def("pack_layer(Tensor layer, Tensor sources, Tensor send_rows, Tensor(a!) out, "
        "int mag_bits, int path=0) -> ()");
  m.def("supports", &hawk::supports);          // whether this CPU runs a path
  m.def("best_path", &hawk::best_path);        // the one AUTO takes
}

HAWK_TORCH_LIBRARY_IMPL(HAWK_LIB, CPU, m) {
  m.impl("pack_layer", &hawk::pack_layer);
}
