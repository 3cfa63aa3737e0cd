// The Python module of our kernels: lowbit.cpp (low-bit linear layers), layer_ops.cpp (decoder-layer ops) and
// decoder_stack.cpp (a short step's decoder layers in one call).
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "ops.h"
#include "thread_pool.h"

void bind_decoder_stack(py::module& m);

// How many threads the kernels' parallel loops run on, measured: each of `tasks` chunks notes its thread, then waits
// (up to 100 ms) for as many threads as the loop may use to show up. Catches a pool that never starts its workers,
// as the kernels once ran on one core whatever torch.set_num_threads said.
int64_t parallel_threads(int64_t tasks) {
  static std::atomic<int> next_id{0};
  std::atomic<uint64_t> seen{0};
  const int expected = (int)std::min<int64_t>(std::max<int64_t>(tasks, 1), std::min(pool::threads(), 64));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  pool::parallel_for(tasks, 1, [&](int64_t, int64_t) {
    thread_local const int id = next_id++;
    seen |= uint64_t{1} << (id % 64);
    while (__builtin_popcountll(seen.load()) < expected && std::chrono::steady_clock::now() < deadline) {
    }
  });
  return __builtin_popcountll(seen.load());
}

// Every compute function runs without the GIL (its arguments are converted before and its result after): the
// server's Python threads (response sending, metrics, cancellation) run beside a kernel instead of waiting for
// it, and the engine never waits on them between its own calls.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("best_isa", &best_isa, "best instruction set of this CPU: 2 AVX-512, 1 AVX2+FMA+F16C, 0 neither");
  m.def("isa_names", [] { return std::vector<std::string>(kIsaNames, kIsaNames + kIsaCount); },
        "the instruction sets' names, indexed by their number (isa.h)");
  m.def("int8_vnni", &int8_vnni, "whether gguf_int8 multiplies with AVX-512 VNNI on instruction set `isa` here");
  m.def("layer_ops_isa", &layer_ops_isa, "the copy of the layer ops this CPU runs: 2 AVX-512, 1 AVX2, 0 baseline");
  // The layer ops take `isa` last (default -1: layer_ops_isa()), so that the tests run every copy this CPU has.
  m.def("set_threads", &pool::set_threads, "threads of the kernels' pool (0: torch's intra-op thread count)");
  m.def("parallel_threads", &parallel_threads, "threads a parallel_for over `tasks` tasks runs on", no_gil);
  m.def("lowbit_linear", &lowbit_linear, "x @ W^T for W in packed low-bit records (weight_blocks.py)", no_gil);
  m.def("lowbit_rows", &lowbit_rows, "rows `ids` of a packed weight as float32 (the reference de-quantization)",
        no_gil);
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta (in place), then RMSNorm(hidden) * weight",
        py::arg("hidden"), py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("isa") = -1, no_gil);
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of a fused gate/up projection", py::arg("gate_up"),
        py::arg("isa") = -1, no_gil);
  m.def("rope_paged_attention", &rope_paged_attention, "RoPE, KV-cache write and attention over paged blocks",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("layer_cache"), py::arg("slots"), py::arg("positions"),
        py::arg("row_seq"), py::arg("block_tables"), py::arg("heads"), py::arg("kv_heads"), py::arg("scale"),
        py::arg("isa") = -1, no_gil);
  bind_decoder_stack(m);
}
