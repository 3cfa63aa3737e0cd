// The KV cache's element formats (kv_formats.h): rows written from fp32, blocks read back as fp32. Reading is
// compiled for AVX-512, AVX2 and baseline x86-64 (kv_formats_copy.h, through isa_copies.h) and runs the copy its
// caller's `isa` names; every copy gives the same bits (a 16-bit float or an int8 times an fp16 scale is one exact
// widening or one fp32 multiply). Writing is scalar, in one copy: one row per written token and layer, and roundf's
// rounding exactly.
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

#define ISA_COPY_FILE "kv_formats_copy.h"
#define ISA_COPY_NONE 1
#define ISA_COPY_AVX2 1
#define ISA_COPY_AVX512 1
#include "isa_copies.h"

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
                      float* out, int64_t isa) {
  if (format == KV_F32) {
    const float* in = static_cast<const float*>(cache) + first;
    for (int64_t r = 0; r < rows; ++r) std::copy(in + r * stride, in + r * stride + dim, out + r * dim);
  } else if (format == KV_Q8_0) {
    ISA_CALL(isa, q8_0_rows(static_cast<const uint8_t*>(cache) + first, stride, rows, dim, out));
  } else {
    ISA_CALL(isa, widen_rows(static_cast<const uint16_t*>(cache) + first, stride, rows, dim, format, out));
  }
}
