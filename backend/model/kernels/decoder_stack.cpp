// A decode step's model pass in one native call: the token embeddings, each row's rotary cos and sin from the
// tables, the first input norm; then for each layer, QKV (and Qwen3's RMSNorm of each query and key
// head), RoPE + KV write + attention over the paged
// blocks, O projection, residual + RMSNorm, gate/up, SiLU * up, down, residual + RMSNorm; then the final norm and
// the LM head for the rows that sample. Exactly the calls FusedLlama._forward_short makes from Python (so the
// results are bit for bit the same), without a Python round trip and tensor conversion between them: about 240
// calls per step of the served model, and the GIL released for the whole pass. The layers' activations live in one
// workspace allocated per pass and the ops take raw rows (ops.h), so a layer allocates and checks nothing: at one
// row those tensors and checks were about 0.25 ms of a 4 ms pass (docs/benchmarks.md, "One workspace per pass").
// The step's first ops (embedding, rotary lookup, first norm) are here too: as torch ops, each took 13-40 us of a
// one-row step, run with caches the pass had just flushed (docs/benchmarks.md, "The step's Python runs cold").
// Built once at load from the weights, where every projection and the LM head are low-bit kernel layers.
#include <torch/extension.h>

#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"

namespace {

// One projection on the low-bit kernel, as LowBitLinear computes it: output rows in segments of one block format
// each, side by side; bias added after, as `out + bias` (the same fp32 sum).
struct Projection {
  std::vector<at::Tensor> packed;
  std::vector<int64_t> out_features, formats;
  c10::optional<at::Tensor> bias;
  int64_t in_features = 0;

  int64_t width() const { return std::accumulate(out_features.begin(), out_features.end(), int64_t{0}); }

  // Checks the weights against `in` inputs (once, at load: `into` checks nothing).
  void check(int64_t in, int64_t isa) {
    in_features = in;
    for (size_t i = 0; i < packed.size(); ++i) check_lowbit_packed(packed[i], in, out_features[i], formats[i], isa);
    if (bias.has_value()) {
      bias = bias->contiguous();
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == width(), "a bias must be float32, one per row");
    }
  }

  // out [rows, width()] = x [rows, in_features] @ W^T (+ bias).
  void into(const float* x, int64_t rows, float* out, int64_t isa) const {
    const int64_t w = width();
    int64_t column = 0;
    for (size_t i = 0; i < packed.size(); ++i) {
      lowbit_linear_into(x, rows, in_features, packed[i], out_features[i], formats[i], isa, out + column, w);
      column += out_features[i];
    }
    if (bias.has_value()) {
      const float* b = bias->data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < w; ++c) out[r * w + c] += b[c];
    }
  }

  at::Tensor operator()(const at::Tensor& x, int64_t isa) const {
    TORCH_CHECK(x.is_contiguous() && x.size(1) == in_features, "the projection takes ", in_features, " inputs");
    at::Tensor out = at::empty({x.size(0), width()}, x.options());
    into(x.data_ptr<float>(), x.size(0), out.data_ptr<float>(), isa);
    return out;
  }
};

// The token embedding [vocab, width]: float32 rows (`format` kDenseRows), or packed blocks of a weight format,
// de-quantized row by row as a step looks them up (lowbit_row_into: the same bits).
constexpr int64_t kDenseRows = -1;
struct Embedding {
  at::Tensor data;
  int64_t format, vocab, width;

  void row_into(int64_t id, float* out) const {
    if (format == kDenseRows) {
      const float* e = data.data_ptr<float>() + id * width;
      std::copy(e, e + width, out);
    } else {
      lowbit_row_into(data.data_ptr<uint8_t>(), width, format, id, out);
    }
  }
};

// A float32 [rows, width] tensor, checked.
void check_rows(const at::Tensor& t, int64_t rows, int64_t width, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == width,
              name, " must be a contiguous float32 [", rows, ", ", width, "] tensor");
}

}  // namespace

class DecoderStack {
 public:
  // `embed` the token embeddings [`vocab`, hidden]: float32 rows (`embed_format` -1) or packed blocks of that
  // format. Per layer i: norms[2i] input norm, norms[2i + 1] post-attention
  // norm; head_norms[2i], [2i + 1] the query and key head norms (Qwen3; empty for models without);
  // projections[4i..4i+3] QKV, O, gate/up, down (per segment: packed blocks, output rows, block format; then bias or
  // None). Last: the final norm, and the LM head.
  DecoderStack(at::Tensor embed, int64_t embed_format, int64_t vocab, std::vector<at::Tensor> norms, std::vector<at::Tensor> head_norms, std::vector<std::vector<at::Tensor>> packed,
               std::vector<std::vector<int64_t>> out_features, std::vector<std::vector<int64_t>> formats,
               std::vector<c10::optional<at::Tensor>> biases, int64_t isa,
               int64_t heads, int64_t kv_heads, double scale, double eps)
      : embed_{std::move(embed), embed_format, vocab, 0}, norms_(std::move(norms)), head_norms_(std::move(head_norms)), isa_(isa), heads_(heads), kv_heads_(kv_heads), scale_(scale), eps_(eps) {
    TORCH_CHECK(norms_.size() % 2 == 1 && packed.size() + 1 == 2 * norms_.size() &&
                    out_features.size() == packed.size() && formats.size() == packed.size() &&
                    biases.size() == packed.size(),
                "a decoder stack needs 2 norms and 4 projections per layer, then the final norm and the LM head");
    TORCH_CHECK(head_norms_.empty() || head_norms_.size() + 1 == norms_.size(), "head norms: none, or 2 per layer");
    for (size_t i = 0; i < packed.size(); ++i) projections_.push_back({packed[i], out_features[i], formats[i], biases[i]});
    hidden_ = norms_[0].numel();
    embed_.width = hidden_;
    if (embed_format == kDenseRows)
      check_rows(embed_.data, vocab, hidden_, "the embedding");
    else
      check_lowbit_packed(embed_.data, hidden_, vocab, embed_format, isa_);
    qkv_width_ = projections_[0].width();
    TORCH_CHECK(qkv_width_ % (heads_ + 2 * kv_heads_) == 0, "QKV's rows do not split into the heads");
    dim_ = qkv_width_ / (heads_ + 2 * kv_heads_);
    intermediate_ = projections_[2].width() / 2;
    for (int64_t i = 0; i < layers(); ++i) {
      const Projection* p = &projections_[4 * i];
      TORCH_CHECK(p[0].width() == qkv_width_ && p[1].width() == hidden_ && p[2].width() == 2 * intermediate_ &&
                      p[3].width() == hidden_,
                  "layer ", i, "'s projections differ in shape from the first layer's");
      projections_[4 * i].check(hidden_, isa_);
      projections_[4 * i + 1].check(heads_ * dim_, isa_);
      projections_[4 * i + 2].check(hidden_, isa_);
      projections_[4 * i + 3].check(intermediate_, isa_);
    }
    for (const at::Tensor& norm : norms_)
      TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == hidden_,
                  "every norm must be float32, one per hidden unit");
    projections_.back().check(hidden_, isa_);
  }

  int64_t layers() const { return (int64_t)norms_.size() / 2; }

  // qkv [T, (heads + 2 kv heads) * D] with layer i's query and key heads RMS-normed (FusedLlama._head_normed).
  at::Tensor head_normed(const at::Tensor& qkv, int64_t i) const {
    if (head_norms_.empty()) return qkv;
    const int64_t rows = qkv.size(0), d = qkv.size(1) / (heads_ + 2 * kv_heads_);
    const at::Tensor q = qkv.narrow(1, 0, heads_ * d).reshape({-1, d});
    const at::Tensor k = qkv.narrow(1, heads_ * d, kv_heads_ * d).reshape({-1, d});
    return at::cat({add_rms_norm(q, {}, head_norms_[2 * i], eps_, ops_isa_).view({rows, heads_ * d}),
                    add_rms_norm(k, {}, head_norms_[2 * i + 1], eps_, ops_isa_).view({rows, kv_heads_ * d}),
                    qkv.narrow(1, (heads_ + kv_heads_) * d, kv_heads_ * d)},
                   1);
  }

  // `input_ids` [T] the step's tokens, `cos_table` and `sin_table` [P, D] the rotary values of positions 0 .. P - 1
  // (RotaryTable), `kv_cache` [layers, ...] (paged_attention.py), `keep` the rows that sample. Returns their logits.
  // The layers' activations live in one workspace allocated per pass, each op writing into its slice of it.
  at::Tensor forward(at::Tensor input_ids, at::Tensor cos_table, at::Tensor sin_table, at::Tensor kv_cache,
                     at::Tensor slots, at::Tensor positions, at::Tensor row_seq, at::Tensor block_tables,
                     at::Tensor keep) const {
    const at::Tensor ids = input_ids.to(at::kLong).contiguous();
    const int64_t n = layers(), rows = ids.numel(), vocab = embed_.vocab, table_rows = cos_table.size(0);
    check_rows(cos_table, table_rows, dim_, "cos_table");
    check_rows(sin_table, table_rows, dim_, "sin_table");
    const KvFormat format = kv_format_of(kv_cache.scalar_type());
    TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 6 && kv_cache.size(0) >= n &&
                    kv_cache.size(4) == kv_heads_ && kv_cache.size(5) == kv_row_elements(format, dim_) &&
                    (format != KV_Q8_0 || dim_ % kQ8Block == 0),
                "kv_cache must be contiguous [layers, 2, blocks, block_size, ", kv_heads_, ", ",
                kv_row_elements(format, dim_), "] (q8_0: head_dim a multiple of 32)");
    const at::Tensor slot = slots.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous();
    const at::Tensor seq = row_seq.to(at::kLong).contiguous(), tables = block_tables.to(at::kLong).contiguous();
    TORCH_CHECK(slot.numel() == rows && pos.numel() == rows && seq.numel() == rows && tables.dim() == 2,
                "slots, positions and row_seq need one entry per row; block_tables [sequences, max_blocks]");
    const int64_t *id = ids.data_ptr<int64_t>(), *position = pos.data_ptr<int64_t>();
    for (int64_t t = 0; t < rows; ++t) {
      TORCH_CHECK(id[t] >= 0 && id[t] < vocab, "token id ", id[t], " is outside the vocabulary of ", vocab);
      TORCH_CHECK(position[t] >= 0 && position[t] < table_rows, "position ", position[t], " is past the rotary table");
    }
    const int64_t layer_elements = kv_cache.numel() / kv_cache.size(0);
    PagedKv kv{nullptr, layer_elements / 2, kv_cache.size(3), heads_, kv_heads_, dim_, tables.size(1),
               slot.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), seq.data_ptr<int64_t>(),
               tables.data_ptr<int64_t>(), (float)scale_, format};
    const int64_t attention_width = heads_ * dim_;
    // the layer's activations: consecutive [rows, width] slices of one workspace
    const auto options = at::TensorOptions().dtype(at::kFloat);
    at::Tensor hidden = at::empty({rows, hidden_}, options);  // the residual stream
    at::Tensor workspace =
        at::empty({rows * (qkv_width_ + 2 * attention_width + 3 * hidden_ + 3 * intermediate_ + 2 * dim_)}, options);
    float* unused = workspace.data_ptr<float>();
    const auto slice = [&](int64_t width) { return std::exchange(unused, unused + rows * width); };
    float *qkv = slice(qkv_width_), *queries = slice(attention_width), *attended = slice(attention_width),
          *projected = slice(hidden_), *next_normed = slice(hidden_), *gate_up = slice(2 * intermediate_),
          *gated = slice(intermediate_), *delta = slice(hidden_), *cos = slice(dim_), *sin = slice(dim_);
    float* h = hidden.data_ptr<float>();
    const float *cos_rows = cos_table.data_ptr<float>(), *sin_rows = sin_table.data_ptr<float>();
    for (int64_t t = 0; t < rows; ++t) {  // the embedding's rows and copies of the rotary table's, bit for bit
      embed_.row_into(id[t], h + t * hidden_);
      std::copy(cos_rows + position[t] * dim_, cos_rows + (position[t] + 1) * dim_, cos + t * dim_);
      std::copy(sin_rows + position[t] * dim_, sin_rows + (position[t] + 1) * dim_, sin + t * dim_);
    }
    add_rms_norm_into(h, nullptr, norms_[0].data_ptr<float>(), next_normed, rows, hidden_, (float)eps_, ops_isa_);
    const float* layer_input = next_normed;
    for (int64_t i = 0; i < n; ++i) {
      const Projection* p = &projections_[4 * i];
      p[0].into(layer_input, rows, qkv, isa_);
      at::Tensor normed_heads;  // Qwen3's head norms: a tensor of its own
      if (!head_norms_.empty())
        normed_heads = head_normed(at::from_blob(qkv, {rows, qkv_width_}, options), i);
      kv.cache = static_cast<char*>(kv_cache.data_ptr()) + i * layer_elements * kv_cache.element_size();
      rope_paged_attention_into(normed_heads.defined() ? normed_heads.data_ptr<float>() : qkv, cos, sin, rows, kv,
                                queries, attended, ops_isa_);
      p[1].into(attended, rows, projected, isa_);
      add_rms_norm_into(h, projected, norms_[2 * i + 1].data_ptr<float>(), next_normed, rows, hidden_, (float)eps_,
                        ops_isa_);
      p[2].into(next_normed, rows, gate_up, isa_);
      silu_mul_into(gate_up, gated, rows, intermediate_, ops_isa_);
      p[3].into(gated, rows, delta, isa_);
      if (i + 1 < n)
        add_rms_norm_into(h, delta, norms_[2 * i + 2].data_ptr<float>(), next_normed, rows, hidden_, (float)eps_,
                          ops_isa_);
      layer_input = next_normed;
    }
    const at::Tensor deltas =
        workspace.narrow(0, delta - workspace.data_ptr<float>(), rows * hidden_).view({rows, hidden_});
    const at::Tensor last =
        add_rms_norm(hidden.index_select(0, keep), deltas.index_select(0, keep), norms_.back(), eps_, ops_isa_);
    return projections_.back()(last, isa_);
  }

 private:
  Embedding embed_;
  std::vector<at::Tensor> norms_, head_norms_;
  std::vector<Projection> projections_;
  int64_t isa_, heads_, kv_heads_;
  int64_t ops_isa_ = layer_ops_isa();  // the layer ops' copy (isa_ is the low-bit kernel's)
  int64_t hidden_ = 0, qkv_width_ = 0, dim_ = 0, intermediate_ = 0;
  double scale_, eps_;
};

void bind_decoder_stack(py::module& m) {
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<at::Tensor, int64_t, int64_t, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<std::vector<at::Tensor>>, std::vector<std::vector<int64_t>>,
                    std::vector<std::vector<int64_t>>, std::vector<c10::optional<at::Tensor>>, int64_t, int64_t,
                    int64_t, double, double>())
      .def("layers", &DecoderStack::layers)
      .def("forward", &DecoderStack::forward, "a short step's pass, logits of the rows `keep` (see FusedLlama._forward_short)",
           py::call_guard<py::gil_scoped_release>());
}
