"""Section 7: our low-bit kernel against the dense fp32 GEMM per step size, the served paths through Triton
(the exact GGUF path against bf16 + int4, where bf16 is native), and 1 against 2 torch threads."""

from __future__ import annotations

import torch

from backend.model import kernels
from benchmarks.core.context import Bench
from benchmarks.core.progress import log
from benchmarks.core.settings import throughput_requests
from benchmarks.core.variants import BF16_INT4_MODEL, MAIN_MODEL, THREADS_MODELS
from benchmarks.sections.roofline import engine_linears, linear_layers_time

TITLE = "Kernels and threads: the low-bit kernel per step size, bf16 + int4 against the exact path, 1 vs 2 threads"
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def kernel_rows(engine, threads: list[int]) -> tuple[list[str], dict]:
    """Median ms of one pass over a decode step's linear layers (LM head included) at each row count: the dense
    fp32 GEMM, and our kernel on each instruction set this CPU runs."""
    layers = [lin for lin in engine_linears(engine) if hasattr(lin, "blocks")]
    if not layers:
        return ["The served model has no low-bit layers here (no GGUF blocks or no kernel): nothing to time."], {}
    saved = [(lin.isa, lin.max_m) for lin in layers]
    paths = {"dense fp32": (0, 0)} | {
        f"ours, {kernels.ISA_NAMES[i]}": (i, 1 << 30) for i in (1, 2) if i <= kernels.best_isa()
    }
    data: dict = {}
    kernel_threads = kernels.threads()  # the engine set its own count: the rows below set theirs, then restore it
    try:
        for n in threads:
            torch.set_num_threads(n)
            kernels.set_threads(n)
            for label, (isa, max_m) in paths.items():
                for lin in layers:
                    lin.isa, lin.max_m = isa or lin.isa, max_m
                data.setdefault(n, {})[label] = {m: linear_layers_time(engine, m) * 1e3 for m in ROWS}
    finally:
        kernels.set_threads(kernel_threads)
        for lin, (isa, max_m) in zip(layers, saved):
            lin.isa, lin.max_m = isa, max_m
    lines = [f"| threads | path | {' | '.join(f'M={m}' for m in ROWS)} |", f"|---|---|{'---|' * len(ROWS)}"]
    for n, by_path in data.items():
        for label, times in by_path.items():
            lines.append(f"| {n} | {label} | {' | '.join(f'{times[m]:.1f}' for m in ROWS)} |")
    return lines, data


def exactness_rows(engine, rows: tuple[int, ...] = (1, 4, 32)) -> tuple[list[str], dict]:
    """How far our kernel and torch's fp32 matmul each land from the exact (float64) product of the de-quantized
    weights, over the served model's low-bit layers at a few row counts (normal activations): the kernel regroups
    its sums (docs/engine.md, "Exactness of the low-bit kernels"), which must stay the size of fp32's own error."""
    layers = [lin for lin in engine_linears(engine) if hasattr(lin, "blocks")]
    if not layers:
        return [], {}
    generator = torch.Generator().manual_seed(0)
    ours, dense, ratios = 0.0, 0.0, []
    for m in rows:
        for lin in layers:
            x = torch.randn(m, lin.weight.shape[1], generator=generator)
            exact = x.double() @ lin.weight.double().T
            ours_error = lin.on_kernel(x) - exact
            dense_error = (x @ lin.weight.T).double() - exact
            a, b = ours_error.abs().max().item(), dense_error.abs().max().item()
            ours, dense = max(ours, a), max(dense, b)
            ratios.append(a / b)
    ratios.sort()
    data = {"ours": ours, "torch_fp32": dense, "ratio_median": ratios[len(ratios) // 2], "ratio_max": ratios[-1]}
    return [
        f"Against the exact (float64) product of the de-quantized weights, over the {len(layers)} low-bit layers at "
        f"M = {', '.join(map(str, rows))} (normal activations, {kernels.ISA_NAMES[layers[0].isa]}): largest absolute "
        f"difference {ours:.2e} for our kernel, {dense:.2e} for torch's fp32 matmul on the same weights; per layer "
        f"ours / torch's {data['ratio_median']:.2f}x (median), {data['ratio_max']:.2f}x (largest).",
    ], data


def served_rows(bench: Bench, variants: dict[str, str]) -> tuple[list[str], dict]:
    """Output tok/s through Triton of each (label -> variant) at each concurrency level."""
    s, data = bench.s, {}
    for label, variant in variants.items():
        for c in s.concurrency:
            log(f"7: {label}, {c} streams")
            data.setdefault(label, {})[c] = bench.server.run(variant, throughput_requests(s, c), c).tokens_per_s
    first = next(iter(variants))
    lines = [f"| path | {' | '.join(f'{c} streams' for c in s.concurrency)} |", f"|---|{'---|' * len(s.concurrency)}"]
    for label, rates in data.items():
        cells = [
            f"{rates[c]:.1f}" + ("" if label == first else f" ({rates[c] / data[first][c]:.2f}x)")
            for c in s.concurrency
        ]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines, data


def run(bench: Bench) -> list[str]:
    s = bench.s
    engine = bench.engine(MAIN_MODEL)
    log("7: linear layers per step size")
    kernel_lines, kernel_data = kernel_rows(engine, sorted({1, s.peer_threads}))
    exact_lines, exact_data = exactness_rows(engine)
    torch.set_num_threads(s.threads)
    bench.results["sections"]["7"] = {"linear_ms": kernel_data, "exactness": exact_data}
    if bench.server is None:  # --no-server
        return [*_kernel_report(engine, kernel_lines, exact_lines), "", "Rows through Triton: not run (--no-server)."]
    served = {
        f"served default ({MAIN_MODEL}: {engine.config.dtype}, quantization {engine.config.quantization})": MAIN_MODEL,
        "bf16 + int4": BF16_INT4_MODEL,
    }
    served_lines, served_data = served_rows(bench, served)
    thread_lines, thread_data = served_rows(
        bench,
        {
            "default (every core)": MAIN_MODEL,
            **{f"{n} thread(s)": v for n, v in THREADS_MODELS.items()},
        },
    )
    bench.results["sections"]["7"] |= {"served_tok_s": served_data, "threads_tok_s": thread_data}
    return [
        *_kernel_report(engine, kernel_lines, exact_lines),
        "",
        "Output tokens/s through Triton, the throughput workload of sections 2 and 6, each path in the same run "
        "(ratios against the first row). `quantization: auto` takes the exact path wherever the kernel runs, AMX "
        "CPUs included (backend/model/hardware.py): this table is the measurement behind that rule on this CPU.",
        "",
        *served_lines,
        "",
        "The served configuration with its default threads (`num_threads: 0`: every core for every step; "
        "backend/model/hardware.py `serving_threads`) and fixed at 1 and 2 torch threads, same workload.",
        "",
        *thread_lines,
    ]


def _kernel_report(engine, kernel_lines: list[str], exact_lines: list[str]) -> list[str]:
    return [
        "Linear layers of one decode step (every decoder projection and the LM head), median ms of a pass at M "
        "rows, in process: the dense fp32 GEMM (torch) against our kernel on the model's own GGUF blocks, on each "
        "instruction set this CPU runs. The served configuration uses the kernel for steps of up to "
        f"{engine.runner.max_lowbit_rows} rows (`max_lowbit_rows`) and the dense GEMM above.",
        "",
        *kernel_lines,
        "",
        *exact_lines,
    ]
