// The KV cache's element formats (kv_formats.h): rows written from fp32, blocks read back as fp32. Reading is
// compiled for AVX-512, AVX2 and baseline x86-64, the copy for the running CPU picked at load (as in layer_ops.cpp);
// every copy gives the same bits (a 16-bit float or an int8 times an fp16 scale is one exact widening or one fp32
// multiply). Writing is scalar in every copy: one row per written token and layer, and roundf's rounding exactly.
#include "kv_formats.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

inline float half_at(const uint8_t* p) {  // a record's fp16 scale (unaligned)
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return float(c10::Half(bits, c10::Half::from_bits()));
}

// out[r * dim + i] = float(in[r * stride + i]) for `rows` rows of `dim` 16-bit floats (`format` KV_F16 or KV_BF16),
// `stride` elements apart: a block of a 16-bit KV cache made float32 (exactly: every 16-bit float is a float32).
__attribute__((target("default"))) void widen_rows(const uint16_t* in, int64_t stride, int64_t rows, int64_t dim,
                                                   KvFormat format, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < dim; ++i) {
      const uint16_t bits = in[r * stride + i];
      out[r * dim + i] = format == KV_F16 ? float(c10::Half(bits, c10::Half::from_bits()))
                                          : float(c10::BFloat16(bits, c10::BFloat16::from_bits()));
    }
}

// A macro, not a template (lambdas and templates do not inherit a function's target attribute): W lanes a step, the
// tail as the baseline copy widens it.
#define LOAD_8_HALVES(p) _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
#define LOAD_16_HALVES(p) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
#define WIDEN_LANES(W, LOAD16, F16_TO_PS, U16_TO_EPI32, SLLI, CAST, STOREU)                      \
  const int64_t body = dim - dim % W;                                                          \
  for (int64_t r = 0; r < rows; ++r) {                                                         \
    const uint16_t* row = in + r * stride;                                                     \
    float* to = out + r * dim;                                                                 \
    for (int64_t i = 0; i < body; i += W) {                                                    \
      const auto half = LOAD16(row + i);                                                       \
      STOREU(to + i, format == KV_F16 ? F16_TO_PS(half) : CAST(SLLI(U16_TO_EPI32(half), 16))); \
    }                                                                                          \
    for (int64_t i = body; i < dim; ++i)                                                       \
      to[i] = format == KV_F16 ? float(c10::Half(row[i], c10::Half::from_bits()))              \
                               : float(c10::BFloat16(row[i], c10::BFloat16::from_bits()));     \
  }

__attribute__((target("avx2,f16c"))) void widen_rows(const uint16_t* in, int64_t stride, int64_t rows, int64_t dim,
                                                     KvFormat format, float* out) {
  WIDEN_LANES(8, LOAD_8_HALVES, _mm256_cvtph_ps, _mm256_cvtepu16_epi32, _mm256_slli_epi32, _mm256_castsi256_ps,
              _mm256_storeu_ps)
}

__attribute__((target("avx512f"))) void widen_rows(const uint16_t* in, int64_t stride, int64_t rows, int64_t dim,
                                                   KvFormat format, float* out) {
  WIDEN_LANES(16, LOAD_16_HALVES, _mm512_cvtph_ps, _mm512_cvtepu16_epi32, _mm512_slli_epi32, _mm512_castsi512_ps,
              _mm512_storeu_ps)
}
#undef WIDEN_LANES
#undef LOAD_8_HALVES
#undef LOAD_16_HALVES

// out[r * dim + i] = q * d of value i of row r, for `rows` q8_0 rows `stride` bytes apart: a block of a q8_0 KV
// cache made float32, record by record (an fp16 scale d, 32 int8s q); EACH_RECORD writes `to` from `record` and d.
#define Q8_0_ROWS(EACH_RECORD)                                     \
  for (int64_t r = 0; r < rows; ++r)                               \
    for (int64_t b = 0; b < dim / kQ8Block; ++b) {                 \
      const uint8_t* record = in + r * stride + b * kQ8Record;     \
      const float d = half_at(record);                             \
      float* to = out + r * dim + b * kQ8Block;                    \
      EACH_RECORD                                                  \
    }

__attribute__((target("default"))) void q8_0_rows(const uint8_t* in, int64_t stride, int64_t rows, int64_t dim,
                                                  float* out) {
  Q8_0_ROWS(for (int64_t j = 0; j < kQ8Block; ++j) to[j] = float(static_cast<int8_t>(record[2 + j])) * d;)
}

__attribute__((target("avx2"))) void q8_0_rows(const uint8_t* in, int64_t stride, int64_t rows, int64_t dim,
                                               float* out) {
  Q8_0_ROWS(for (int j = 0; j < kQ8Block; j += 8) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(record + 2 + j));
    _mm256_storeu_ps(to + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(d)));
  })
}

__attribute__((target("avx512f"))) void q8_0_rows(const uint8_t* in, int64_t stride, int64_t rows, int64_t dim,
                                                  float* out) {
  Q8_0_ROWS(for (int j = 0; j < kQ8Block; j += 16) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 2 + j));
    _mm512_storeu_ps(to + j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(d)));
  })
}
#undef Q8_0_ROWS

// llama.cpp's quantize_row_q8_0_ref for one row of `dim` values (kv_formats.h): per block of 32, d = max|x| / 127,
// q = roundf(x * (1 / d)), the scale stored as fp16 rounded to nearest even (c10::Half, as F16C and torch round).
void store_q8_0(const float* in, uint8_t* out, int64_t dim) {
  for (int64_t b = 0; b < dim / kQ8Block; ++b) {
    const float* x = in + b * kQ8Block;
    uint8_t* record = out + b * kQ8Record;
    float amax = 0.f;
    for (int64_t j = 0; j < kQ8Block; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
    const uint16_t bits = c10::Half(d).x;
    std::memcpy(record, &bits, sizeof bits);
    for (int64_t j = 0; j < kQ8Block; ++j)
      record[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * inverse)));
  }
}

}  // namespace

KvFormat kv_format_of(at::ScalarType dtype) {
  if (dtype == at::kFloat) return KV_F32;
  if (dtype == at::kHalf) return KV_F16;
  if (dtype == at::kBFloat16) return KV_BF16;
  if (dtype == at::kByte) return KV_Q8_0;
  TORCH_CHECK(false, "the KV cache must be float32, float16, bfloat16 or uint8 (q8_0 records), not ", dtype);
}

void kv_store_row(const float* in, void* cache, int64_t offset, int64_t dim, KvFormat format) {
  if (format == KV_F32) {
    std::copy(in, in + dim, static_cast<float*>(cache) + offset);
  } else if (format == KV_F16) {
    c10::Half* out = static_cast<c10::Half*>(cache) + offset;
    for (int64_t i = 0; i < dim; ++i) out[i] = c10::Half(in[i]);
  } else if (format == KV_BF16) {
    c10::BFloat16* out = static_cast<c10::BFloat16*>(cache) + offset;
    for (int64_t i = 0; i < dim; ++i) out[i] = c10::BFloat16(in[i]);
  } else {
    store_q8_0(in, static_cast<uint8_t*>(cache) + offset, dim);
  }
}

void kv_rows_to_float(const void* cache, int64_t first, int64_t stride, int64_t rows, int64_t dim, KvFormat format,
                      float* out) {
  if (format == KV_F32) {
    const float* in = static_cast<const float*>(cache) + first;
    for (int64_t r = 0; r < rows; ++r) std::copy(in + r * stride, in + r * stride + dim, out + r * dim);
  } else if (format == KV_Q8_0) {
    q8_0_rows(static_cast<const uint8_t*>(cache) + first, stride, rows, dim, out);
  } else {
    widen_rows(static_cast<const uint16_t*>(cache) + first, stride, rows, dim, format, out);
  }
}
