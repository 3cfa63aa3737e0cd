"""What a soak run records (loadtest/soak.py): every Locust request event, and every SAMPLE_INTERVAL_S the memory
(RSS) of the server's processes and its KV blocks used, requests running and waiting. Imported after gevent's monkey
patching (soak.py patches first)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

from testkit import prometheus

SAMPLE_INTERVAL_S = 5.0
KV_METRIC = "llm_kv_cache_blocks_used"


@dataclass
class Recorder:
    """Every request event, and the server samples taken every SAMPLE_INTERVAL_S."""

    started: float = field(default_factory=time.monotonic)
    requests: list[dict] = field(default_factory=list)  # t, type, name, ms, failed, error
    samples: list[dict] = field(default_factory=list)  # t, rss_mb, kv_blocks_used, running, waiting

    def on_request(self, request_type, name, response_time, response_length, exception=None, **_kw):
        self.requests.append(
            {
                "t": time.monotonic() - self.started,
                "type": request_type,
                "name": name,
                "ms": response_time,
                "tokens": response_length,
                "error": None if exception is None else str(exception)[:300],
            }
        )

    def sample(self, processes: list[psutil.Process], metrics_url: str, model: str) -> None:
        values = scrape(metrics_url, model)
        self.samples.append({"t": time.monotonic() - self.started, "rss_mb": rss_mb(processes), **values})


def rss_mb(processes: list[psutil.Process]) -> float:
    """Resident memory of the processes and their children (tritonserver's Python stubs), MiB."""
    total = 0
    for p in [q for proc in processes for q in (proc, *proc.children(recursive=True))]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def scrape(metrics_url: str, model: str) -> dict:
    """`model`'s KV blocks used, requests running and waiting (-1.0 where a series is missing)."""
    metrics = prometheus.scrape(metrics_url)
    return {
        key: prometheus.value(metrics, metric, -1.0, model=model, version="1")
        for key, metric in (
            ("kv_blocks_used", KV_METRIC),
            ("running", "llm_requests_running"),
            ("waiting", "llm_requests_waiting"),
        )
    }
