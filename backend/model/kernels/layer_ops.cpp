// The small ops of a Llama decoder layer, each one pass over its data instead of a handful of torch ops:
// residual add + RMSNorm, SiLU(gate) * up, and RoPE + KV-cache write + attention over the paged KV blocks
// in place (no gather of each sequence's blocks into a padded tensor). fp32 arithmetic; the KV cache may hold
// 16-bit floats or q8_0 records (kv_cache_dtype, kv_formats.h), made fp32 a block at a time before the fp32 code
// reads them. Element-wise arithmetic follows Hugging Face's op for op (the extension is built with
// -ffp-contract=off, so `a * b + c * d` rounds as torch rounds it); only the order of the reductions (sums of
// squares, dot products, softmax sums) differs. The vector code (layer_ops_copy.h) is compiled for AVX-512, AVX2 and
// baseline x86-64 (isa_copies.h) and each op runs the copy its `isa` names: by default layer_ops_isa(), the best
// this CPU runs (isa.h), so the build machine's flags never matter; the tests run every copy the CPU has.
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "isa.h"
#include "kv_formats.h"
#include "ops.h"
#include "thread_pool.h"

namespace {

// sum(term(i)) in kLanes running sums (lane l takes every i with i % kLanes == l), added pairwise at the end:
// vector registers instead of one scalar chain whose every add waits for the one before (a plain `sum +=` loop,
// which the compiler may not reorder, ran attention's dot products one multiply-add per 4 cycles). Only the
// order of the sum changes. Inlined into each instruction set's copy of its callers.
constexpr int kLanes = 16;
template <typename Term>
inline __attribute__((always_inline)) float lane_sum(int64_t n, Term term) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += term(i + l);
  for (int l = 0; i < n; ++i, ++l) lanes[l] += term(i);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

inline __attribute__((always_inline)) float sum_of_products(const float* a, const float* b, int64_t n) {
  return lane_sum(n, [=](int64_t i) { return a[i] * b[i]; });
}

// exp for whole arrays, in the vectorised SLEEF functions torch itself computes exp with (ATen's Vectorized<float>::exp,
// so torch's softmax and SiLU; 1.0 ulp), called from the copy of libtorch already loaded. A scalar std::exp per
// value had been most of attention's time (one per position and head) and of SiLU's. Declared weak: where a torch
// build lacks them, the scalar loop runs.
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
extern "C" __m256 Sleef_expf8_u10avx2(__m256) __attribute__((weak));
extern "C" __m512 Sleef_expf16_u10avx512f(__m512) __attribute__((weak));
#pragma GCC pop_options

// out[i] = exp(sign * in[i] - shift), sign 1 or -1 (so sign * in is exact); in and out may be the same array.
inline void exp_scalar(const float* in, float* out, int64_t n, float sign, float shift) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::exp(sign * in[i] - shift);
}

// out[i] += weights[j] * values_j[i] for j = 0 .. count - 1 in order, `count` value rows `stride` floats apart, `dim`
// values each: the outputs held in vector registers across the rows, 64 at a time in independent sums (the plain loop
// loaded and stored every output once per row, and an add waited for the one before). Each output is summed exactly
// as the plain loop sums it. `Vec` is GCC's vector type of the copy's register width (layer_ops_copy.h): the AVX2
// copy, given 16-float vectors, kept them on the stack, a load and a store per multiply-add, which was most of a
// batch-1 step's attention there (docs/benchmarks.md, "Attention's sums in registers on AVX2").
template <typename Vec, int N>
inline __attribute__((always_inline)) void add_weighted_rows_n(const float* weights, const float* values, int64_t count,
                                                               int64_t stride, float* out) {
  constexpr int lanes = sizeof(Vec) / sizeof(float);
  Vec acc[N];
  for (int n = 0; n < N; ++n) std::memcpy(&acc[n], out + lanes * n, sizeof(Vec));
  for (int64_t j = 0; j < count; ++j)
    for (int n = 0; n < N; ++n) {  // one vector at a time: a copy of the whole row went through the stack
      Vec v;
      std::memcpy(&v, values + j * stride + lanes * n, sizeof v);
      acc[n] += weights[j] * v;
    }
  for (int n = 0; n < N; ++n) std::memcpy(out + lanes * n, &acc[n], sizeof(Vec));
}

template <typename Vec>
inline __attribute__((always_inline)) void add_weighted_rows(const float* weights, const float* values, int64_t count,
                                                             int64_t stride, int64_t dim, float* out) {
  constexpr int lanes = sizeof(Vec) / sizeof(float);
  int64_t i = 0;
  for (; i + 64 <= dim; i += 64) add_weighted_rows_n<Vec, 64 / lanes>(weights, values + i, count, stride, out + i);
  for (; i + lanes <= dim; i += lanes) add_weighted_rows_n<Vec, 1>(weights, values + i, count, stride, out + i);
  for (; i < dim; ++i)
    for (int64_t j = 0; j < count; ++j) out[i] += weights[j] * values[j * stride + i];
}

// Attention of `count` query heads that share one KV head (q: `count` heads of `dim` floats, one after another) over
// the `context` first positions of their sequence: out[h] += softmax(q_h . k_j * scale) weighted v_j, with position j's
// key and value at slot table[j / block_size] * block_size + j % block_size (`stride` floats per slot); out is `count`
// heads of `dim` floats. `scores` is scratch for count * context floats. Block by block, every head of the run takes
// the block's keys (and then its values) while they are in L1, so a grouped-query model reads each key and value once
// per run rather than once per head; each head's arithmetic is what attending it alone computes, in the same order. One
// call per run, so that its loops run inlined in the copy for this CPU (attend, layer_ops_copy.h). `keys` and `values`
// point at the run's KV head in the cache's first slot, elements of `format` (`stride` of them per slot); a 16-bit or
// q8_0 block is made fp32 into `widened` (block_size * dim floats) first, and the fp32 code reads that copy.
inline __attribute__((always_inline)) const float* block_rows(const void* cache, int64_t first, int64_t rows,
                                                              int64_t stride, int64_t dim, KvFormat format,
                                                              float* widened, int64_t& row_stride, int64_t isa) {
  if (format == KV_F32) {
    row_stride = stride;
    return static_cast<const float*>(cache) + first;
  }
  kv_rows_to_float(cache, first, stride, rows, dim, format, widened, isa);
  row_stride = dim;
  return widened;
}

#define ISA_COPY_FILE "layer_ops_copy.h"
#define ISA_COPY_NONE 1
#define ISA_COPY_AVX2 1
#define ISA_COPY_AVX512 1
#include "isa_copies.h"

// `isa` as the ops' bindings take it: -1 (their default) is layer_ops_isa(), else a copy this CPU runs.
int64_t ops_isa(int64_t isa) {
  if (isa < 0) return layer_ops_isa();
  TORCH_CHECK(isa == ISA_NONE || isa == ISA_AVX2 || isa == ISA_AVX512,
              "the layer ops have no copy for instruction set ", isa);
  TORCH_CHECK(isa <= best_isa(), "this CPU does not run instruction set ", isa);
  return isa;
}

}  // namespace

int64_t layer_ops_isa() { return best_isa(); }

void add_rms_norm_into(float* hidden, const float* delta, const float* weight, float* out, int64_t rows, int64_t n,
                       float eps, int64_t isa) {
  for (int64_t r = 0; r < rows; ++r)
    ISA_CALL(isa,
             add_rms_row(hidden + r * n, delta != nullptr ? delta + r * n : nullptr, weight, out + r * n, n, eps));
}

// hidden += delta (when given), then RMSNorm(hidden) * weight; hidden is updated in place.
at::Tensor add_rms_norm(at::Tensor hidden, c10::optional<at::Tensor> delta, at::Tensor weight, double eps,
                        int64_t isa) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && hidden.dim() == 2,
              "hidden must be a contiguous 2-D float32 tensor");
  const int64_t rows = hidden.size(0), n = hidden.size(1);
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == hidden.sizes() && d.scalar_type() == at::kFloat, "delta must match hidden");
  }
  at::Tensor w = weight.contiguous();
  TORCH_CHECK(w.numel() == n && w.scalar_type() == at::kFloat, "weight must hold one float32 per column");
  auto out = at::empty_like(hidden);
  add_rms_norm_into(hidden.data_ptr<float>(), d.defined() ? d.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                    out.data_ptr<float>(), rows, n, (float)eps, ops_isa(isa));
  return out;
}

// Rows on the kernels' pool, about 8K values a chunk (a chunk costs a few microseconds to hand out): at 32 rows of
// SmolLM2's 1536 this was 2 ms of an 80 ms step on one core while the other waited.
void silu_mul_into(const float* gate_up, float* out, int64_t rows, int64_t n, int64_t isa) {
  pool::parallel_for(rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      ISA_CALL(isa, silu_mul_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n));
  });
}

// SiLU(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2I].
at::Tensor silu_mul(at::Tensor gate_up, int64_t isa) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "gate_up must be a 2-D float32 tensor with an even width");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  silu_mul_into(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, n, ops_isa(isa));
  return out;
}

void rope_paged_attention_into(const float* x, const float* cos, const float* sin, int64_t rows, const PagedKv& kv,
                               float* q, float* o, int64_t isa) {
  const int64_t heads = kv.heads, kv_heads = kv.kv_heads, dim = kv.dim, width = (heads + 2 * kv_heads) * dim;
  const int64_t row = kv_row_elements(kv.format, dim), element = kv_element_bytes(kv.format);  // of the cache
  std::vector<float> key(dim);
  for (int64_t t = 0; t < rows; ++t) {  // RoPE on q and k, keys and values into their slots
    const float* c = cos + t * dim;
    const float* s = sin + t * dim;
    for (int64_t h = 0; h < heads; ++h)
      ISA_CALL(isa, rope_head(x + t * width + h * dim, c, s, q + (t * heads + h) * dim, dim));
    const int64_t slot = kv.slots[t] * kv_heads * row;
    for (int64_t h = 0; h < kv_heads; ++h) {
      if (kv.format == KV_F32) {  // rotated straight into the cache
        float* key_row = static_cast<float*>(kv.cache) + slot + h * dim;
        ISA_CALL(isa, rope_head(x + t * width + (heads + h) * dim, c, s, key_row, dim));
      } else {
        ISA_CALL(isa, rope_head(x + t * width + (heads + h) * dim, c, s, key.data(), dim));
        kv_store_row(key.data(), kv.cache, slot + h * row, dim, kv.format);
      }
      kv_store_row(x + t * width + (heads + kv_heads + h) * dim, kv.cache, kv.cache_half + slot + h * row, dim,
                   kv.format);
    }
  }
  std::fill(o, o + rows * heads * dim, 0.f);
  const int64_t group = heads / kv_heads;
  // A task is a run of query heads that share a KV head: the whole group where there are enough groups to keep every
  // thread busy, else one head (a batch-1 step has as few groups as KV heads, 3 for the served model).
  const int64_t run = rows * kv_heads >= 4 * pool::threads() ? group : 1, runs = heads / run;
  pool::parallel_for(rows * runs, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores, widened;
    widened.resize(kv.format == KV_F32 ? 0 : kv.block_size * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / runs, h = task % runs * run, kvh = h / group, context = kv.positions[t] + 1;
      const int64_t* table = kv.block_tables + kv.row_seq[t] * kv.max_blocks;
      TORCH_CHECK((context + kv.block_size - 1) / kv.block_size <= kv.max_blocks, "block table too short for row ", t);
      scores.resize(run * context);
      const char* cache = static_cast<const char*>(kv.cache);
      ISA_CALL(isa, attend(q + (t * heads + h) * dim, run, cache + kvh * row * element,
                           cache + (kv.cache_half + kvh * row) * element, kv.format, table, context, kv.block_size,
                           kv_heads * row, dim, kv.scale, scores.data(), widened.data(), o + (t * heads + h) * dim));
    }
  });
}

// One layer's attention for a step of short queries, reading the paged KV cache in place.
//   qkv [T, (H + 2 KVH) * D]: this step's projections; cos, sin [T, D]: rotary tables of each row's position
//   layer_cache [2, blocks, block_size, KVH, D] (float32, float16 or bfloat16; or uint8 [..., KVH, D / 32 * 34],
//   q8_0 records): written at `slots` [T] with the rotated keys and the values
//   positions [T]: each row's position; row_seq [T]: its sequence, an index into block_tables [S, max_blocks]
// Row t attends to its sequence's keys at positions 0..positions[t] (causal, so draft rows of one sequence see
// the drafts before them). Returns [T, H * D].
at::Tensor rope_paged_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor layer_cache,
                                at::Tensor slots, at::Tensor positions, at::Tensor row_seq, at::Tensor block_tables,
                                int64_t heads, int64_t kv_heads, double scale, int64_t isa) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat, "rope_paged_attention computes in float32: qkv must be float32");
  TORCH_CHECK(layer_cache.is_contiguous() && layer_cache.dim() == 5, "layer_cache must be contiguous [2, B, S, KVH, D]");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto slot = slots.to(at::kLong).contiguous();
  auto pos = positions.to(at::kLong).contiguous();
  auto seq = row_seq.to(at::kLong).contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  const KvFormat format = kv_format_of(layer_cache.scalar_type());
  const int64_t rows = qkv.size(0), dim = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim && layer_cache.size(3) == kv_heads &&
                  (format != KV_Q8_0 || dim % kQ8Block == 0) && layer_cache.size(4) == kv_row_elements(format, dim),
              "qkv / cache shapes do not match the heads (a q8_0 cache needs a head_dim that is a multiple of 32)");
  TORCH_CHECK(cos.size(0) == rows && cos.size(1) == dim && sin.sizes() == cos.sizes(), "cos/sin must be [T, D]");
  const PagedKv kv{layer_cache.data_ptr(),   layer_cache.numel() / 2,  layer_cache.size(2),
                   heads,                    kv_heads,                  dim,
                   tables.size(1),           slot.data_ptr<int64_t>(),  pos.data_ptr<int64_t>(),
                   seq.data_ptr<int64_t>(),  tables.data_ptr<int64_t>(), (float)scale,
                   format};
  auto queries = at::empty({rows, heads * dim}, qkv.options());
  auto out = at::empty({rows, heads * dim}, qkv.options());
  rope_paged_attention_into(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rows, kv,
                            queries.data_ptr<float>(), out.data_ptr<float>(), ops_isa(isa));
  return out;
}
