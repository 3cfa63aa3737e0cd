"""Engine metrics: kept in process (tests, benchmarks) and mirrored to Triton's metrics endpoint.

`EngineMetrics` is what the engine updates. `TritonMetricsSink` mirrors every update into
`pb_utils.MetricFamily` objects; it takes the `pb_utils` module as an argument so the engine never imports
Triton. Each Triton metric update is a blocking round trip to the server process (a gauge's holds the GIL
throughout), so the Triton model puts a `PeriodicPublisher` in between: updates are buffered and replayed
from the publisher's own thread every 100 ms.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]

COUNTERS = {
    "llm_prompt_tokens_total": "Prompt tokens received",
    "llm_generation_tokens_total": "Tokens generated",
    "llm_requests_finished_total": "Requests finished, by finish reason",
    "llm_requests_preempted_total": "Sequences preempted (blocks freed, recomputed later)",
    "llm_requests_rejected_total": "Requests refused: queue full or can never fit",
    "llm_prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache",
    "llm_prefix_cache_hits_total": "Prompt tokens served from the prefix cache",
    "llm_engine_steps_total": "Engine steps (forward passes) run",
    "llm_spec_decode_num_drafts_total": "Speculative drafts verified (one per sequence per step)",
    "llm_spec_decode_num_draft_tokens_total": "Draft tokens proposed and verified",
    "llm_spec_decode_num_accepted_tokens_total": "Draft tokens accepted",
    "llm_spec_decode_num_accepted_tokens_per_pos_total": "Draft tokens accepted, by position in the draft",
}
GAUGES = {
    "llm_requests_running": "Sequences in the running batch",
    "llm_requests_waiting": "Sequences waiting to be scheduled",
    "llm_kv_cache_blocks_used": "KV blocks held by sequences",
    "llm_kv_cache_blocks_free": "KV blocks on the free list (cached prefixes included)",
    "llm_kv_cache_blocks_cached_free": "Free KV blocks still holding a cached prefix",
    "llm_kv_cache_blocks_total": "KV blocks in the pool",
    "llm_kv_cache_usage_ratio": "Fraction of the KV pool held by sequences (blocks used / total, 0 to 1)",
    "llm_engine_alive": "1 while the engine thread runs; 0 once it has died (requests are refused)",
}
HISTOGRAMS = {
    "llm_time_to_first_token_seconds": ("Time from arrival to the first generated token", _LATENCY_BUCKETS),
    "llm_inter_token_latency_seconds": ("Time between consecutive tokens of a sequence", _LATENCY_BUCKETS),
    "llm_e2e_request_latency_seconds": ("Time from arrival to the final response", _LATENCY_BUCKETS),
    "llm_step_num_sequences": ("Sequences in one engine step's batch", _BATCH_BUCKETS),
    "llm_step_num_tokens": ("Tokens in one engine step's batch", [1, 8, 32, 64, 128, 256, 512, 1024, 2048, 8192]),
}


# Not exported before their first update: the finish-reason counter exists only with labels, and an engine
# gauge at 0 would tell the launcher's supervisor that an engine still loading had died.
_NOT_AT_ZERO = {"llm_requests_finished_total", "llm_engine_alive"}


def _key(labels: dict | None) -> tuple:
    return tuple(sorted((labels or {}).items()))


class EngineMetrics:
    """Counter increments reach the sinks summed, at `flush()` (the engine flushes once per step): each
    update of a Triton metric is a round trip to the server process, too slow to make once per token."""

    def __init__(self):
        self.counters: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.gauges: dict[str, float] = {}
        self.histograms: dict[str, list[float]] = defaultdict(list)
        self.sinks: list = []
        self._unflushed: dict[tuple[str, tuple], float] = defaultdict(float)
        self._lock = threading.Lock()  # counters are also bumped from request threads

    def add_sink(self, sink) -> None:
        """Mirror every later update into `sink`, starting from the current gauge values."""
        self.sinks.append(sink)
        for name, value in self.gauges.items():
            sink.set(name, value)

    def inc(self, name: str, value: float = 1.0, labels: dict | None = None) -> None:
        assert name in COUNTERS, name
        if value:
            with self._lock:
                self.counters[name][_key(labels)] += value
                self._unflushed[(name, _key(labels))] += value

    def flush(self) -> None:
        """Send the counter increments made since the last flush to the sinks."""
        with self._lock:
            pending, self._unflushed = self._unflushed, defaultdict(float)
        for (name, labels), value in pending.items():
            for sink in self.sinks:
                sink.inc(name, value, dict(labels) or None)

    def set(self, name: str, value: float) -> None:
        assert name in GAUGES, name
        if self.gauges.get(name) != value:
            self.gauges[name] = value
            for sink in self.sinks:
                sink.set(name, value)

    def observe(self, name: str, value: float) -> None:
        assert name in HISTOGRAMS, name
        self.histograms[name].append(value)
        if len(self.histograms[name]) > 100_000:  # keep memory bounded in long runs
            del self.histograms[name][:50_000]
        for sink in self.sinks:
            sink.observe(name, value)

    def total(self, name: str) -> float:
        return sum(self.counters[name].values())


class TritonMetricsSink:
    """Mirrors EngineMetrics into Triton metric families labelled with model and version."""

    def __init__(self, pb_utils, labels: dict[str, str]):
        self._pb = pb_utils
        self._labels = labels
        # The families must outlive their metrics: keep references for the sink's whole life.
        self._families = {}
        for name, help_text in COUNTERS.items():
            self._families[name] = pb_utils.MetricFamily(name, help_text, pb_utils.MetricFamily.COUNTER)
        for name, help_text in GAUGES.items():
            self._families[name] = pb_utils.MetricFamily(name, help_text, pb_utils.MetricFamily.GAUGE)
        for name, (help_text, _) in HISTOGRAMS.items():
            self._families[name] = pb_utils.MetricFamily(name, help_text, pb_utils.MetricFamily.HISTOGRAM)
        self._metrics: dict[tuple, object] = {}
        for name in (*COUNTERS, *GAUGES, *HISTOGRAMS):  # exported from the start, at zero
            if name not in _NOT_AT_ZERO and not name.endswith("_per_pos_total"):
                self._metric(name, None)

    def _metric(self, name: str, labels: dict | None):
        key = (name, _key(labels))
        metric = self._metrics.get(key)
        if metric is None:
            all_labels = {**self._labels, **{k: str(v) for k, v in (labels or {}).items()}}
            if name in HISTOGRAMS:
                metric = self._families[name].Metric(labels=all_labels, buckets=HISTOGRAMS[name][1])
            else:
                metric = self._families[name].Metric(labels=all_labels)
            self._metrics[key] = metric
        return metric

    def inc(self, name: str, value: float, labels: dict | None) -> None:
        self._metric(name, labels).increment(value)

    def set(self, name: str, value: float) -> None:
        self._metric(name, None).set(value)

    def observe(self, name: str, value: float) -> None:
        self._metric(name, None).observe(value)

    def close(self) -> None:
        """Delete this model's metrics from the server, metrics before their families (each deletion is a round
        trip): Triton keeps a Python model's metrics after its stub has exited, so an unloaded model would
        leave its last values on the metrics page."""
        self._metrics.clear()
        self._families.clear()


class PeriodicPublisher:
    """A sink that buffers updates (summing counter increments, keeping each gauge's last value) and replays
    them into `sink` from a thread of its own every `interval_s`, once `start()` has been called.

    The thread is not started by the constructor: a Triton model publishes from its own thread during
    `initialize` and starts the publisher only once serving (docs/engine.md, "Start and stop"), so that no
    two threads of the stub make metric round trips while `initialize` runs."""

    def __init__(self, sink, interval_s: float = 0.1):
        self.sink = sink
        self.interval_s = interval_s
        self._counters: dict[tuple[str, tuple], float] = defaultdict(float)
        self._gauges: dict[str, float] = {}
        self._observations: list[tuple[str, float]] = []
        self._lock = threading.Lock()
        self._replaying = threading.Lock()  # publish() is also called from other threads (close, flush)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llm-metrics", daemon=True)

    @property
    def running(self) -> bool:
        """Whether the publishing thread is running."""
        return self._thread.is_alive()

    def start(self) -> None:
        """Start publishing every `interval_s` (idempotent; never after `close()`)."""
        with self._lock:
            if self._thread.ident is None and not self._stop.is_set():
                self._thread.start()

    def inc(self, name: str, value: float, labels: dict | None) -> None:
        with self._lock:
            self._counters[(name, _key(labels))] += value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name] = value

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._observations.append((name, value))

    def publish(self) -> None:
        """Replay everything buffered so far into the sink (the publisher's thread does this periodically)."""
        with self._lock:
            counters, self._counters = self._counters, defaultdict(float)
            gauges, self._gauges = self._gauges, {}
            observations, self._observations = self._observations, []
        with self._replaying:
            for (name, labels), value in counters.items():
                self.sink.inc(name, value, dict(labels) or None)
            for name, value in gauges.items():
                self.sink.set(name, value)
            for name, value in observations:
                self.sink.observe(name, value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish()
            except Exception:  # a metric that fails must not stop the others, nor the engine
                log.exception("publishing metrics failed")

    def close(self) -> None:
        """Stop the thread (if it was started), then publish what is left."""
        with self._lock:
            self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=10)
        self.publish()
