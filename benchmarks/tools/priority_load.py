"""Request priority under saturation: time to first token and inter-token latency of a few high-priority requests
in a load that fills every sequence slot and the KV cache, against the same load sent without priorities, in one
in-process engine (the served configuration with fewer slots and blocks than the load wants), the two runs taking
turns so each comparison is of figures taken minutes apart at most. Writes benchmarks/results/priority.md.

Every `--every`-th request is a "high" one (priority -1 in the priority run, the default 0 in the baseline, the
rest 0 in both); `--streams` closed-loop clients keep that many requests in flight, more than `max_num_seqs`, so a
queue forms, and the KV cache holds fewer tokens than the running batch grows to, so sequences are preempted.

    python benchmarks/tools/priority_load.py [--model DIR] [--requests 64] [--every 8] [--streams 24] [--max-tokens 32]
                                       [--max-num-seqs 8] [--kv-cache-blocks 12] [--runs 2] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from backend import EngineConfig, LLMEngine
from backend.model.hardware import cpu_flags_of_this_machine
from benchmarks.core.common import PROMPTS, machine_description, median, run_engine_requests
from launcher.model_config import read_parameters
from launcher.paths import MODEL_DIR

RESULTS = Path(__file__).resolve().parents[1] / "results" / "priority.md"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else median(values)


def summary(result, ids: set[str]) -> dict[str, float]:
    """Median and p90 time to first token, median inter-token latency (ms) of the requests `ids`."""
    ttft = [result.ttft_by_id[r] * 1e3 for r in ids]
    itl = [gap * 1e3 for r in ids for gap in result.itl_by_id.get(r, [])]
    return {"ttft_p50": median(ttft), "ttft_p90": percentile(ttft, 90), "itl_p50": median(itl)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--streams", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-cache-blocks", type=int, default=12)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an engine parameter over them")
    args = ap.parse_args(argv)
    parameters = {
        **read_parameters(),
        "model": args.model,
        "max_num_seqs": str(args.max_num_seqs),
        "kv_cache_blocks": str(args.kv_cache_blocks),
        **dict(item.split("=", 1) for item in args.set),
    }
    engine = LLMEngine(EngineConfig.from_parameters(parameters))
    requests = [(PROMPTS[i % len(PROMPTS)], args.max_tokens) for i in range(args.requests)]
    high = {f"r{i}" for i in range(args.every - 1, args.requests, args.every)}
    rest = {f"r{i}" for i in range(args.requests)} - high
    run_engine_requests(engine, requests[:4], GREEDY, 4)  # warm-up
    started, load_before = time.time(), os.getloadavg()[0]
    rows: dict[str, list[dict]] = {"without priorities": [], "with priorities": []}
    preemptions = {label: 0 for label in rows}
    for _ in range(args.runs):
        for label, priority in (("without priorities", 0), ("with priorities", -1)):
            before = engine.scheduler.num_preemptions
            result = run_engine_requests(
                engine,
                requests,
                GREEDY,
                args.streams,
                overrides=lambda i, p=priority: {"priority": p if f"r{i}" in high else 0},
            )
            preemptions[label] += engine.scheduler.num_preemptions - before
            rows[label].append(
                {"high": summary(result, high), "rest": summary(result, rest), "tok/s": result.tokens_per_s}
            )
    report = render(args, rows, preemptions, time.time() - started, (load_before, os.getloadavg()[0]))
    RESULTS.write_text(report)
    print(report)


def render(args, rows: dict[str, list[dict]], preemptions: dict[str, int], seconds: float, load) -> str:
    flags = sorted(f for f in cpu_flags_of_this_machine() if f.startswith(("avx", "amx")))
    lines = [
        "# Request priority under saturation",
        "",
        f"`python benchmarks/tools/priority_load.py` ({seconds:.0f} s): in-process engine, the served configuration "
        f"with max_num_seqs {args.max_num_seqs} and {args.kv_cache_blocks} KV blocks; {args.requests} requests "
        f"(the {len(PROMPTS)} prompts of benchmarks/core/common.py), greedy, ignore_eos, {args.max_tokens} tokens "
        "each, "
        f"{args.streams} in flight; every {args.every}th request is high-priority (priority -1; 0 in the run "
        f"without priorities). Medians over {args.runs} runs of each, taking turns. {machine_description()}.",
        "",
        f"CPU flags: {' '.join(flags) or 'none'}; {os.cpu_count()} cores, load average {load[0]:.1f} at the start "
        f"and {load[1]:.1f} at the end (other processes share the cores: compare the rows, not runs of other days).",
        "",
        "| run | high TTFT p50 ms | high TTFT p90 ms | high ITL p50 ms | rest TTFT p50 ms | rest ITL p50 ms "
        "| output tok/s | preemptions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in rows.items():

        def of(group: str, key: str) -> float:
            return median([run[group][key] for run in runs])  # noqa: B023 - used at once, in this iteration

        lines.append(
            f"| {label} | {of('high', 'ttft_p50'):.0f} | {of('high', 'ttft_p90'):.0f} | {of('high', 'itl_p50'):.1f} "
            f"| {of('rest', 'ttft_p50'):.0f} | {of('rest', 'itl_p50'):.1f} "
            f"| {median([run['tok/s'] for run in runs]):.1f} | {preemptions[label]} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
