"""Section 5: throughput and latency percentiles of the served configuration as concurrent streams grow
past max_num_seqs."""

from __future__ import annotations

from benchmarks.core.context import Bench
from benchmarks.core.formatting import load_summary, ms
from benchmarks.core.progress import log
from benchmarks.core.settings import throughput_requests
from benchmarks.core.variants import MAIN_MODEL, engine_parameters

TITLE = "Cost as load grows"


def run(bench: Bench) -> list[str]:
    s = bench.s
    rows, data = [], {}
    for c in s.load_levels:
        requests = throughput_requests(s, c, load=True)
        log(f"5: {c} streams, {len(requests)} requests")
        d = data[c] = load_summary(bench.server.run(MAIN_MODEL, requests, c))
        rows.append(
            f"| {c} | {len(requests)} | {d['tokens_per_s']:.1f} | {d['requests_per_s']:.2f} | "
            f"{ms(d['ttft_p50_s'])} | {ms(d['ttft_p99_s'])} | {ms(d['itl_p50_s'])} | "
            f"{ms(d['itl_p99_s'])} | {ms(d['e2e_p50_s'])} |"
        )
    bench.results["sections"]["5"] = data
    max_seqs = int(engine_parameters(s.threads).get("max_num_seqs", 32))
    best = max(data, key=lambda c: data[c]["tokens_per_s"])
    return [
        f"Our engine through Triton (`{MAIN_MODEL}`, the served configuration, max_num_seqs {max_seqs}), gRPC "
        f"streaming clients, each stream sending its next request as soon as the last one ended; {s.max_tokens} "
        "output tokens per request, prompts from benchmarks/core/common.py. ITL per GenAI-Perf: the gap between two "
        "responses divided by the tokens in the later one. Percentiles over every request (TTFT) or gap (ITL) "
        "of the level.",
        "",
        "| streams | requests | output tok/s | requests/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| e2e p50 ms |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Peak throughput {data[best]['tokens_per_s']:.1f} tok/s at {best} streams."
        + (
            f" Past {max_seqs} streams (max_num_seqs) the extra requests wait in the queue: TTFT grows with "
            "the wait while throughput can grow no further."
            if max(data) > max_seqs
            else ""
        ),
        "",
        bench.plot(_figure(data, max_seqs), "load_curve.png"),
    ]


def _figure(data: dict, max_seqs: int):
    import matplotlib.pyplot as plt

    xs = list(data)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(xs, [data[c]["tokens_per_s"] for c in xs], "o-", color="#2a7ab0")
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("Throughput")
    for key, label, ax in (("ttft", "TTFT", axes[1]), ("itl", "ITL", axes[2])):
        ax.plot(xs, [data[c][f"{key}_p50_s"] * 1e3 for c in xs], "o-", label="p50")
        ax.plot(xs, [data[c][f"{key}_p99_s"] * 1e3 for c in xs], "s--", label="p99")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title(label)
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(c) for c in xs])
        ax.set_xlabel("concurrent streams")
        if min(xs) <= max_seqs <= max(xs):
            ax.axvline(max_seqs, color="#bbbbbb", linestyle=":", linewidth=1, label="max_num_seqs")
    return fig
