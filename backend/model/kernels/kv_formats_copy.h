// One instruction set's copy of the KV cache's readers (kv_formats.cpp), compiled by isa_copies.h for baseline
// x86-64, AVX2 and AVX-512: ISA_LANES values a step where ISA_LEVEL has the vector instructions, the rest (and the
// baseline copy's every value) one at a time. Every copy gives the same bits.

#if ISA_LEVEL >= 2
// 16 16-bit floats at `p` as float32 at `to`.
inline void widen_lanes(const uint16_t* p, KvFormat format, float* to) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  _mm512_storeu_ps(to, format == KV_F16 ? _mm512_cvtph_ps(half)
                                        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
}
#elif ISA_LEVEL == 1
// 8 16-bit floats at `p` as float32 at `to`.
inline void widen_lanes(const uint16_t* p, KvFormat format, float* to) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  _mm256_storeu_ps(to, format == KV_F16 ? _mm256_cvtph_ps(half)
                                        : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
}
#endif

// out[r * dim + i] = float(in[r * stride + i]) for `rows` rows of `dim` 16-bit floats (`format` KV_F16 or KV_BF16),
// `stride` elements apart: a block of a 16-bit KV cache made float32 (exactly: every 16-bit float is a float32).
void widen_rows(const uint16_t* in, int64_t stride, int64_t rows, int64_t dim, KvFormat format, float* out) {
  const int64_t body = ISA_LEVEL >= 1 ? dim - dim % ISA_LANES : 0;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = in + r * stride;
    float* to = out + r * dim;
#if ISA_LEVEL >= 1
    for (int64_t i = 0; i < body; i += ISA_LANES) widen_lanes(row + i, format, to + i);
#endif
    for (int64_t i = body; i < dim; ++i)
      to[i] = format == KV_F16 ? float(c10::Half(row[i], c10::Half::from_bits()))
                               : float(c10::BFloat16(row[i], c10::BFloat16::from_bits()));
  }
}

// out[r * dim + i] = q * d of value i of row r, for `rows` q8_0 rows `stride` bytes apart: a block of a q8_0 KV
// cache made float32, record by record (an fp16 scale d, 32 int8s q).
void q8_0_rows(const uint8_t* in, int64_t stride, int64_t rows, int64_t dim, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < dim / kQ8Block; ++b) {
      const uint8_t* record = in + r * stride + b * kQ8Record;
      const float d = half_at(record);
      float* to = out + r * dim + b * kQ8Block;
#if ISA_LEVEL >= 2
      for (int j = 0; j < kQ8Block; j += 16) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 2 + j));
        _mm512_storeu_ps(to + j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(d)));
      }
#elif ISA_LEVEL == 1
      for (int j = 0; j < kQ8Block; j += 8) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(record + 2 + j));
        _mm256_storeu_ps(to + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(d)));
      }
#else
      for (int64_t j = 0; j < kQ8Block; ++j) to[j] = float(static_cast<int8_t>(record[2 + j])) * d;
#endif
    }
}
