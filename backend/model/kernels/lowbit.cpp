// Weight-only low-bit linear layers with fp32 activations and fp32 accumulation: y = x @ W^T, where W is
// held as GGUF blocks of 32 inputs (Q4_1: w = d * q + m, q in 0..15; Q8_0: w = d * q, q in -128..127;
// d and m fp16). Each weight is de-quantized in registers exactly as the reference de-quantizes it
// (d * q is exact in fp32, so fma(d, q, m) rounds once, like fp32 `d * q + m`), then multiplied into an
// fp32 accumulator: the result is the dense fp32 matmul on the de-quantized weights up to summation order,
// while the step reads 4.5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of 32.
//
// Packed layout (made by `pack` below, once at load): output rows in tiles of 16; per tile, per block of
// 32 inputs, one record:
//   Q4_1: d[16] fp16, m[16] fp16, then 16 pairs of inputs (2j, 2j+1), 16 bytes each: byte r holds row r's
//         q for input 2j in its low nibble and for input 2j+1 in its high nibble            (320 bytes)
//   Q8_0: d[16] fp16, then 32 inputs, 16 bytes each: row r's int8 q                         (544 bytes)
// so one 16-byte load gives a whole input's 16 output lanes (the tile is "transposed"), and the kernel
// needs no horizontal sums. The instruction set is chosen per call from the running CPU (AVX-512 or
// AVX2+FMA+F16C), never from the build machine's flags: each path is compiled with its own target pragma.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int kTile = 16;   // output rows per tile
constexpr int kBlock = 32;  // inputs per block
enum Format { Q4_1 = 0, Q8_0 = 1 };
enum Isa { ISA_AVX2 = 1, ISA_AVX512 = 2 };

int record_bytes(int format) { return format == Q4_1 ? 4 * kTile + kTile * kBlock / 2 : 2 * kTile + kTile * kBlock; }

// ---------------------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C: a tile is two 8-lane halves.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// One tile, MR rows of x (MR <= 4), de-quantizing in registers. With few rows the accumulators are split
// into C independent chains (inputs k, k + 1, ... go to chains k % C) so the FMA latency does not bound a
// one-row step; the chains are added at the end (only the summation order differs from a plain sum).
template <int MR, int FORMAT>
void tile_avx2(const float* x, int64_t ldx, const uint8_t* tile, int64_t blocks, float* out, int64_t ldo,
               int valid) {
  constexpr int C = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  __m256 acc[MR][C][2];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(0xF);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = tile + b * record_bytes(FORMAT);
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 16)));
    const float* xb = x + b * kBlock;
    if constexpr (FORMAT == Q4_1) {
      const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 32)));
      const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 48)));
      const uint8_t* q = rec + 64;
      // Two input pairs per iteration: compile-time accumulator indices (see tile_avx512).
#define LOWBIT_Q4_256(J, C0, C1)                                                                  \
  {                                                                                               \
    const __m128i v = _mm_loadu_si128((const __m128i*)(q + 16 * (J)));                            \
    const __m256i lo = _mm256_cvtepu8_epi32(v);                                                   \
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));                                \
    const __m256 w00 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_and_si256(lo, low4)), m0);   \
    const __m256 w01 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_and_si256(hi, low4)), m1);   \
    const __m256 w10 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), m0);     \
    const __m256 w11 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), m1);     \
    for (int r = 0; r < MR; ++r) {                                                                \
      const __m256 a0 = _mm256_broadcast_ss(xb + r * ldx + 2 * (J));                              \
      const __m256 a1 = _mm256_broadcast_ss(xb + r * ldx + 2 * (J) + 1);                          \
      acc[r][C0][0] = _mm256_fmadd_ps(a0, w00, acc[r][C0][0]);                                    \
      acc[r][C0][1] = _mm256_fmadd_ps(a0, w01, acc[r][C0][1]);                                    \
      acc[r][C1][0] = _mm256_fmadd_ps(a1, w10, acc[r][C1][0]);                                    \
      acc[r][C1][1] = _mm256_fmadd_ps(a1, w11, acc[r][C1][1]);                                    \
    }                                                                                             \
  }
      for (int j = 0; j < kBlock / 2; j += 2) {
        LOWBIT_Q4_256(j, 0, 1 % C)
        LOWBIT_Q4_256(j + 1, 2 % C, 3 % C)
      }
#undef LOWBIT_Q4_256
    } else {
      const int8_t* q = (const int8_t*)(rec + 32);
#define LOWBIT_Q8_256(K, C)                                                                        \
  {                                                                                                \
    const __m128i v = _mm_loadu_si128((const __m128i*)(q + 16 * (K)));                             \
    const __m256 w0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));              \
    const __m256 w1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))); \
    for (int r = 0; r < MR; ++r) {                                                                 \
      const __m256 a = _mm256_broadcast_ss(xb + r * ldx + (K));                                    \
      acc[r][C][0] = _mm256_fmadd_ps(a, w0, acc[r][C][0]);                                         \
      acc[r][C][1] = _mm256_fmadd_ps(a, w1, acc[r][C][1]);                                         \
    }                                                                                              \
  }
      for (int k = 0; k < kBlock; k += 4) {
        LOWBIT_Q8_256(k, 0)
        LOWBIT_Q8_256(k + 1, 1 % C)
        LOWBIT_Q8_256(k + 2, 2 % C)
        LOWBIT_Q8_256(k + 3, 3 % C)
      }
#undef LOWBIT_Q8_256
    }
  }
  for (int r = 0; r < MR; ++r) {
    alignas(32) float row[kTile];
    __m256 s0 = acc[r][0][0], s1 = acc[r][0][1];
    if constexpr (C >= 2) s0 = _mm256_add_ps(s0, acc[r][1][0]), s1 = _mm256_add_ps(s1, acc[r][1][1]);
    if constexpr (C == 4) {
      s0 = _mm256_add_ps(s0, _mm256_add_ps(acc[r][2][0], acc[r][3][0]));
      s1 = _mm256_add_ps(s1, _mm256_add_ps(acc[r][2][1], acc[r][3][1]));
    }
    _mm256_store_ps(row, s0);
    _mm256_store_ps(row + 8, s1);
    std::memcpy(out + r * ldo, row, valid * sizeof(float));
  }
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------
// AVX-512 (F + BW + VL): a tile is one 16-lane register, so up to 8 rows of x share each de-quantized input.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

template <int MR, int FORMAT>
void tile_avx512(const float* x, int64_t ldx, const uint8_t* tile, int64_t blocks, float* out, int64_t ldo,
                 int valid) {
  constexpr int C = MR == 1 ? 4 : MR == 2 ? 2 : 1;  // independent chains, as in tile_avx2
  __m512 acc[MR][C];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi32(0xF);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = tile + b * record_bytes(FORMAT);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)rec));
    const float* xb = x + b * kBlock;
    if constexpr (FORMAT == Q4_1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 32)));
      const uint8_t* q = rec + 64;
      // Two input pairs per iteration, so that every accumulator index is a compile-time constant (a runtime
      // index would keep the accumulators in memory).
#define LOWBIT_Q4_512(J, C0, C1)                                                                  \
  {                                                                                               \
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * (J))));      \
    const __m512 w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), m);       \
    const __m512 w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m);         \
    for (int r = 0; r < MR; ++r) {                                                                \
      acc[r][C0] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + 2 * (J)]), w0, acc[r][C0]);        \
      acc[r][C1] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + 2 * (J) + 1]), w1, acc[r][C1]);    \
    }                                                                                             \
  }
      for (int j = 0; j < kBlock / 2; j += 2) {
        LOWBIT_Q4_512(j, 0, 1 % C)
        LOWBIT_Q4_512(j + 1, 2 % C, 3 % C)
      }
#undef LOWBIT_Q4_512
    } else {
      const int8_t* q = (const int8_t*)(rec + 32);
#define LOWBIT_Q8_512(K, C)                                                                        \
  {                                                                                                \
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16 * (K))));       \
    const __m512 w = _mm512_mul_ps(d, _mm512_cvtepi32_ps(v));                                      \
    for (int r = 0; r < MR; ++r) acc[r][C] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + (K)]), w, acc[r][C]); \
  }
      for (int k = 0; k < kBlock; k += 4) {
        LOWBIT_Q8_512(k, 0)
        LOWBIT_Q8_512(k + 1, 1 % C)
        LOWBIT_Q8_512(k + 2, 2 % C)
        LOWBIT_Q8_512(k + 3, 3 % C)
      }
#undef LOWBIT_Q8_512
    }
  }
  const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
  for (int r = 0; r < MR; ++r) {
    __m512 sum = acc[r][0];
    if constexpr (C >= 2) sum = _mm512_add_ps(sum, acc[r][1]);
    if constexpr (C == 4) sum = _mm512_add_ps(sum, _mm512_add_ps(acc[r][2], acc[r][3]));
    _mm512_mask_storeu_ps(out + r * ldo, mask, sum);
  }
}

template <int FORMAT>
void dequant_avx512(const uint8_t* tile, int64_t blocks, float* w) {
  const __m512i low4 = _mm512_set1_epi32(0xF);
  for (int64_t b = 0; b < blocks; ++b, w += kBlock * kTile) {
    const uint8_t* rec = tile + b * record_bytes(FORMAT);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)rec));
    if constexpr (FORMAT == Q4_1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 32)));
      for (int j = 0; j < kBlock / 2; ++j) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(rec + 64 + 16 * j)));
        _mm512_storeu_ps(w + 2 * j * kTile, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), m));
        _mm512_storeu_ps(w + (2 * j + 1) * kTile, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m));
      }
    } else {
      for (int k = 0; k < kBlock; ++k) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(rec + 32 + 16 * k)));
        _mm512_storeu_ps(w + k * kTile, _mm512_mul_ps(d, _mm512_cvtepi32_ps(v)));
      }
    }
  }
}

template <int MR>
void dense_avx512(const float* x, int64_t ldx, const float* w, int64_t in_features, float* out, int64_t ldo,
                  int valid) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in_features; ++k) {
    const __m512 wk = _mm512_loadu_ps(w + k * kTile);
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wk, acc[r]);
  }
  const __mmask16 mask = (__mmask16)((1u << valid) - 1u);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
}

#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------------
using TileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, float*, int64_t, int);
using DequantFn = void (*)(const uint8_t*, int64_t, float*);
using DenseFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int);

// Every instantiation for rows 1..N, indexed by rows - 1.
template <template <int> class Make, int... R>
constexpr auto table(std::integer_sequence<int, R...>) {
  return std::array{Make<R + 1>::fn...};
}
template <int F> struct Avx2Tile { template <int MR> struct T { static constexpr TileFn fn = tile_avx2<MR, F>; }; };
template <int F> struct Avx512Tile { template <int MR> struct T { static constexpr TileFn fn = tile_avx512<MR, F>; }; };
template <int MR> struct Avx512Dense { static constexpr DenseFn fn = dense_avx512<MR>; };

constexpr int kRowsAvx2 = 4, kRowsAvx512 = 8;  // rows per register block (16 / 32 vector registers)

struct Kernels {
  int rows;
  TileFn tile[kRowsAvx512];
  DequantFn dequant;  // null: no buffered path on this instruction set
  DenseFn dense[kRowsAvx512];
};

Kernels kernels_for(int isa, int format) {
  Kernels k{};
  if (isa == ISA_AVX512) {
    k.rows = kRowsAvx512;
    auto tiles = format == Q4_1 ? table<Avx512Tile<Q4_1>::T>(std::make_integer_sequence<int, kRowsAvx512>())
                                : table<Avx512Tile<Q8_0>::T>(std::make_integer_sequence<int, kRowsAvx512>());
    auto dense = table<Avx512Dense>(std::make_integer_sequence<int, kRowsAvx512>());
    for (int i = 0; i < kRowsAvx512; ++i) k.tile[i] = tiles[i], k.dense[i] = dense[i];
    k.dequant = format == Q4_1 ? dequant_avx512<Q4_1> : dequant_avx512<Q8_0>;
  } else {
    // No buffered path: re-de-quantizing in registers for each block of 4 rows measured 1.2-1.6x faster at
    // every M from 5 to 64 on an AVX2 EPYC (docs/benchmarks.md) than a tile de-quantized once into memory.
    k.rows = kRowsAvx2;
    auto tiles = format == Q4_1 ? table<Avx2Tile<Q4_1>::T>(std::make_integer_sequence<int, kRowsAvx2>())
                                : table<Avx2Tile<Q8_0>::T>(std::make_integer_sequence<int, kRowsAvx2>());
    for (int i = 0; i < kRowsAvx2; ++i) k.tile[i] = tiles[i];
  }
  return k;
}

}  // namespace

// The best instruction set this CPU runs (0: neither, use the pure-torch path).
int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
    return ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;  // F16C: every AVX2 CPU
  return 0;
}

// y [M, N] = x [M, K] @ W^T for W packed as above (N rows, K inputs, `format`), on `isa`.
at::Tensor lowbit_linear(at::Tensor x, at::Tensor packed, int64_t out_features, int64_t format,
                            int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(format == Q4_1 || format == Q8_0, "unknown block format ", format);
  TORCH_CHECK(isa == ISA_AVX2 || isa == ISA_AVX512, "unknown instruction set ", isa);
  TORCH_CHECK(isa <= best_isa(), "this CPU does not run instruction set ", isa);
  x = x.contiguous();
  const int64_t rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK(in_features % kBlock == 0, "in_features must be a multiple of 32, got ", in_features);
  const int64_t blocks = in_features / kBlock;
  const int64_t tiles = (out_features + kTile - 1) / kTile;
  const int64_t tile_bytes = blocks * record_bytes(format);
  TORCH_CHECK(packed.numel() == tiles * tile_bytes, "packed holds ", packed.numel(), " bytes, expected ",
              tiles * tile_bytes);
  auto out = at::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const Kernels k = kernels_for((int)isa, (int)format);
  // Up to one register block of rows, and on AVX2 always: de-quantize in registers, once per block of rows.
  // More rows on AVX-512: de-quantize each tile once into a per-thread buffer and stream every row block over it.
  const bool buffered = k.dequant != nullptr && rows > k.rows;
  // Grain: tiles per task, a few microseconds of work, so that a thread is worth waking for it.
  const int64_t grain = std::max<int64_t>(1, 512 / (blocks * std::max<int64_t>(rows, 1)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> w(buffered ? in_features * kTile : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int valid = (int)std::min<int64_t>(kTile, out_features - t * kTile);
      const uint8_t* tile = wp + t * tile_bytes;
      if (buffered) k.dequant(tile, blocks, w.data());
      for (int64_t r = 0; r < rows; r += k.rows) {
        const int chunk = (int)std::min<int64_t>(k.rows, rows - r);
        float* o = op + r * out_features + t * kTile;
        if (buffered)
          k.dense[chunk - 1](xp + r * in_features, in_features, w.data(), in_features, o, out_features, valid);
        else
          k.tile[chunk - 1](xp + r * in_features, in_features, tile, blocks, o, out_features, valid);
      }
    }
  });
  return out;
}
