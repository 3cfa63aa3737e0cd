"""Section 3: the Triton path's overhead, the same workloads through our engine in-process against through
tritonserver, and where the difference lies (fewer sequences per step, or slower steps)."""

from __future__ import annotations

import math
import os
import statistics

from benchmarks.core import thread_cpu
from benchmarks.core.common import LoadResult
from benchmarks.core.context import Bench
from benchmarks.core.formatting import ms
from benchmarks.core.plots import paired_bars
from benchmarks.core.progress import log
from benchmarks.core.targets import GOALS, TRITON_STEPS
from testkit.stats import percentile

TITLE = "Triton path overhead: in-process engine vs through Triton"


def run(bench: Bench) -> list[str]:
    s = bench.s
    bench.engine()
    for _ in range(s.repeats):  # interleaved, so drift hits both paths alike
        for c in s.concurrency:
            log(f"3: {c} streams: in-process engine")
            bench.inproc(c)
            if len(bench.triton_runs.get(c, [])) < s.repeats:
                log(f"3: {c} streams: through Triton")
                bench.triton(c)
    rows, data = [], {}
    for c in s.concurrency:
        inproc = statistics.median(r.tokens_per_s for r in bench.inproc_runs[c])
        triton = statistics.median(r.tokens_per_s for r in bench.triton_runs[c])
        overhead = inproc / triton - 1
        ttft_in = statistics.median(percentile(r.ttft_s, 50) for r in bench.inproc_runs[c])
        ttft_tr = statistics.median(percentile(r.ttft_s, 50) for r in bench.triton_runs[c])
        data[c] = {
            "in_process_tok_s": inproc,
            "triton_tok_s": triton,
            "overhead": overhead,
            "runs": len(bench.inproc_runs[c]),
            "ttft_p50_in_process_s": ttft_in,
            "ttft_p50_triton_s": ttft_tr,
            "steps_in_process": _steps(bench.inproc_runs[c]),
            "steps_triton": _steps(bench.triton_runs[c]),
        }
        rows.append(
            f"| {c} | {inproc:.1f} | {triton:.1f} | {bench.target('P7', overhead, f'{c} streams')} | "
            f"{ms(ttft_in)} | {ms(ttft_tr)} |"
        )
    bench.results["sections"]["3"] = data
    bench.bounds[TRITON_STEPS] = steps_table(data)
    lines = [
        f"The workloads of section 2 ({s.max_tokens} tokens per request), our engine with the served parameters "
        "(model_repository/llm/config.pbtxt, same thread count) driven in-process by benchmarks/core/common.py "
        f"`run_engine_requests`, against through tritonserver with gRPC streaming clients. Medians of {s.repeats} "
        f"interleaved run(s) per path. Overhead = in-process tok/s / Triton tok/s - 1 (P7 target "
        f"{GOALS['P7'].text} at every level). The Triton side includes the client threads, which share the "
        "machine's cores.",
        "",
        "| streams | in-process tok/s | through Triton tok/s | Triton overhead | TTFT p50 ms in-process | "
        "TTFT p50 ms Triton |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "Where the difference lies: the engine's own step count over each run (in-process from the engine, "
        "through Triton from the server's metrics endpoint). Fewer sequences per step through Triton means "
        "requests reach the engine later (turnaround between a response and the next request); a longer wall "
        "time per step at the same batch means the steps themselves ran slower (the stub's and the client's "
        "threads taking CPU from the engine).",
        "",
        *bench.bounds[TRITON_STEPS],
        "",
        "Who took the CPU through Triton: per group of threads (by the names the engine gives its threads), "
        "seconds on a core and seconds runnable but waiting for one, as a share of the run's wall time (100 % "
        f"= one core; this machine has {os.cpu_count()}), medians over the runs. The engine's step runs on its "
        "thread and the kernels' workers; time they wait for a core is time the step stands still.",
        "",
        *cpu_table(bench.triton_runs, s.concurrency),
        "",
        bench.plot(_figure(s.concurrency, data), "triton_overhead.png"),
    ]
    return lines


def _steps(runs: list[LoadResult]) -> dict:
    """Median engine steps, sequences per step and wall ms per step over `runs`."""

    def per_step(value: float, steps: float) -> float:
        return value / steps if steps > 0 else math.nan  # nan stays nan

    return {
        "steps": statistics.median(r.engine_steps for r in runs),
        "sequences_per_step": statistics.median(per_step(r.step_sequences, r.engine_steps) for r in runs),
        "ms_per_step": statistics.median(per_step(r.wall_s * 1e3, r.engine_steps) for r in runs),
    }


def cpu_table(runs: dict[int, list[LoadResult]], concurrency: list[int]) -> list[str]:
    """% of one core per thread group (on a core; waiting for one, for the engine) at each concurrency."""
    groups = [g for g, _, _ in thread_cpu.GROUPS] + [thread_cpu.CLIENT]
    header = " | ".join(f"{g}: % on a core / % waiting" if g == thread_cpu.ENGINE else g for g in groups)
    lines = [f"| streams | {header} |", "|---|" + "---|" * len(groups)]
    for c in concurrency:
        measured = [r for r in runs.get(c, []) if r.thread_times]
        if measured:
            cells = [_share(measured, g, "cpu_s") for g in groups]
            cells[0] += " / " + _share(measured, thread_cpu.ENGINE, "wait_s")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def _share(runs: list[LoadResult], group: str, attr: str) -> str:
    return f"{statistics.median(getattr(r.thread_times[group], attr) / r.wall_s * 100 for r in runs):.0f}"


def steps_table(data: dict) -> list[str]:
    lines = [
        "| streams | engine steps, in-process / Triton | sequences per step, in-process / Triton | "
        "wall ms per step, in-process / Triton |",
        "|---|---|---|---|",
    ]
    for c, d in data.items():
        a, b = d["steps_in_process"], d["steps_triton"]
        if any(math.isnan(x) for x in (*a.values(), *b.values())):
            lines.append(f"| {c} | n/a (no step counts) | | |")
            continue
        lines.append(
            f"| {c} | {a['steps']:.0f} / {b['steps']:.0f} | {a['sequences_per_step']:.1f} / "
            f"{b['sequences_per_step']:.1f} | {a['ms_per_step']:.1f} / {b['ms_per_step']:.1f} |"
        )
    return lines


def _figure(concurrency: list[int], data: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    paired_bars(
        ax,
        concurrency,
        "Triton path overhead",
        ("in-process engine", "#6aa84f", [data[c]["in_process_tok_s"] for c in concurrency]),
        ("through Triton", "#2a7ab0", [data[c]["triton_tok_s"] for c in concurrency]),
    )
    for x, c in enumerate(concurrency):
        ax.annotate(
            f"{data[c]['overhead'] * 100:+.1f} %",
            (x + 0.2, data[c]["triton_tok_s"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    return fig
