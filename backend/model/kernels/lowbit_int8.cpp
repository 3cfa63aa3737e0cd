// The optional fast numerics of `quantization: gguf_int8`, never the default: Q4_1 weights times activations
// rounded to int8 per block of 32 inputs (llama.cpp's Q8_1 idea), with integer products. Not the fp32 model:
// each activation is rounded to 1/127 of its block's largest magnitude (about 0.4 % of it), so outputs differ
// from the exact path by far more than a summation order; benchmarks/tools/fidelity.py measures how often greedy
// tokens still agree. The m term uses the exact fp32 sum of the block's activations.
//
// Per block and output row: d * dx * sum(q * qx) + m * sum(x), where q in 0..15 are the weight's nibbles, qx in
// -127..127 the rounded activations and dx their scale. On the packed layout of lowbit.cpp (per 16-row tile and
// block: d[16], m[16] fp16, then per group of 8 inputs one 32-bit word per row, input j in bits 4j..4j+3), one
// load gives 8 rows' words; `v & 0x0F0F0F0F` holds inputs 0, 2, 4, 6 of each row as bytes and `(v >> 4) & ...`
// inputs 1, 3, 5, 7, so with the activations stored in that order (per group: x0 x2 x4 x6 x1 x3 x5 x7) two
// `maddubs` (unsigned byte x signed byte, pairs summed to int16) take all 64 products of a group. The int16 sums
// cannot saturate: 4 groups x 2 pairs x 2 x 15 x 127 = 30480 < 32767. On AVX-512 CPUs with VNNI, `vpdpbusd`
// multiplies and sums four byte pairs into an int32 lane in one instruction: one 512-bit load holds a group's words
// of all 16 rows, so two instructions take a group's 128 products, into one int32 lane per output row. Both
// copies sum the same integers exactly and then run the same float operations per lane: equal bit for bit.
// The two copies are one file (lowbit_int8_tiles.h) compiled per instruction set by isa_copies.h; a call runs VNNI's
// where its `isa` is AVX-512 and the CPU has VNNI (int8_vnni, from isa.h's run-time detection), else AVX2's.
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"
#include "ops.h"
#include "thread_pool.h"

namespace {

constexpr int kGroups = 4;
constexpr int kRows = 4;  // rows of x per pass over a tile
using TileInt8 = void (*)(const int8_t*, int64_t, const float*, const float*, int64_t, const uint8_t*, int64_t, float*,
                          int64_t, int);

// Per row and block: qx in maddubs order, dx, and the fp32 sum of x.
struct QuantizedRows {
  at::Tensor q, scale, sum;
};

#define ISA_COPY_FILE "lowbit_int8_tiles.h"
#define ISA_COPY_AVX2 1
#define ISA_COPY_AVX512_VNNI 1
#include "isa_copies.h"

}  // namespace

bool int8_vnni(int64_t isa) { return isa == ISA_AVX512 && cpu_has_avx512_vnni(); }

// y [M, N] = x [M, K] @ W^T for Q4_1 W packed as lowbit.cpp packs it, x rounded to int8 per block of 32; with
// VNNI where int8_vnni(isa), else with AVX2's maddubs.
at::Tensor lowbit_linear_int8(at::Tensor x, at::Tensor packed, int64_t out_features, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(best_isa() >= ISA_AVX2, "int8 activations need AVX2");
  x = x.contiguous();
  const int64_t rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK(in_features % kBlock == 0, "in_features must be a multiple of 32, got ", in_features);
  const int64_t blocks = in_features / kBlock, tiles = (out_features + kTile - 1) / kTile;
  TORCH_CHECK(packed.numel() == tiles * blocks * kQ4_1RecordBytes, "packed holds ", packed.numel(),
              " bytes, expected ", tiles * blocks * kQ4_1RecordBytes);
  auto out = at::empty({rows, out_features}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (int8_vnni(isa))
    avx512_vnni::linear(x, w, out_features, tiles, out.data_ptr<float>());
  else
    avx2::linear(x, w, out_features, tiles, out.data_ptr<float>());
  return out;
}
