// One instruction set's copy of gguf_int8's kernel (lowbit_int8.cpp), compiled by isa_copies.h: AVX2's maddubs
// where ISA_VNNI is 0, AVX-512 VNNI's vpdpbusd where it is 1. The activations are quantized with the same AVX2
// instructions in both copies. Layout and arithmetic: see lowbit_int8.cpp.

// One block of 32 activations: its int8 values in maddubs order (per group of 8: x0 x2 x4 x6 x1 x3 x5 x7), the
// scale max|x| / 127 and the fp32 sum. Rounds to nearest even (the default rounding mode), as torch.round does.
void quantize_block(const float* x, int8_t* q, float* scale, float* sum) {
  __m256 v[kGroups];
  __m256 amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int g = 0; g < kGroups; ++g) {
    v[g] = _mm256_loadu_ps(x + 8 * g);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[g]));
    total = _mm256_add_ps(total, v[g]);
  }
  alignas(32) float lanes[8], sums[8];
  _mm256_store_ps(lanes, amax);
  _mm256_store_ps(sums, total);
  float m = 0.f;
  for (float l : lanes) m = std::max(m, l);
  *scale = m / 127.f;
  *sum = ((sums[0] + sums[4]) + (sums[1] + sums[5])) + ((sums[2] + sums[6]) + (sums[3] + sums[7]));
  const __m256 inverse = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256i i[kGroups];
  for (int g = 0; g < kGroups; ++g)
    i[g] = _mm256_permutevar8x32_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[g], inverse)), order);
  // packs interleave 128-bit lanes: bytes come out as g0[0..3] g1[0..3] g2[0..3] g3[0..3] | g0[4..7] ...
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i grouped = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)q, grouped);
}

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), blocks = x.size(1) / kBlock;
  QuantizedRows out{at::empty({rows, blocks * kBlock}, x.options().dtype(at::kChar)),
                    at::empty({rows, blocks}, x.options()), at::empty({rows, blocks}, x.options())};
  const float* in = x.data_ptr<float>();
  int8_t* q = out.q.data_ptr<int8_t>();
  float* scale = out.scale.data_ptr<float>();
  float* sum = out.sum.data_ptr<float>();
  for (int64_t i = 0; i < rows * blocks; ++i) quantize_block(in + i * kBlock, q + i * kBlock, scale + i, sum + i);
  return out;
}

#if ISA_VNNI
// With VNNI: a 16-row tile in one 512-bit lane set, the int32 sums straight from `vpdpbusd`.
template <int MR>
void tile_int8(const int8_t* qx, int64_t ldq, const float* scale, const float* sum, int64_t lds, const uint8_t* tile,
               int64_t blocks, float* out, int64_t ldo, int valid) {
  const __m512i nibbles = _mm512_set1_epi8(0x0F);
  __m512 total[MR];
  for (int r = 0; r < MR; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = tile + b * kQ4_1RecordBytes;
    const uint8_t* ahead = rec + kPrefetchRecords * kQ4_1RecordBytes;
    for (int line = 0; line < kQ4_1RecordBytes; line += 64) __builtin_prefetch(ahead + line);
    __m512i acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
    for (int g = 0; g < kGroups; ++g) {
      const __m512i v = _mm512_loadu_si512(rec + 4 * kTile + g * kTile * 4);
      const __m512i lo = _mm512_and_si512(v, nibbles), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibbles);
      for (int r = 0; r < MR; ++r) {
        int32_t even, odd;
        std::memcpy(&even, qx + r * ldq + b * kBlock + g * 8, 4);
        std::memcpy(&odd, qx + r * ldq + b * kBlock + g * 8 + 4, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(even));
        acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(odd));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)rec));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 2 * kTile)));
    for (int r = 0; r < MR; ++r) {
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, _mm512_set1_ps(scale[r * lds + b])),
                                 total[r]);
      total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[r * lds + b]), total[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo, (__mmask16)((1u << valid) - 1), total[r]);
}
#else
// One 16-row tile for MR rows of x: out[r][0..valid) = the tile's rows times row r. Each half-tile's words are
// unpacked once per block and serve every row; per row and half one int16 accumulator per block.
template <int MR>
void tile_int8(const int8_t* qx, int64_t ldq, const float* scale, const float* sum, int64_t lds, const uint8_t* tile,
               int64_t blocks, float* out, int64_t ldo, int valid) {
  const __m256i nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  alignas(32) float total[MR][kTile] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = tile + b * kQ4_1RecordBytes;
    const uint8_t* ahead = rec + kPrefetchRecords * kQ4_1RecordBytes;
    for (int line = 0; line < kQ4_1RecordBytes; line += 64) __builtin_prefetch(ahead + line);
    for (int h = 0; h < 2; ++h) {
      __m256i acc[MR];
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_si256();
      for (int g = 0; g < kGroups; ++g) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(rec + 4 * kTile + (g * kTile + h * 8) * 4));
        const __m256i lo = _mm256_and_si256(v, nibbles), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibbles);
        for (int r = 0; r < MR; ++r) {
          int32_t even, odd;
          std::memcpy(&even, qx + r * ldq + b * kBlock + g * 8, 4);
          std::memcpy(&odd, qx + r * ldq + b * kBlock + g * 8 + 4, 4);
          const __m256i products =
              _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(even)),
                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(odd)));
          acc[r] = _mm256_add_epi16(acc[r], products);
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 16 * h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 2 * kTile + 16 * h)));
      for (int r = 0; r < MR; ++r) {
        const __m256 products = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r], ones));
        __m256 t = _mm256_load_ps(total[r] + 8 * h);
        t = _mm256_fmadd_ps(products, _mm256_mul_ps(d, _mm256_set1_ps(scale[r * lds + b])), t);
        t = _mm256_fmadd_ps(m, _mm256_set1_ps(sum[r * lds + b]), t);
        _mm256_store_ps(total[r] + 8 * h, t);
      }
    }
  }
  for (int r = 0; r < MR; ++r) std::memcpy(out + r * ldo, total[r], valid * sizeof(float));
}
#endif

constexpr TileInt8 kTiles[kRows] = {tile_int8<1>, tile_int8<2>, tile_int8<3>, tile_int8<4>};

// o [rows, out_features] = x [rows, in_features] @ W^T for W's `tiles` tiles of in_features / 32 records at w.
void linear(const at::Tensor& x, const uint8_t* w, int64_t out_features, int64_t tiles, float* o) {
  const int64_t rows = x.size(0), in_features = x.size(1), blocks = in_features / kBlock;
  const QuantizedRows qx = quantize_rows(x);
  const int8_t* q = qx.q.data_ptr<int8_t>();
  const float* scale = qx.scale.data_ptr<float>();
  const float* sum = qx.sum.data_ptr<float>();
  const int64_t grain = tile_grain(tiles, blocks * std::max<int64_t>(rows, 1));
  pool::parallel_for(tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int valid = (int)std::min<int64_t>(kTile, out_features - t * kTile);
      for (int64_t r = 0; r < rows; r += kRows) {  // the tile stays in L1 from one pass to the next
        const int chunk = (int)std::min<int64_t>(kRows, rows - r);
        kTiles[chunk - 1](q + r * in_features, in_features, scale + r * blocks, sum + r * blocks, blocks,
                          w + t * blocks * kQ4_1RecordBytes, blocks, o + r * out_features + t * kTile, out_features,
                          valid);
      }
    }
  });
}
