"""How the report writes runs down: milliseconds for its tables, a row comparing two runs of one workload, and a
run's throughput and latency percentiles as results.json keeps them."""

from __future__ import annotations

import math

from benchmarks.core.common import LoadResult
from testkit.stats import percentile


def ms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    return f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def load_summary(r: LoadResult) -> dict:
    """A run's throughput and latency percentiles, as results.json keeps them."""
    return {
        "wall_s": r.wall_s,
        "requests": r.num_requests,
        "output_tokens": r.output_tokens,
        "tokens_per_s": r.tokens_per_s,
        "requests_per_s": r.requests_per_s,
        "ttft_p50_s": percentile(r.ttft_s, 50),
        "ttft_p99_s": percentile(r.ttft_s, 99),
        "itl_p50_s": percentile(r.itl_s, 50),
        "itl_p99_s": percentile(r.itl_s, 99),
        "e2e_p50_s": percentile(r.e2e_s, 50),
        "e2e_p99_s": percentile(r.e2e_s, 99),
        "engine_steps": r.engine_steps,
        "step_sequences": r.step_sequences,
    }


def versus_row(first_cells: list, ours: LoadResult, theirs: LoadResult, verdict: str) -> str:
    """A table row comparing two runs of one workload: the first cells, ours and their tok/s, the verdict, and
    p50 TTFT and ITL as ours / theirs."""
    pairs = [
        f"{ms(percentile(getattr(ours, k), 50))} / {ms(percentile(getattr(theirs, k), 50))}"
        for k in ("ttft_s", "itl_s")
    ]
    cells = [*first_cells, f"{ours.tokens_per_s:.1f}", f"{theirs.tokens_per_s:.1f}", verdict, *pairs]
    return "| " + " | ".join(str(c) for c in cells) + " |"
