"""AIPerf (NVIDIA's GenAI-Perf successor) against the OpenAI front door's chat endpoint at concurrency 1, 8, 32.

AIPerf pins packages that clash with the project's, so it lives in a virtual environment of its own, never in
requirements.txt; this script creates it when missing:

    python3.11 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0
    .venv/bin/python benchmarks/tools/aiperf_run.py [--aiperf /tmp/aiperf-venv/bin/aiperf] [--concurrency 1 8 32]

It starts tritonserver with the default model repository and the front door (the launcher) on free ports,
runs `aiperf profile --endpoint-type chat --streaming --use-server-token-count` once per concurrency (synthetic
prompts of --isl tokens, --osl output tokens with ignore_eos, the model folder's tokenizer, no hub), stops the
server and writes benchmarks/results/aiperf.md with TTFT, ITL, output tokens/s and requests/s, plus the
server metrics AIPerf scraped from the front door's /metrics. AIPerf's own processes take most of a CPU core
while they run, which on a small machine the server does not get: read its figures with that in mind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import launcher
from launcher.paths import MODEL_DIR, REPO_ROOT

RESULTS = REPO_ROOT / "benchmarks" / "results" / "aiperf.md"
AIPERF_VERSION = "0.13.0"
# (AIPerf metric tag, row label, unit) in the summary table
METRICS = [
    ("time_to_first_token", "TTFT", "ms"),
    ("inter_token_latency", "ITL", "ms"),
    ("request_latency", "request latency", "ms"),
    ("output_token_throughput_per_user", "output tok/s per user", "tok/s"),
]


def ensure_aiperf(venv: Path) -> Path:
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    return exe


def run_aiperf(exe: Path, url: str, concurrency: int, args, out_dir: Path) -> tuple[dict, float, bool]:
    """One `aiperf profile` run: its exported JSON summary, the CPU cores AIPerf used on average over the run
    (its processes' CPU time over the wall time), and whether its server-metrics export holds the engine's
    `llm_*` metrics (scraped through the front door's /metrics)."""
    requests = max(args.requests_per_stream * concurrency, args.min_requests)
    cmd = [
        str(exe),
        "profile",
        "--model",
        args.model,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--use-server-token-count",
        "--tokenizer",
        str(MODEL_DIR),
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(requests),
        "--warmup-request-count",
        str(concurrency),
        "--isl",
        str(args.isl),
        "--isl-stddev",
        "0",
        "--osl",
        str(args.osl),
        "--osl-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--extra-inputs",
        "temperature:0",
        "--random-seed",
        "1",
        "--ui-type",
        "none",
        "--artifact-dir",
        str(out_dir),
    ]
    print("+ " + " ".join(cmd), flush=True)
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    subprocess.run(cmd, check=True)  # (no HF_HUB_OFFLINE: AIPerf's offline path refuses a folder path)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - started
    cores = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / wall
    found = sorted(out_dir.rglob("profile_export_aiperf.json"))
    if not found:
        raise FileNotFoundError(f"aiperf wrote no profile_export_aiperf.json under {out_dir}")
    server_metrics = sorted(out_dir.rglob("server_metrics_export.json"))
    scraped = bool(server_metrics) and "llm_kv_cache_blocks_used" in server_metrics[-1].read_text()
    return json.loads(found[-1].read_text()), cores, scraped


def metric(summary: dict, tag: str) -> dict:
    """AIPerf's record of one metric ({avg, p50, p90, p99, unit, ...}); {} when it has none."""
    value = summary.get(tag)
    return value if isinstance(value, dict) else {}


def fmt(value) -> str:
    return "-" if value is None else f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"


def report(runs: dict[int, dict], args, cores: dict[int, float], scraped: dict[int, bool]) -> str:
    lines = [
        "# AIPerf against the OpenAI front door",
        "",
        f"`benchmarks/tools/aiperf_run.py` on {datetime.date.today().isoformat()}: AIPerf {AIPERF_VERSION} "
        f"(its own virtual environment), `--endpoint-type chat --streaming --use-server-token-count`, "
        f"synthetic prompts of {args.isl} tokens, {args.osl} output tokens (`ignore_eos`, greedy), the model "
        "folder's tokenizer; tritonserver with the default model repository and the front door, on this "
        f"machine ({os.cpu_count()} logical CPUs, {platform.machine()}, no GPU).",
        "",
        "**AIPerf's own processes (workers, record processors, controller) take CPU from the server while "
        "they run**: "
        + ", ".join(f"{cores[c]:.2f} cores at concurrency {c}" for c in sorted(cores))
        + f" (AIPerf's CPU time over the run's wall time), of this machine's {os.cpu_count()}: the server runs "
        "with less than it has under Locust or `benchmarks/bench.py`, and the machine is shared, so these "
        "figures are below the project's own (docs/benchmarks.md).",
        "",
        "| concurrency | requests | "
        + " | ".join(f"{label} avg / p50 / p99 ({unit})" for _, label, unit in METRICS)
        + " | output tok/s | requests/s |",
        "|---|---|" + "---|" * (len(METRICS) + 2),
    ]
    for concurrency, summary in sorted(runs.items()):
        count = metric(summary, "request_count").get("avg")
        cells = []
        for tag, _, _ in METRICS:
            m = metric(summary, tag)
            cells.append(" / ".join(fmt(m.get(k)) for k in ("avg", "p50", "p99")))
        lines.append(
            f"| {concurrency} | {int(count) if count is not None else '-'} | "
            + " | ".join(cells)
            + f" | {fmt(metric(summary, 'output_token_throughput').get('avg'))}"
            + f" | {fmt(metric(summary, 'request_throughput').get('avg'))} |"
        )
    lines += [
        "",
        "Input tokens are counted (AIPerf knows `messages`), output tokens come from the usage chunk the front "
        "door sends (`stream_options.include_usage`), and AIPerf's server-metrics probe of the front door's "
        "`/metrics` (a `HEAD`, then scrapes) succeeds: the engine's `llm_*` metrics are in its server-metrics "
        "export in " + f"{sum(scraped.values())} of {len(scraped)} runs; through Triton's `generate_stream` none of "
        "the three worked. ISL counts the chat template's tokens too (its default system prompt).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf-venv", default=os.environ.get("AIPERF_VENV", "/tmp/aiperf-venv"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--isl", type=int, default=128, help="synthetic prompt tokens")
    ap.add_argument("--osl", type=int, default=64, help="output tokens per request")
    ap.add_argument("--requests-per-stream", type=int, default=3, help="requests = this x concurrency ...")
    ap.add_argument("--min-requests", type=int, default=8, help="... but at least this many")
    ap.add_argument("--model", default="llm")
    ap.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    ap.add_argument("--output", default=str(RESULTS))
    args = ap.parse_args(argv)

    exe = ensure_aiperf(Path(args.aiperf_venv))
    work = Path(tempfile.mkdtemp(prefix="aiperf-"))
    http, grpc, metrics_port, openai_port = (launcher.free_port() for _ in range(4))
    triton = launcher.start_server(args.model_repository, http, grpc, metrics_port, work / "tritonserver.log")
    frontend = launcher.start_frontend(
        f"127.0.0.1:{grpc}", openai_port, work / "frontend.log", metrics_url=f"http://127.0.0.1:{metrics_port}/metrics"
    )
    runs, cores, scraped = {}, {}, {}
    try:
        launcher.wait_until_ready(http, triton, 600, metrics_port=metrics_port)
        launcher.wait_until_frontend_ready(openai_port, frontend, 120)
        for c in args.concurrency:
            runs[c], cores[c], scraped[c] = run_aiperf(exe, f"http://127.0.0.1:{openai_port}", c, args, work / f"c{c}")
    finally:
        launcher.stop_server(frontend, 10)
        launcher.stop_server(triton)
    text = report(runs, args, cores, scraped)
    Path(args.output).write_text(text)
    print(text)
    print(f"AIPerf's exports and the server logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
