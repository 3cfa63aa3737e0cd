// The compute functions our kernel files define, for the files that call or bind them.
#pragma once
#include <ATen/ATen.h>

int64_t best_isa();       // lowbit.cpp
int64_t layer_ops_isa();  // layer_ops.cpp
at::Tensor lowbit_linear(at::Tensor x, at::Tensor packed, int64_t out_features, int64_t format, int64_t isa);
// Tiles per task of a low-bit matmul: a few microseconds of work (worth waking a thread for), and at least 4
// tasks per thread where the layer has the tiles, so the work splits evenly (lowbit.cpp).
int64_t tile_grain(int64_t tiles, int64_t block_rows_per_tile);
// lowbit_int8.cpp: int8 activations, multiplied with AVX-512 VNNI where int8_vnni(isa), else with AVX2
bool int8_vnni(int64_t isa);
at::Tensor lowbit_linear_int8(at::Tensor x, at::Tensor packed, int64_t out_features, int64_t isa);
at::Tensor add_rms_norm(at::Tensor hidden, c10::optional<at::Tensor> delta, at::Tensor weight, double eps);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor rope_paged_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor layer_cache,
                                at::Tensor slots, at::Tensor positions, at::Tensor row_seq, at::Tensor block_tables,
                                int64_t heads, int64_t kv_heads, double scale);
