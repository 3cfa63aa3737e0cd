// Weight-only low-bit linear layers with fp32 activations and fp32 accumulation: y = x @ W^T, where W is
// held in blocks of 32 inputs per output row, w = d * q (+ m), q a small integer, d and m one per block. Every
// GGUF block type we serve becomes one of these records at load (weight_blocks.py), each weight exactly as
// gguf-py de-quantizes it:
//   q4_1  4-bit q, fp16 d and m       GGUF Q4_1; Q4_0 (q - 8 = q + m with m = -8d, exact)
//   q8_0  8-bit q, fp16 d             GGUF Q8_0; Q5_0 (q - 16)
//   q5_1  8-bit words of 5-bit q, fp16 d and m           GGUF Q5_1
//   q4_k  4-bit q, fp32 d and m       GGUF Q4_K (d = d_super * scale and m = -dmin * min: exact in fp32)
//   q5_k  8-bit words of 5-bit q, fp32 d and m           GGUF Q5_K
//   q6_k  16-bit q = scale * (q6 - 32), fp16 d           GGUF Q6_K (the 16-input sub-block's int8 scale folded
//                                                        into q; d * q is the same exact product)
//   f16, bf16  the weight itself, 16 bits, no scale      GGUF F16 / BF16; a checkpoint's 16-bit weights
// The step reads 4.5 (Q4_1) to 16.5 (q6_k) bits per weight instead of 32; f16 and bf16 read 16.
//
// Arithmetic. Per block and output row the kernel computes d * sum(q * x) (+ m * sum(x) where the format has
// m), the reference's sum(w * x) regrouped: q is a small integer, exact in fp32, and the sum of x over each block
// is computed once per call and shared by every output row. That is one FMA per weight (the product) where
// de-quantizing first costs two. The reference de-quantizes w = d * q + m with one rounding (d * q is exact in
// fp32); the regrouped sum skips that rounding, so it differs from the dense fp32 matmul on the de-quantized
// weights by one rounding of each weight (2^-24 relative) on top of a summation-order change: the size of the
// difference between two fp32 summation orders (docs/engine.md, "Exactness of the low-bit kernels", gives the
// bound and the measured differences). Formats without m (w = d * q exactly) are a pure regrouping. Where a tile
// is de-quantized into memory (above 16 rows), the weights are bit for bit the reference's.
//
// Packed layout (made by `Blocks.pack`, once at load): output rows in tiles of 16; per tile, per block of
// 32 inputs, one record: the tile's d[16] (and m[16]), fp16 or fp32, then 32-bit words, 16 per group of
// consecutive inputs (one per output row): a 4-bit word holds 8 inputs of its row, input j in bits 4j..4j+3; an
// 8-bit word 4, input j in byte j; a 16-bit word 2. One vector load gives 8 or 16 output rows (the lanes) of a
// group, and input j of every lane is one mask: `v & (0xF << 4j)` is q * 2^4j, exact in fp32 (8 and 16 bits: the
// field shifted to the top of the word, q * 2^24 or q * 2^16, signed). x[j] is scaled by the inverse power of two
// beforehand (exact), so the product is q * x[j]. No widening shuffles, no per-weight conversion of d and m, no
// horizontal sums. f16 and bf16 weights are laid out as a de-quantized tile is (per tile, input-major: 16 rows
// of input 0, then of input 1, ...), each value converted exactly as it is loaded (F16C's conversion; bf16 is the top
// half of an fp32), into the same dense kernel the buffered path runs.
//
// The tile kernels are written once (lowbit_tiles.h) and compiled per instruction set by isa_copies.h, never with
// the build machine's flags: AVX2 + FMA + F16C (8 lanes), AVX-512 (16 lanes), and the 16-lane code on AVX2
// instructions, which lets the tests run the AVX-512 copy's source on any CPU; each call runs the copy its `isa`
// names (isa.h).
#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "isa.h"
#include "ops.h"
#include "thread_pool.h"

namespace {

// Q4_1_INT8: Q4_1 weights with activations rounded to int8 (lowbit_int8.cpp), `quantization: gguf_int8`.
// F32_TILE is not a stored format: the buffered path's de-quantized tile, which the dense kernel reads.
enum Format { Q4_1 = 0, Q8_0 = 1, Q4_1_INT8 = 2, Q5_1 = 3, Q4_K = 4, Q5_K = 5, Q6_K = 6, F16 = 7, BF16 = 8, F32_TILE = 9 };
constexpr bool known_format(int64_t f) { return f == Q4_1 || f == Q8_0 || (f >= Q5_1 && f <= BF16); }
constexpr bool is_half(int64_t f) { return f == F16 || f == BF16; }

// A record format's traits: bits per q, whether blocks have an offset m (scales are fp16).
constexpr int word_bits(int format) {
  return format == Q4_1 || format == Q4_K ? 4 : is_half(format) ? 16 : 8;
}
constexpr bool has_min(int format) { return format == Q4_1 || format == Q5_1 || format == Q4_K || format == Q5_K; }
constexpr int header_bytes(int format) {
  return is_half(format) ? 0 : (has_min(format) ? 2 : 1) * kTile * 2;
}
constexpr int inputs_per_word(int format) { return 32 / word_bits(format); }
constexpr int word_block_bytes(int format) { return kTile * kBlock * word_bits(format) / 8; }  // one block's words
// K-quants keep the file's two-level scales: per tile and super-block of 8 blocks (256 inputs) one super-record,
// its header the rows' fp16 d (and dmin), then per block the rows' integer scales (and mins) as bytes, then the 8
// blocks' words. Q4_K / Q5_K: a block's d = d * scale and m = -(dmin * min), exact in fp32 (11 + 6 bits); Q6_K:
// two 16-input sub-blocks per block, each with its int8 scale (d * scale: 11 + 8 bits), q - 32 in 8-bit words.
// 4.625 (Q4_K), 8.625 (Q5_K) and 8.5625 (Q6_K) bits per weight, against the file's 4.5, 5.5 and 6.5625.
constexpr int kSuper = 8;  // blocks per super-block
constexpr bool is_super(int format) { return format == Q4_K || format == Q5_K || format == Q6_K; }
constexpr int sub_blocks(int format) { return format == Q6_K ? 2 : 1; }  // scales per block
constexpr int super_header_bytes(int format) {
  return (has_min(format) ? 2 : 1) * kTile * 2 + (has_min(format) ? 2 : 1) * kSuper * sub_blocks(format) * kTile;
}
// Bytes per block of 32 inputs of a tile (a super-record's share for K-quants: a whole number for each).
constexpr int record_bytes(int format) {
  return is_super(format) ? super_header_bytes(format) / kSuper + word_block_bytes(format)
                          : header_bytes(format) + word_block_bytes(format);
}
static_assert(super_header_bytes(Q4_K) % kSuper == 0 && super_header_bytes(Q6_K) % kSuper == 0, "whole records");
static_assert(record_bytes(Q4_1) == kQ4_1RecordBytes, "isa.h's Q4_1 record");
constexpr int weight_bytes(int format) { return format == F32_TILE ? 4 : 2; }  // what the dense kernel reads
// x[j] is multiplied by this before the kernel (a power of two: exact), so that it meets q * 2^shift.
constexpr float input_scale(int format, int j) {
  if (word_bits(format) == 4) return j < 7 ? 1.0f / float(1u << (4 * j)) : 1.0f;
  return 1.0f / float(1u << (32 - word_bits(format)));
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, int64_t, float*, int64_t, int);
using DequantFn = void (*)(const uint8_t*, int64_t, float*);
using DenseFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, float*, int64_t, int);

constexpr int kMaxRows = 8;
struct Kernels {
  int rows;          // rows of x per register block, at most
  int preferred_rows;  // per register block where more save no block (row_blocks)
  int buffer_above;  // steps of more rows de-quantize each tile into memory once (dequant, then dense)
  TileFn tile[kMaxRows];
  DequantFn dequant;
  DenseFn dense[kMaxRows];  // over a de-quantized tile; for f16 and bf16, over the stored tile
};

#define ISA_COPY_FILE "lowbit_tiles.h"
#define ISA_COPY_AVX2 1
#define ISA_COPY_WIDE_ON_AVX2 1
#define ISA_COPY_AVX512 1
#include "isa_copies.h"

Kernels kernels_for(int isa, int format) {
  // Up to 16 rows AVX2 re-de-quantizes each tile in registers for every block of 4 (or 5) rows; above that, a tile
  // de-quantized once into memory and streamed over by every block of rows is faster: on a 2-core AVX2 EPYC the
  // engine decoded 1.15x and 1.21x as fast at batch 32 (two runs of interleaved processes, 1.09x at 24) and served
  // 32 streams through Triton 1.10x as fast (docs/benchmarks.md). AVX-512 the same, in blocks of up to 8 rows: a
  // 9-row step (8 drafts verified, or 9 decoding sequences) 15-16 ms against 25-28 ms buffered, 16 rows 25-27
  // against 34-36 ms, on a 2-core AVX-512 EPYC (docs/decisions.md).
  if (isa == ISA_AVX2) return avx2::kernels(format, 16, 4, std::make_integer_sequence<int, 5>());
  if (isa == ISA_AVX512) return avx512::kernels(format, 16, kMaxRows, std::make_integer_sequence<int, kMaxRows>());
  return wide_on_avx2::kernels(format, kMaxRows, kMaxRows, std::make_integer_sequence<int, kMaxRows>());
}

// x scaled per input by `input_scale` (what the tile kernels multiply), and where blocks have m the sum of x over
// each block, in the calling thread's scratch, which the pool's workers read while this thread waits for them in
// pool::run. No tensors: with their allocations a one-row call spent about 0.6 us more of its 2 us serial setup
// (121 calls a step; docs/benchmarks.md, "The one-row pass, op by op").
struct ScaledInputs {
  const float* scaled;
  const float* sums;
};

ScaledInputs scaled_inputs(const float* in, int64_t rows, int64_t in_features, int format) {
  const int64_t blocks = in_features / kBlock;
  // One block's pattern of scales (a word's repeats), so that the loop below has a fixed trip count and no
  // division per input.
  const int per_word = inputs_per_word(format);
  float scale[kBlock];
  for (int j = 0; j < per_word; ++j) scale[j] = input_scale(format, j);
  for (int j = per_word; j < kBlock; ++j) scale[j] = scale[j - per_word];
  thread_local std::vector<float> xs, sums;
  xs.resize(rows * in_features);
  sums.resize(has_min(format) ? rows * blocks : 0);
  float* scaled = xs.data();
  for (int64_t b = 0; b < rows * blocks; ++b)
    for (int j = 0; j < kBlock; ++j) scaled[b * kBlock + j] = in[b * kBlock + j] * scale[j];
  if (has_min(format)) {
    float* s = sums.data();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = in + r * in_features + b * kBlock;
        float lanes[8] = {};
        for (int i = 0; i < kBlock; ++i) lanes[i % 8] += xb[i];
        s[r * blocks + b] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
      }
  }
  return {xs.data(), sums.data()};
}

// The rows of x in each register block of a step of `rows`, in order: blocks of `preferred` rows (the last one the
// rest) unless blocks of up to `most` save one, each block being one more pass over the tile. AVX2: 5 rows as one
// block, not 4 + 1 (a speculative step of k = 4 verifies 5 rows), 9 as 5 + 4, but 6 as 4 + 2 (3 + 3 was slower: a
// block of 3 or 5 rows costs more per row than one of 4, docs/benchmarks.md). Computed once per call, in the calling
// thread's scratch (a division per block and tile cost a 16-row step about 9 %).
const std::vector<int>& row_blocks(int64_t rows, int most, int preferred) {
  thread_local std::vector<int> sizes;
  const int64_t blocks = (rows + most - 1) / most, extra = rows - blocks * preferred;
  sizes.assign(blocks, preferred);
  if (extra < 0)
    sizes.back() = (int)(rows - (blocks - 1) * preferred);
  else
    for (int64_t b = 0; b < blocks; ++b) sizes[b] += (int)(extra / blocks + (b < extra % blocks ? 1 : 0));
  return sizes;
}

}  // namespace

int64_t tile_grain(int64_t tiles, int64_t block_rows_per_tile) {
  const int64_t worth_waking = std::max<int64_t>(1, 512 / block_rows_per_tile);
  const int64_t per_thread = std::max<int64_t>(1, pool::threads());
  return std::max<int64_t>(1, std::min(worth_waking, (tiles + 4 * per_thread - 1) / (4 * per_thread)));
}

void check_lowbit_packed(const at::Tensor& packed, int64_t in_features, int64_t out_features, int64_t format,
                         int64_t isa) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be contiguous uint8");
  if (format == Q4_1_INT8) return;  // lowbit_linear_int8 checks its own records
  TORCH_CHECK(known_format(format), "unknown block format ", format);
  TORCH_CHECK(isa == ISA_AVX2 || isa == ISA_AVX512 || isa == ISA_WIDE_ON_AVX2, "unknown instruction set ", isa);
  TORCH_CHECK(isa_instructions(isa) <= best_isa(), "this CPU does not run instruction set ", isa);
  TORCH_CHECK(in_features % kBlock == 0, "in_features must be a multiple of 32, got ", in_features);
  TORCH_CHECK(!is_super((int)format) || in_features % (kSuper * kBlock) == 0,
              "K-quant weights need a multiple of 256 inputs, got ", in_features);
  const int64_t expected = (out_features + kTile - 1) / kTile * (in_features / kBlock) * record_bytes((int)format);
  TORCH_CHECK(packed.numel() == expected, "packed holds ", packed.numel(), " bytes, expected ", expected);
}

// Row `row` of a packed weight of `in_features` inputs, as fp32: bit for bit the reference de-quantization (d * q is
// exact, so `d * q + m` rounds once however it is computed). What the token embedding's lookup reads, so that a
// model whose embedding is stored in blocks keeps no fp32 copy of it.
void lowbit_row_into(const uint8_t* packed, int64_t in_features, int64_t format, int64_t row, float* out) {
  const int64_t tile = row / kTile, r = row % kTile;
  if (is_half((int)format)) {
    const uint8_t* values = packed + tile * in_features * kTile * 2;
    for (int64_t k = 0; k < in_features; ++k) {
      uint16_t v;
      std::memcpy(&v, values + (k * kTile + r) * 2, 2);
      if (format == BF16) {
        const uint32_t bits = uint32_t{v} << 16;
        std::memcpy(out + k, &bits, 4);
      } else {
        out[k] = static_cast<float>(c10::Half(v, c10::Half::from_bits()));
      }
    }
    return;
  }
  const int f = (int)format, bits = word_bits(f), per_word = inputs_per_word(f);
  const int64_t blocks = in_features / kBlock;
  const uint8_t* tile_start = packed + tile * blocks * record_bytes(f);
  const auto half_at = [](const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
  };
  for (int64_t b = 0; b < blocks; ++b) {
    // d of each sub-block (16 inputs for Q6_K, else the block) and m, as the tile kernels' block_scales compute them
    float d[2], m = 0.0f;
    const uint8_t* words;
    if (is_super(f)) {
      const uint8_t* super = tile_start + (b / kSuper) * kSuper * record_bytes(f);
      const uint8_t* ints = super + (has_min(f) ? 2 : 1) * kTile * 2;
      const int64_t j = b % kSuper;
      for (int sub = 0; sub < sub_blocks(f); ++sub) {
        const float k = f == Q6_K ? float(int8_t(ints[(2 * j + sub) * kTile + r])) : float(ints[j * kTile + r]);
        d[sub] = half_at(super + r * 2) * k;
      }
      if (has_min(f)) m = -(half_at(super + (kTile + r) * 2) * float(ints[(kSuper + j) * kTile + r]));
      words = super + super_header_bytes(f) + j * word_block_bytes(f);
    } else {
      const uint8_t* rec = tile_start + b * record_bytes(f);
      d[0] = half_at(rec + r * 2);
      if (has_min(f)) m = half_at(rec + (kTile + r) * 2);
      words = rec + header_bytes(f);
    }
    if (sub_blocks(f) == 1) d[1] = d[0];
    for (int w = 0; w < kBlock / per_word; ++w) {
      uint32_t word;
      std::memcpy(&word, words + (w * kTile + r) * 4, 4);
      const float dw = d[w * per_word >= kBlock / 2 && sub_blocks(f) == 2];
      for (int j = 0; j < per_word; ++j) {
        const uint32_t field = word >> (bits * j);
        const float q = bits == 4 ? float(field & 0xF) : float(int8_t(field));
        out[b * kBlock + w * per_word + j] = has_min(f) ? dw * q + m : dw * q;
      }
    }
  }
}

// The rows `ids` of a packed weight [rows, in_features] as fp32 [len(ids), in_features] (lowbit_row_into).
at::Tensor lowbit_rows(at::Tensor packed, int64_t rows, int64_t in_features, int64_t format, at::Tensor ids) {
  TORCH_CHECK(format != Q4_1_INT8, "lowbit_rows reads a stored format, not Q4_1_INT8");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(known_format(format) && in_features % kBlock == 0, "unknown format ", format, " or a width of ",
              in_features, " that is no multiple of 32");
  const int64_t tile_bytes = in_features / kBlock * record_bytes((int)format);  // f16 / bf16 too: 16 rows x 2 bytes
  TORCH_CHECK(packed.numel() == (rows + kTile - 1) / kTile * tile_bytes, "packed holds ", packed.numel(),
              " bytes, not ", rows, " rows of ", in_features);
  const at::Tensor index = ids.to(at::kLong).contiguous();
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "row ", id[i], " is outside the weight's ", rows, " rows");
  at::Tensor out = at::empty({index.numel(), in_features}, at::kFloat);
  const uint8_t* p = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  pool::parallel_for(index.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) lowbit_row_into(p, in_features, format, id[i], o + i * in_features);
  });
  return out;
}

// y [M, N] = x [M, K] @ W^T for W packed as above (N rows, K inputs, `format`), on `isa`.
at::Tensor lowbit_linear(at::Tensor x, at::Tensor packed, int64_t out_features, int64_t format,
                            int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  check_lowbit_packed(packed, x.size(1), out_features, format, isa);
  if (format == Q4_1_INT8) return lowbit_linear_int8(x, packed, out_features, isa);
  x = x.contiguous();
  auto out = at::empty({x.size(0), out_features}, x.options());
  lowbit_linear_into(x.data_ptr<float>(), x.size(0), x.size(1), packed, out_features, format, isa,
                     out.data_ptr<float>(), out_features);
  return out;
}

void lowbit_linear_into(const float* xp, int64_t rows, int64_t in_features, const at::Tensor& packed,
                        int64_t out_features, int64_t format, int64_t isa, float* op, int64_t ldo) {
  if (format == Q4_1_INT8) {  // a tensor call, its result copied: not a path the decoder stack's speed rests on
    const at::Tensor y = lowbit_linear_int8(at::from_blob(const_cast<float*>(xp), {rows, in_features}, at::kFloat),
                                            packed, out_features, isa);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(op + r * ldo, y.data_ptr<float>() + r * out_features, out_features * sizeof(float));
    return;
  }
  const int64_t blocks = in_features / kBlock;
  const int64_t tiles = (out_features + kTile - 1) / kTile;
  const int64_t tile_bytes = blocks * record_bytes(format);
  const Kernels k = kernels_for((int)isa, (int)format);
  // Up to `buffer_above` rows: the tile kernels, on x scaled per input. More rows: de-quantize each tile once into
  // a per-thread buffer and stream every row block over it, on x as is.
  // f16 and bf16: the dense kernel over the stored tile, on x as is.
  const bool half = is_half(format);
  const bool buffered = !half && rows > k.buffer_above;
  const auto [xs, sp] =
      buffered || half ? ScaledInputs{xp, xp} : scaled_inputs(xp, rows, in_features, (int)format);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t grain = tile_grain(tiles, blocks * std::max<int64_t>(rows, 1));
  const std::vector<int>& row_block = row_blocks(rows, k.rows, k.preferred_rows);
  pool::parallel_for(tiles, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> w;
    if (buffered) w.resize(in_features * kTile);
    for (int64_t t = begin; t < end; ++t) {
      const int valid = (int)std::min<int64_t>(kTile, out_features - t * kTile);
      const uint8_t* tile = wp + t * tile_bytes;
      if (buffered) k.dequant(tile, blocks, w.data());
      int64_t r = 0;
      for (const int chunk : row_block) {
        float* o = op + r * ldo + t * kTile;
        if (half)
          k.dense[chunk - 1](xp + r * in_features, in_features, tile, in_features, o, ldo, valid);
        else if (buffered)
          k.dense[chunk - 1](xp + r * in_features, in_features, (const uint8_t*)w.data(), in_features, o, ldo,
                             valid);
        else
          k.tile[chunk - 1](xs + r * in_features, in_features, sp + r * blocks, blocks, tile, blocks, o, ldo, valid);
        r += chunk;
      }
    }
  });
}
