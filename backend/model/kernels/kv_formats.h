// The paged KV cache's element formats (EngineConfig.kv_cache_dtype), for layer_ops.cpp's attention: a key or
// value row is written from fp32 (kv_store_row) and a block's rows are read back as fp32 (kv_rows_to_float), so
// attention's arithmetic is fp32 whatever the cache holds (kv_formats.cpp).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

#include "isa.h"

// float32; 16-bit floats, rounded to nearest even when written (as torch's .to() rounds) and widened exactly when
// read; or llama.cpp's block_q8_0 records (Q8_0 below).
enum KvFormat : int64_t { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3 };

// A q8_0 row of `dim` values (dim a multiple of 32) is dim / 32 of llama.cpp's block_q8_0 records, one after another:
// the block's scale d = max|x| / 127 as fp16 (2 bytes, little-endian), then 32 int8 q = roundf(x * (1 / d)), rounded
// half away from zero as llama.cpp's reference quantize_row_q8_0_ref rounds (1 / d taken of the fp32 d, 0 where
// d is 0). A value reads back as q * float(d16). The cache tensor is uint8, its last dimension a row's bytes.
constexpr int64_t kQ8Block = 32, kQ8Record = 34;

// The format of a cache tensor's dtype (uint8: q8_0); anything else is refused, naming what is allowed.
KvFormat kv_format_of(at::ScalarType dtype);
// Elements of the cache tensor per row of `dim` values, and bytes per element.
inline int64_t kv_row_elements(KvFormat format, int64_t dim) {
  return format == KV_Q8_0 ? dim / kQ8Block * kQ8Record : dim;
}
inline int64_t kv_element_bytes(KvFormat format) {
  return format == KV_F32 ? 4 : format == KV_Q8_0 ? 1 : 2;
}
// `dim` floats into the cache row at element `offset` of `cache` (rounded or quantized as the format says).
void kv_store_row(const float* in, void* cache, int64_t offset, int64_t dim, KvFormat format);
// out[r * dim + i] = value i of row r for `rows` rows starting at element `first` of `cache`, `stride` elements
// apart (a block of a layer's keys or values for one KV head), in the copy for instruction set `isa` (isa.h: none,
// AVX2 or AVX-512, one this CPU runs).
void kv_rows_to_float(const void* cache, int64_t first, int64_t stride, int64_t rows, int64_t dim, KvFormat format,
                      float* out, int64_t isa);
