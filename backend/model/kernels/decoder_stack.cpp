// A decode step's model pass in one native call: for each layer, QKV (and Qwen3's RMSNorm of each query and key
// head), RoPE + KV write + attention over the paged
// blocks, O projection, residual + RMSNorm, gate/up, SiLU * up, down, residual + RMSNorm; then the final norm and
// the LM head for the rows that sample. Exactly the calls FusedLlama._forward_short makes from Python (so the
// results are bit for bit the same), without a Python round trip and tensor conversion between them: about 240
// calls per step of the served model, and the GIL released for the whole pass. Built once at load from the
// weights, where every projection and the LM head are low-bit kernel layers.
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "ops.h"

namespace {

// One projection on the low-bit kernel, as LowBitLinear computes it: output rows in segments of one block format
// each, concatenated; bias added after, as `out + bias`.
struct Projection {
  std::vector<at::Tensor> packed;
  std::vector<int64_t> out_features, formats;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x, int64_t isa) const {
    std::vector<at::Tensor> outs;
    for (size_t i = 0; i < packed.size(); ++i) outs.push_back(lowbit_linear(x, packed[i], out_features[i], formats[i], isa));
    at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
    return bias.has_value() ? out + *bias : out;
  }
};

}  // namespace

class DecoderStack {
 public:
  // Per layer i: norms[2i] input norm, norms[2i + 1] post-attention norm; head_norms[2i], [2i + 1] the query and key
  // head norms (Qwen3; empty for models without); projections[4i..4i+3] QKV, O, gate/up,
  // down (per segment: packed blocks, output rows, block format; then bias or None). Last: the final norm, and the
  // LM head.
  DecoderStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> head_norms, std::vector<std::vector<at::Tensor>> packed,
               std::vector<std::vector<int64_t>> out_features, std::vector<std::vector<int64_t>> formats,
               std::vector<c10::optional<at::Tensor>> biases, int64_t isa,
               int64_t heads, int64_t kv_heads, double scale, double eps)
      : norms_(std::move(norms)), head_norms_(std::move(head_norms)), isa_(isa), heads_(heads), kv_heads_(kv_heads), scale_(scale), eps_(eps) {
    TORCH_CHECK(norms_.size() % 2 == 1 && packed.size() + 1 == 2 * norms_.size() &&
                    out_features.size() == packed.size() && formats.size() == packed.size() &&
                    biases.size() == packed.size(),
                "a decoder stack needs 2 norms and 4 projections per layer, then the final norm and the LM head");
    TORCH_CHECK(head_norms_.empty() || head_norms_.size() + 1 == norms_.size(), "head norms: none, or 2 per layer");
    for (size_t i = 0; i < packed.size(); ++i) projections_.push_back({packed[i], out_features[i], formats[i], biases[i]});
  }

  int64_t layers() const { return (int64_t)norms_.size() / 2; }

  // qkv [T, (heads + 2 kv heads) * D] with layer i's query and key heads RMS-normed (FusedLlama._head_normed).
  at::Tensor head_normed(const at::Tensor& qkv, int64_t i) const {
    if (head_norms_.empty()) return qkv;
    const int64_t rows = qkv.size(0), d = qkv.size(1) / (heads_ + 2 * kv_heads_);
    const at::Tensor q = qkv.narrow(1, 0, heads_ * d).reshape({-1, d});
    const at::Tensor k = qkv.narrow(1, heads_ * d, kv_heads_ * d).reshape({-1, d});
    return at::cat({add_rms_norm(q, {}, head_norms_[2 * i], eps_).view({rows, heads_ * d}),
                    add_rms_norm(k, {}, head_norms_[2 * i + 1], eps_).view({rows, kv_heads_ * d}),
                    qkv.narrow(1, (heads_ + kv_heads_) * d, kv_heads_ * d)},
                   1);
  }

  // `hidden` [T, H] the residual stream (updated in place), `normed` its input-normed rows for the first layer,
  // `kv_cache` [layers, ...] (paged_attention.py), `keep` the rows that sample. Returns their logits.
  at::Tensor forward(at::Tensor hidden, at::Tensor normed, at::Tensor cos, at::Tensor sin,
                     at::Tensor kv_cache, at::Tensor slots, at::Tensor positions, at::Tensor row_seq,
                     at::Tensor block_tables, at::Tensor keep) const {
    const int64_t n = layers();
    TORCH_CHECK(kv_cache.size(0) >= n, "the KV cache has ", kv_cache.size(0), " layers, the stack ", n);
    at::Tensor delta;
    for (int64_t i = 0; i < n; ++i) {
      const Projection* p = &projections_[4 * i];
      at::Tensor attended = rope_paged_attention(head_normed(p[0](normed, isa_), i), cos, sin, kv_cache[i], slots, positions, row_seq,
                                                 block_tables, heads_, kv_heads_, scale_);
      normed = add_rms_norm(hidden, p[1](attended, isa_), norms_[2 * i + 1], eps_);
      delta = p[3](silu_mul(p[2](normed, isa_)), isa_);
      if (i + 1 < n) normed = add_rms_norm(hidden, delta, norms_[2 * i + 2], eps_);
    }
    const at::Tensor last = add_rms_norm(hidden.index_select(0, keep), delta.index_select(0, keep), norms_.back(), eps_);
    return projections_.back()(last, isa_);
  }

 private:
  std::vector<at::Tensor> norms_, head_norms_;
  std::vector<Projection> projections_;
  int64_t isa_, heads_, kv_heads_;
  double scale_, eps_;
};

void bind_decoder_stack(py::module& m) {
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::vector<at::Tensor>>, std::vector<std::vector<int64_t>>,
                    std::vector<std::vector<int64_t>>, std::vector<c10::optional<at::Tensor>>, int64_t, int64_t,
                    int64_t, double, double>())
      .def("layers", &DecoderStack::layers)
      .def("forward", &DecoderStack::forward, "a short step's pass, logits of the rows `keep` (see FusedLlama._forward_short)",
           py::call_guard<py::gil_scoped_release>());
}
