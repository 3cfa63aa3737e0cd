// The Python module of our kernels: lowbit.cpp (low-bit linear layers) and layer_ops.cpp (decoder-layer ops).
#include <torch/extension.h>

int64_t best_isa();
at::Tensor lowbit_linear(at::Tensor x, at::Tensor packed, int64_t out_features, int64_t format, int64_t isa);
at::Tensor add_rms_norm(at::Tensor hidden, c10::optional<at::Tensor> delta, at::Tensor weight, double eps);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor rope_paged_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor layer_cache,
                                at::Tensor slots, at::Tensor positions, at::Tensor row_seq, at::Tensor block_tables,
                                int64_t heads, int64_t kv_heads, double scale);

// Every compute function runs without the GIL (its arguments are converted before and its result after): the
// server's Python threads (response sending, metrics, cancellation) run beside a kernel instead of waiting for
// it, and the engine never waits on them between its own calls.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("best_isa", &best_isa, "best instruction set of this CPU: 2 AVX-512, 1 AVX2+FMA+F16C, 0 neither");
  m.def("lowbit_linear", &lowbit_linear, "x @ W^T for W in packed GGUF blocks (Q4_1 / Q8_0)", no_gil);
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta (in place), then RMSNorm(hidden) * weight",
        py::arg("hidden"), py::arg("delta"), py::arg("weight"), py::arg("eps"), no_gil);
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of a fused gate/up projection", no_gil);
  m.def("rope_paged_attention", &rope_paged_attention, "RoPE, KV-cache write and attention over paged blocks",
        no_gil);
}
