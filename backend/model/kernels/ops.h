// The compute functions our kernel files define, for the files that call or bind them.
#pragma once
#include <ATen/ATen.h>

#include "isa.h"
#include "kv_formats.h"

at::Tensor lowbit_linear(at::Tensor x, at::Tensor packed, int64_t out_features, int64_t format, int64_t isa);
// What lowbit_linear checks of its weights (x [M, in_features] besides).
void check_lowbit_packed(const at::Tensor& packed, int64_t in_features, int64_t out_features, int64_t format,
                         int64_t isa);
// Rows of a packed weight as fp32, bit for bit the reference de-quantization (the token embedding's lookup).
at::Tensor lowbit_rows(at::Tensor packed, int64_t rows, int64_t in_features, int64_t format, at::Tensor ids);
void lowbit_row_into(const uint8_t* packed, int64_t in_features, int64_t format, int64_t row, float* out);
// Tiles per task of a low-bit matmul: a few microseconds of work (worth waking a thread for), and at least 4
// tasks per thread where the layer has the tiles, so the work splits evenly (lowbit.cpp).
int64_t tile_grain(int64_t tiles, int64_t block_rows_per_tile);
// lowbit_int8.cpp: int8 activations, multiplied with AVX-512 VNNI where int8_vnni(isa), else with AVX2
bool int8_vnni(int64_t isa);
at::Tensor lowbit_linear_int8(at::Tensor x, at::Tensor packed, int64_t out_features, int64_t isa);
// layer_ops.cpp: each op runs the copy for `isa` (ISA_NONE, ISA_AVX2 or ISA_AVX512; -1: layer_ops_isa()).
int64_t layer_ops_isa();  // the copy the layer ops run by default: best_isa()
at::Tensor add_rms_norm(at::Tensor hidden, c10::optional<at::Tensor> delta, at::Tensor weight, double eps,
                        int64_t isa);
at::Tensor silu_mul(at::Tensor gate_up, int64_t isa);
at::Tensor rope_paged_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor layer_cache,
                                at::Tensor slots, at::Tensor positions, at::Tensor row_seq, at::Tensor block_tables,
                                int64_t heads, int64_t kv_heads, double scale, int64_t isa);

// The same ops on raw rows, for the decoder stack (decoder_stack.cpp), which checks its shapes once per pass and
// keeps its activations in one workspace: the tensor functions above check, allocate their result and call these.
// lowbit_linear_into writes row r of y at out + r * ldo (a column slice of a wider output, where ldo > out_features).
void lowbit_linear_into(const float* x, int64_t rows, int64_t in_features, const at::Tensor& packed,
                        int64_t out_features, int64_t format, int64_t isa, float* out, int64_t ldo);
// The layer ops' `isa` here is a copy this CPU runs, as the tensor functions resolve it.
void add_rms_norm_into(float* hidden, const float* delta, const float* weight, float* out, int64_t rows, int64_t n,
                       float eps, int64_t isa);
void silu_mul_into(const float* gate_up, float* out, int64_t rows, int64_t n, int64_t isa);
// A layer's paged KV cache and the step's rows' places in it (rope_paged_attention's arguments as raw pointers).
struct PagedKv {
  void* cache;  // [2, blocks, block_size, kv_heads, kv_row_elements(format, dim)] of `format`: keys, then values
  int64_t cache_half, block_size, heads, kv_heads, dim, max_blocks;  // cache_half: elements, not bytes
  const int64_t *slots, *positions, *row_seq, *block_tables;
  float scale;
  KvFormat format;
};
// out [rows, heads * dim] (overwritten); `queries` is scratch for as many floats.
void rope_paged_attention_into(const float* qkv, const float* cos, const float* sin, int64_t rows, const PagedKv& kv,
                               float* queries, float* out, int64_t isa);
