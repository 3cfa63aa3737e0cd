// The Python module of our kernels: lowbit.cpp (low-bit linear layers), layer_ops.cpp (decoder-layer ops) and
// decoder_stack.cpp (a short step's decoder layers in one call).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>

#include "ops.h"

void bind_decoder_stack(py::module& m);

// How many threads at::parallel_for spreads `tasks` one-task chunks over in this build, at the current torch thread
// count. 1 where the extension was compiled without OpenMP: ATen's parallel_for is a header template that runs
// serially unless the including file is built with -fopenmp, which the kernels once were not (every kernel on
// one core whatever torch.set_num_threads said).
int64_t parallel_threads(int64_t tasks) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) { seen |= uint64_t{1} << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}

// Every compute function runs without the GIL (its arguments are converted before and its result after): the
// server's Python threads (response sending, metrics, cancellation) run beside a kernel instead of waiting for
// it, and the engine never waits on them between its own calls.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("best_isa", &best_isa, "best instruction set of this CPU: 2 AVX-512, 1 AVX2+FMA+F16C, 0 neither");
  m.def("layer_ops_isa", &layer_ops_isa, "the copy of the layer ops this CPU runs: 2 AVX-512, 1 AVX2, 0 baseline");
  m.def("parallel_threads", &parallel_threads, "threads a parallel_for over `tasks` tasks runs on", no_gil);
  m.def("lowbit_linear", &lowbit_linear, "x @ W^T for W in packed GGUF blocks (Q4_1 / Q8_0)", no_gil);
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta (in place), then RMSNorm(hidden) * weight",
        py::arg("hidden"), py::arg("delta"), py::arg("weight"), py::arg("eps"), no_gil);
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of a fused gate/up projection", no_gil);
  m.def("rope_paged_attention", &rope_paged_attention, "RoPE, KV-cache write and attention over paged blocks",
        no_gil);
  bind_decoder_stack(m);
}
