"""The load test's throughput rows and summary (loadtest/locustfile.py loads this module, which registers its Locust
event listeners): every --throughput-interval seconds, output tokens/s and requests/s finished over the window as
THROUGHPUT rows in Locust's statistics; at the end, the aggregate per user type printed and, with --csv PREFIX,
written to PREFIX_llm_summary.csv."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import gevent
from locust import events
from locust import stats as locust_stats
from locust.runners import WorkerRunner

# the request types of the users
E2E_TYPES = ("grpc_stream", "http_stream", "http_generate", "openai_chat", "trtllm_infer")
THROUGHPUT_TYPE = "THROUGHPUT"
TOKENS_NAME = "output_tok/s (value, not ms)"
REQUESTS_NAME = "requests/s (value, not ms)"


def _e2e_totals(environment) -> tuple[int, int, int]:
    """(requests, failures, output tokens) over the e2e rows of the (aggregated) stats."""
    requests = failures = tokens = 0
    for (_name, method), entry in environment.stats.entries.items():
        if method in E2E_TYPES:
            requests += entry.num_requests
            failures += entry.num_failures
            tokens += entry.total_content_length
    return requests, failures, tokens


def _fire_rate(environment, name: str, count: int, seconds: float) -> None:
    """One THROUGHPUT row: `count` finished over `seconds`, the rate standing where Locust puts a response time."""
    environment.events.request.fire(
        request_type=THROUGHPUT_TYPE,
        name=name,
        response_time=count / seconds,
        response_length=count,
        exception=None,
        context={},
    )


def _throughput_sampler(environment, interval: float) -> None:
    last = (time.time(), 0, 0)
    while True:
        gevent.sleep(interval)
        now = time.time()
        requests, _failures, tokens = _e2e_totals(environment)
        if requests < last[1] or tokens < last[2]:  # stats were reset
            last = (now, requests, tokens)
            continue
        dt = now - last[0]
        if dt > 0 and requests > 0:
            _fire_rate(environment, TOKENS_NAME, tokens - last[2], dt)
            _fire_rate(environment, REQUESTS_NAME, requests - last[1], dt)
        last = (now, requests, tokens)


_sampler: gevent.Greenlet | None = None


@events.test_start.add_listener
def _start_sampler(environment, **_kw) -> None:
    global _sampler
    interval = environment.parsed_options.throughput_interval
    if interval > 0 and not isinstance(environment.runner, WorkerRunner) and _sampler is None:
        _sampler = gevent.spawn(_throughput_sampler, environment, interval)


@events.test_stop.add_listener
def _stop_sampler(environment, **_kw) -> None:
    global _sampler
    if _sampler is not None:
        _sampler.kill(block=False)
        _sampler = None


def summary_rows(environment) -> list[dict]:
    """Per user type and in total: requests, failures, output tokens, duration, requests/s, output tokens/s."""
    stats = environment.stats
    duration = max((stats.total.last_request_timestamp or stats.total.start_time) - stats.total.start_time, 1e-9)
    rows = []
    options = environment.parsed_options
    for kind in E2E_TYPES:
        model = options.trtllm_model if kind == "trtllm_infer" else options.model
        entry = stats.entries.get((model, kind))
        if entry is None or entry.num_requests == 0:
            continue
        ok = entry.num_requests - entry.num_failures
        rows.append(
            {
                "type": kind,
                "requests": entry.num_requests,
                "failures": entry.num_failures,
                "output_tokens": entry.total_content_length,
                "duration_s": round(duration, 3),
                "requests_per_s": round(ok / duration, 4),
                "output_tokens_per_s": round(entry.total_content_length / duration, 2),
            }
        )
    requests, failures, tokens = _e2e_totals(environment)
    rows.append(
        {
            "type": "total",
            "requests": requests,
            "failures": failures,
            "output_tokens": tokens,
            "duration_s": round(duration, 3),
            "requests_per_s": round((requests - failures) / duration, 4),
            "output_tokens_per_s": round(tokens / duration, 2),
        }
    )
    return rows


@events.quitting.add_listener
def _on_quitting(environment, **_kw) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return
    rows = summary_rows(environment)
    lines = [
        "",
        "LLM summary (successful requests; output tokens over the run's duration):",
        f"  {'type':<14}{'requests':>9}{'failures':>9}{'out tokens':>11}{'req/s':>9}{'out tok/s':>11}",
    ]
    for r in rows:
        lines.append(
            f"  {r['type']:<14}{r['requests']:>9}{r['failures']:>9}{r['output_tokens']:>11}"
            f"{r['requests_per_s']:>9.2f}{r['output_tokens_per_s']:>11.1f}"
        )
    print("\n".join(lines), flush=True)
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        # Locust rewrites the --csv stats once a second: let it catch up with the last requests (finished while
        # the users stopped) before it closes the files.
        gevent.sleep(locust_stats.CSV_STATS_INTERVAL_SEC + 0.2)
        path = Path(f"{prefix}_llm_summary.csv")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
