// One instruction set's copy of the low-bit tile kernels, compiled per copy by isa_copies.h (lowbit.cpp asks for
// avx2, wide_on_avx2 and avx512): ISA_LANES fp32 lanes per vector (8 or 16), AVX-512 instructions where ISA_LEVEL
// is 2. The code is written once in GCC's vector extensions, so the 16-lane copy that AVX-512 CPUs run is the same
// source as a 16-lane copy built from AVX2 instructions, which the tests run on any CPU. Layout and arithmetic: see
// lowbit.cpp.
//
// Contraction is on here (a * b + c is one FMA): the kernels' sums are allowed to round differently from the
// reference's; the exactness argument is in lowbit.cpp.
#pragma GCC optimize("fp-contract=fast")

typedef float vf __attribute__((vector_size(ISA_LANES * 4)));
typedef int32_t vi __attribute__((vector_size(ISA_LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(ISA_LANES * 4)));
constexpr int kVectors = kTile / ISA_LANES;  // vectors per 16-row tile
#define ALWAYS_INLINE inline __attribute__((always_inline))

ALWAYS_INLINE vf load_floats(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

ALWAYS_INLINE vu load_words(const uint8_t* p) {
  vu v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// ISA_LANES fp16 values as fp32 (exact).
ALWAYS_INLINE vf load_halves(const uint8_t* p) {
#if ISA_LEVEL >= 2
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
  __m256 parts[ISA_LANES / 8];
  for (int i = 0; i < ISA_LANES / 8; ++i) parts[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * i)));
  vf v;
  std::memcpy(&v, parts, sizeof v);
  return v;
#endif
}

// ISA_LANES bf16 values as fp32 (exact: a bf16 is the top half of an fp32).
ALWAYS_INLINE vf load_bf16(const uint8_t* p) {
#if ISA_LEVEL >= 2
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#else
  __m256i parts[ISA_LANES / 8];
  for (int i = 0; i < ISA_LANES / 8; ++i)
    parts[i] = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * i))), 16);
  vf v;
  std::memcpy(&v, parts, sizeof v);
  return v;
#endif
}

// ISA_LANES weights of a dense tile (`WEIGHTS`: F32_TILE, F16 or BF16) as fp32.
template <int WEIGHTS>
ALWAYS_INLINE vf load_weights(const uint8_t* p) {
  if constexpr (WEIGHTS == F16) return load_halves(p);
  if constexpr (WEIGHTS == BF16) return load_bf16(p);
  return load_floats((const float*)p);
}

// ISA_LANES scales of a plain record's header (`which`: 0 d, 1 m), as fp32 (fp16 converted: exact).
template <int FORMAT>
ALWAYS_INLINE vf load_scales(const uint8_t* rec, int h, int which) {
  return load_halves(rec + (which * kTile + h * ISA_LANES) * 2);
}

// ISA_LANES bytes as fp32 (exact), unsigned or signed (a widening load and a conversion: GCC's vector conversion
// from bytes took element by element).
template <typename Byte>
ALWAYS_INLINE vf load_bytes(const uint8_t* p) {
  constexpr bool is_signed = std::is_signed<Byte>::value;
#if ISA_LEVEL >= 2
  const __m128i bytes = _mm_loadu_si128((const __m128i*)p);
  return (vf)_mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#else
  __m256 parts[ISA_LANES / 8];
  for (int i = 0; i < ISA_LANES / 8; ++i) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i*)(p + 8 * i));
    parts[i] = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
  }
  vf v;
  std::memcpy(&v, parts, sizeof v);
  return v;
#endif
}

// Block b's words in a tile.
template <int FORMAT>
ALWAYS_INLINE const uint8_t* block_words(const uint8_t* tile, int64_t b) {
  if constexpr (is_super(FORMAT))
    return tile + (b / kSuper) * kSuper * record_bytes(FORMAT) + super_header_bytes(FORMAT) +
           (b % kSuper) * word_block_bytes(FORMAT);
  return tile + b * record_bytes(FORMAT) + header_bytes(FORMAT);
}

// ISA_LANES rows' scales of block b (`which`: 0 d of sub-block `sub`, 1 m), as fp32. K-quants: the super-block's d
// (dmin) times the block's integer scale (min), exact in fp32; m = -(dmin * min), as gguf-py subtracts it.
template <int FORMAT>
ALWAYS_INLINE vf block_scales(const uint8_t* tile, int64_t b, int h, int which, int sub) {
  if constexpr (!is_super(FORMAT)) {
    return load_scales<FORMAT>(tile + b * record_bytes(FORMAT), h, which);
  } else {
    const uint8_t* super = tile + (b / kSuper) * kSuper * record_bytes(FORMAT);
    const uint8_t* ints = super + (has_min(FORMAT) ? 2 : 1) * kTile * 2;
    const int64_t j = b % kSuper;
    if constexpr (FORMAT == Q6_K) {
      return load_halves(super + h * ISA_LANES * 2) * load_bytes<int8_t>(ints + (2 * j + sub) * kTile + h * ISA_LANES);
    } else {
      const vf k = load_bytes<uint8_t>(ints + (which * kSuper + j) * kTile + h * ISA_LANES);
      const vf scaled = load_halves(super + (which * kTile + h * ISA_LANES) * 2) * k;
      return which ? -scaled : scaled;
    }
  }
}

// Input J of a word, as fp32 lanes: q * 2^shift(J) exactly (few significant bits, so the conversion is exact).
template <int FORMAT, int J>
ALWAYS_INLINE vf word_input(vu v) {
  if constexpr (word_bits(FORMAT) == 4) {
    if constexpr (J < 7) return __builtin_convertvector((vi)(v & (0xFu << (4 * J))), vf);
    return __builtin_convertvector((vi)(v >> 28), vf);  // the top nibble: a mask would leave it signed
  } else {
    constexpr int bits = word_bits(FORMAT);  // the field to the top of the word: signed q * 2^(32 - bits)
    constexpr uint32_t top = ~0u << (32 - bits);
    // The first field's shift leaves nothing below it (GCC keeps the mask on vectors: an op per 8 weights).
    if constexpr (J == 0) return __builtin_convertvector((vi)(v << (32 - bits)), vf);
    return __builtin_convertvector((vi)(v << (32 - bits * (J + 1))) & (int32_t)top, vf);
  }
}

// acc[h][r][J % C] += input J of word[h] * x[r][J], for every input of one group: input by input, each broadcast
// of x serving every vector (a compiler left to reorder whole words keeps all of x's broadcasts live, and spills).
template <int FORMAT, int V, int MR, int C, int... J>
ALWAYS_INLINE void word_products(const vu (&word)[V], const float* x, int64_t ldx, vf (&acc)[V][MR][C],
                                 std::integer_sequence<int, J...>) {
  (
      [&] {
        vf q[V];
        for (int h = 0; h < V; ++h) q[h] = word_input<FORMAT, J>(word[h]);
        for (int r = 0; r < MR; ++r) {
          const float xr = x[r * ldx + J];
          for (int h = 0; h < V; ++h) acc[h][r][J % C] += q[h] * xr;
        }
      }(),
      ...);
}

// One tile (16 output rows) for MR rows of x. `xs` is x scaled per input by 2^-shift (scaled_inputs), `sums` the
// sum of x over each block (formats with m). Per block, sum(q * x) over the block goes into C independent chains per
// row and vector of lanes (8 accumulators in all: FMA latency does not bound a one-row step, and AVX2's 16
// registers hold them unspilled); the block's d (and m * sum(x)) then scale it into the row's total, which stays in
// memory: it is touched once per block.
template <int MR, int FORMAT>
void tile(const float* xs, int64_t ldx, const float* sums, int64_t lds, const uint8_t* tile, int64_t blocks,
          float* out, int64_t ldo, int valid) {
  constexpr int C = MR * kVectors >= 8 ? 1 : 8 / (MR * kVectors);
  constexpr int per_word = inputs_per_word(FORMAT);
  constexpr int sub_words = kBlock / per_word / sub_blocks(FORMAT);  // words per sub-block
  alignas(64) float total[MR][kTile] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    // the stream ahead: a record's worth of bytes, kPrefetchRecords records on (K-quants: their average share)
    const uint8_t* ahead = tile + (b + kPrefetchRecords) * record_bytes(FORMAT);
    for (int line = 0; line < record_bytes(FORMAT); line += 64) __builtin_prefetch(ahead + line);
    const uint8_t* words = block_words<FORMAT>(tile, b);
    for (int sub = 0; sub < sub_blocks(FORMAT); ++sub) {
      vf acc[kVectors][MR][C] = {};
      for (int w = sub * sub_words; w < (sub + 1) * sub_words; ++w) {
        vu word[kVectors];
        for (int h = 0; h < kVectors; ++h) word[h] = load_words(words + (w * kTile + h * ISA_LANES) * 4);
        word_products<FORMAT>(word, xs + b * kBlock + w * per_word, ldx, acc, std::make_integer_sequence<int, per_word>());
      }
      for (int h = 0; h < kVectors; ++h) {
        const vf d = block_scales<FORMAT>(tile, b, h, 0, sub);
        for (int r = 0; r < MR; ++r) {
          vf s = acc[h][r][0];
          for (int c = 1; c < C; ++c) s += acc[h][r][c];
          vf t = load_floats(total[r] + h * ISA_LANES) + d * s;
          if constexpr (has_min(FORMAT)) t += block_scales<FORMAT>(tile, b, h, 1, 0) * sums[r * lds + b];
          std::memcpy(total[r] + h * ISA_LANES, &t, sizeof t);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) std::memcpy(out + r * ldo, total[r], valid * sizeof(float));
}

template <int FORMAT, int... J>
ALWAYS_INLINE void dequant_word(vu v, vf d, vf m, float* w, std::integer_sequence<int, J...>) {
  // (d * 2^-shift) * (q * 2^shift) is d * q exactly, so this rounds once, as the reference's d * q + m does.
  (
      [&] {
        const vf weight = (d * input_scale(FORMAT, J)) * word_input<FORMAT, J>(v) + m;
        std::memcpy(w + J * kTile, &weight, sizeof weight);
      }(),
      ...);
}

// The tile's weights as fp32, bit for bit the reference de-quantization: w[input][row] (input-major, 16 rows).
template <int FORMAT>
void dequant(const uint8_t* tile, int64_t blocks, float* w) {
  constexpr int per_word = inputs_per_word(FORMAT);
  constexpr int sub_words = kBlock / per_word / sub_blocks(FORMAT);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* words = block_words<FORMAT>(tile, b);
    for (int h = 0; h < kVectors; ++h) {
      const vf m = has_min(FORMAT) ? block_scales<FORMAT>(tile, b, h, 1, 0) : vf{};
      for (int sub = 0; sub < sub_blocks(FORMAT); ++sub) {
        const vf d = block_scales<FORMAT>(tile, b, h, 0, sub);
        for (int word = sub * sub_words; word < (sub + 1) * sub_words; ++word)
          dequant_word<FORMAT>(load_words(words + (word * kTile + h * ISA_LANES) * 4), d, m,
                               w + (b * kBlock + word * per_word) * kTile + h * ISA_LANES,
                               std::make_integer_sequence<int, per_word>());
      }
    }
  }
}

// MR rows of x times a dense tile (dequant's layout: fp32, or f16 / bf16 as stored). Each block of 32 inputs is
// summed on its own, then added to the row's total (as the tile kernel does): one running sum over thousands of
// inputs had 5x the error of torch's fp32 matmul against the exact product.
template <int MR, int WEIGHTS>
void dense(const float* x, int64_t ldx, const uint8_t* w, int64_t in_features, float* out, int64_t ldo, int valid) {
  alignas(64) float total[MR][kTile] = {};  // in memory, as in `tile`: AVX2's 16 registers hold only the sums
  for (int64_t k0 = 0; k0 < in_features; k0 += kBlock) {
    vf acc[MR][kVectors] = {};
    for (int64_t k = k0; k < k0 + kBlock; ++k) {
      vf wk[kVectors];
      for (int h = 0; h < kVectors; ++h) wk[h] = load_weights<WEIGHTS>(w + (k * kTile + h * ISA_LANES) * weight_bytes(WEIGHTS));
      for (int r = 0; r < MR; ++r) {
        const float xr = x[r * ldx + k];
        for (int h = 0; h < kVectors; ++h) acc[r][h] += wk[h] * xr;
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < kVectors; ++h) {
        const vf t = load_floats(total[r] + h * ISA_LANES) + acc[r][h];
        std::memcpy(total[r] + h * ISA_LANES, &t, sizeof t);
      }
  }
  for (int r = 0; r < MR; ++r) std::memcpy(out + r * ldo, total[r], valid * sizeof(float));
}

template <int WEIGHTS, int... R>
void set_dense_kernels(Kernels& k, std::integer_sequence<int, R...>) {
  const std::array<DenseFn, sizeof...(R)> dense_rows{dense<R + 1, WEIGHTS>...};
  for (size_t i = 0; i < sizeof...(R); ++i) k.dense[i] = dense_rows[i];
}

template <int FORMAT, int... R>
void set_format_kernels(Kernels& k, std::integer_sequence<int, R...> rows) {
  const std::array<TileFn, sizeof...(R)> tiles{tile<R + 1, FORMAT>...};
  for (size_t i = 0; i < sizeof...(R); ++i) k.tile[i] = tiles[i];
  k.dequant = dequant<FORMAT>;
  set_dense_kernels<F32_TILE>(k, rows);
}

// This copy's kernels for `format`, for 1..sizeof...(R) rows of x per register block (`preferred_rows` where more
// save no block), de-quantizing a tile into memory for steps of more than `buffer_above` rows (Kernels in
// lowbit.cpp).
template <int... R>
Kernels kernels(int format, int buffer_above, int preferred_rows, std::integer_sequence<int, R...> rows) {
  Kernels k{};
  k.rows = sizeof...(R);
  k.preferred_rows = preferred_rows;
  k.buffer_above = buffer_above;
  switch (format) {
    case Q4_1: set_format_kernels<Q4_1>(k, rows); break;
    case Q8_0: set_format_kernels<Q8_0>(k, rows); break;
    case Q5_1: set_format_kernels<Q5_1>(k, rows); break;
    case Q4_K: set_format_kernels<Q4_K>(k, rows); break;
    case Q5_K: set_format_kernels<Q5_K>(k, rows); break;
    case Q6_K: set_format_kernels<Q6_K>(k, rows); break;
    case F16: set_dense_kernels<F16>(k, rows); break;
    case BF16: set_dense_kernels<BF16>(k, rows); break;
  }
  return k;
}
