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
import time
from collections import defaultdict

from backend.core.named_thread import NamedThread

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
_TOKEN_COUNT_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]

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
    "llm_requests_in_flight": "Sequences running or waiting",
    "llm_max_num_seqs": "Sequences one step may run (max_num_seqs)",
    "llm_step_prefill_sequences": "Sequences prefilling a prompt chunk in the last step",
    "llm_step_prefill_tokens": "Prompt tokens prefilled in the last step",
    "llm_step_decode_sequences": "Sequences generating (not prefilling) in the last step",
    "llm_step_timestamp_seconds": "When the last step ended (Unix time, seconds)",
    "llm_kv_cache_block_tokens": "Tokens per KV block",
    "llm_engine_alive": "1 while the engine thread runs; 0 once it has died (requests are refused)",
}
# Gauges by one label (name -> help, label): a series per label value, set by `EngineMetrics.set_counts`.
LABELLED_GAUGES = {
    "llm_requests_running_by_priority": ("Sequences in the running batch, by request priority", "priority"),
    "llm_requests_waiting_by_priority": ("Sequences waiting to be scheduled, by request priority", "priority"),
}
# Gauges whose labels carry the information, vLLM's way: each label set is a series whose value is when it was
# last current (Unix time); readers (the inference gateway) take the newest.
INFOS = {
    "llm_lora_requests_info": "LoRA adapters of running and waiting requests (comma-separated labels) and max_lora",
}
HISTOGRAMS = {
    "llm_time_to_first_token_seconds": ("Time from arrival to the first generated token", _LATENCY_BUCKETS),
    "llm_inter_token_latency_seconds": ("Time between consecutive tokens of a sequence", _LATENCY_BUCKETS),
    "llm_e2e_request_latency_seconds": ("Time from arrival to the final response", _LATENCY_BUCKETS),
    "llm_step_num_sequences": ("Sequences in one engine step's batch", _BATCH_BUCKETS),
    "llm_step_num_tokens": ("Tokens in one engine step's batch", [1, 8, 32, 64, 128, 256, 512, 1024, 2048, 8192]),
    "llm_request_prompt_tokens": ("Prompt tokens of each finished request", _TOKEN_COUNT_BUCKETS),
    "llm_request_generation_tokens": ("Tokens generated for each finished request", _TOKEN_COUNT_BUCKETS),
    "llm_request_params_n": ("Samples (n) of each finished request", [1, 2, 5, 10, 20]),
}

# The same numbers under the names other servers' dashboards, alerts and autoscalers read (`metric_names`):
# our name -> (their name, labels added, our label -> theirs); their kind is ours; a histogram's buckets are ours
# unless given. vLLM's (v1 engine, as vllm_backend exports them) and TensorRT-LLM's inflight-batcher families.
Alias = tuple[str, dict, dict]
ALIASES: dict[str, dict[str, list[Alias]]] = {
    "vllm": {
        "llm_requests_running": [("vllm:num_requests_running", {}, {})],
        "llm_requests_waiting": [("vllm:num_requests_waiting", {}, {})],
        "llm_kv_cache_usage_ratio": [("vllm:kv_cache_usage_perc", {}, {}), ("vllm:gpu_cache_usage_perc", {}, {})],
        "llm_prompt_tokens_total": [("vllm:prompt_tokens_total", {}, {})],
        "llm_generation_tokens_total": [("vllm:generation_tokens_total", {}, {})],
        "llm_requests_finished_total": [("vllm:request_success_total", {}, {"finish_reason": "finished_reason"})],
        "llm_requests_preempted_total": [("vllm:num_preemptions_total", {}, {})],
        "llm_prefix_cache_queries_total": [("vllm:prefix_cache_queries_total", {}, {})],
        "llm_prefix_cache_hits_total": [("vllm:prefix_cache_hits_total", {}, {})],
        "llm_spec_decode_num_drafts_total": [("vllm:spec_decode_num_drafts_total", {}, {})],
        "llm_spec_decode_num_draft_tokens_total": [("vllm:spec_decode_num_draft_tokens_total", {}, {})],
        "llm_spec_decode_num_accepted_tokens_total": [("vllm:spec_decode_num_accepted_tokens_total", {}, {})],
        "llm_time_to_first_token_seconds": [("vllm:time_to_first_token_seconds", {}, {})],
        "llm_inter_token_latency_seconds": [
            ("vllm:time_per_output_token_seconds", {}, {}),
            ("vllm:inter_token_latency_seconds", {}, {}),
        ],
        "llm_e2e_request_latency_seconds": [("vllm:e2e_request_latency_seconds", {}, {})],
        "llm_request_prompt_tokens": [("vllm:request_prompt_tokens", {}, {})],
        "llm_request_generation_tokens": [("vllm:request_generation_tokens", {}, {})],
        "llm_request_params_n": [("vllm:request_params_n", {}, {})],
        "llm_lora_requests_info": [("vllm:lora_requests_info", {}, {})],
    },
    "tensorrt_llm": {
        "llm_requests_in_flight": [("nv_trt_llm_request_metrics", {"request_type": "active"}, {})],
        "llm_max_num_seqs": [("nv_trt_llm_request_metrics", {"request_type": "max"}, {})],
        "llm_requests_running": [("nv_trt_llm_request_metrics", {"request_type": "scheduled"}, {})],
        "llm_step_prefill_sequences": [("nv_trt_llm_request_metrics", {"request_type": "context"}, {})],
        "llm_requests_waiting": [("nv_trt_llm_request_metrics", {"request_type": "waiting"}, {})],
        "llm_kv_cache_blocks_total": [("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "max"}, {})],
        "llm_kv_cache_blocks_free": [("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "free"}, {})],
        "llm_kv_cache_blocks_used": [("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "used"}, {})],
        "llm_kv_cache_block_tokens": [("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "tokens_per"}, {})],
        "llm_kv_cache_usage_ratio": [("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "fraction"}, {})],
        "llm_request_prompt_tokens": [("nv_llm_input_token_len", {"response_metric_type": "total_input_tokens"}, {})],
        "llm_request_generation_tokens": [
            ("nv_llm_output_token_len", {"response_metric_type": "total_output_tokens"}, {})
        ],
        "llm_step_prefill_tokens": [
            ("nv_trt_llm_inflight_batcher_metrics", {"inflight_batcher_specific_metric": "total_context_tokens"}, {})
        ],
        "llm_step_decode_sequences": [
            ("nv_trt_llm_inflight_batcher_metrics", {"inflight_batcher_specific_metric": "generation_requests"}, {})
        ],
        "llm_engine_steps_total": [("nv_trt_llm_general_metrics", {"general_type": "iteration_counter"}, {})],
        "llm_step_timestamp_seconds": [("nv_trt_llm_general_metrics", {"general_type": "timestamp"}, {})],
    },
}
ALIAS_BUCKETS = {
    "nv_llm_input_token_len": [10, 50, 100, 500, 1000],
    "nv_llm_output_token_len": [10, 50, 100, 500, 1000],
}
ALIAS_HELP = {
    "nv_trt_llm_request_metrics": "TRT LLM request metrics",
    "nv_trt_llm_kv_cache_block_metrics": "TRT LLM KV cache block metrics",
    "nv_llm_input_token_len": "TRT LLM response metrics",
    "nv_llm_output_token_len": "TRT LLM response metrics",
    "nv_trt_llm_inflight_batcher_metrics": "TRT LLM inflight_batcher-specific metrics",
    "nv_trt_llm_general_metrics": "General TRT LLM metrics",
}
ALIAS_GAUGES = {"nv_trt_llm_general_metrics"}  # a gauge there, though our iteration count is a counter
METRIC_NAMES = ("vllm", "tensorrt_llm")  # what `metric_names` may list besides ours, which are always exported


# Not exported before their first update: the finish-reason counter and the gauges by priority exist only with
# labels, and an engine gauge at 0 would tell the launcher's supervisor that an engine still loading had died.
_NOT_AT_ZERO = {"llm_requests_finished_total", "llm_engine_alive", *LABELLED_GAUGES}


def _key(labels: dict | None) -> tuple:
    return tuple(sorted((labels or {}).items()))


class EngineMetrics:
    """Counter increments reach the sinks summed, at `flush()` (the engine flushes once per step): each
    update of a Triton metric is a round trip to the server process, too slow to make once per token."""

    def __init__(self):
        self.counters: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.gauges: dict[str, float] = {}
        self.histograms: dict[str, list[float]] = defaultdict(list)
        self.infos: dict[str, dict[str, str]] = {}
        self.labelled: dict[str, dict[str, float]] = {}  # LABELLED_GAUGES: name -> label value -> value
        self.sinks: list = []
        self._unflushed: dict[tuple[str, tuple], float] = defaultdict(float)
        self._lock = threading.Lock()  # counters are also bumped from request threads

    def add_sink(self, sink) -> None:
        """Mirror every later update into `sink`, starting from the current gauge values."""
        self.sinks.append(sink)
        for name, value in self.gauges.items():
            sink.set(name, value)
        for name, labels in self.infos.items():
            sink.info(name, labels, time.time())
        for name, values in self.labelled.items():
            for label_value, value in values.items():
                sink.set_labelled(name, {LABELLED_GAUGES[name][1]: label_value}, value)

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

    def set_counts(self, name: str, counts: dict) -> None:
        """A gauge of LABELLED_GAUGES: `counts` maps label values to values; a label value set before and absent
        from `counts` now reads 0 (its series stays)."""
        assert name in LABELLED_GAUGES, name
        label = LABELLED_GAUGES[name][1]
        current = self.labelled.setdefault(name, {})
        counts = {str(key): value for key, value in counts.items()}
        for label_value in sorted({*current, *counts}):
            value = counts.get(label_value, 0)
            if current.get(label_value) != value:
                current[label_value] = value
                for sink in self.sinks:
                    sink.set_labelled(name, {label: label_value}, value)

    def info(self, name: str, labels: dict[str, str]) -> None:
        """Make `labels` an info gauge's current label set (its series stamped with the time) where they changed."""
        assert name in INFOS, name
        if self.infos.get(name) != labels:
            self.infos[name] = dict(labels)
            now = time.time()
            for sink in self.sinks:
                sink.info(name, labels, now)

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
    """Mirrors EngineMetrics into Triton metric families labelled with model and version, under our names and
    those of the ALIASES dialects in `names`."""

    def __init__(self, pb_utils, labels: dict[str, str], names: tuple[str, ...] = METRIC_NAMES):
        self._pb = pb_utils
        self._labels = labels
        self._aliases = {
            ours: [alias for dialect in names for alias in ALIASES[dialect].get(ours, [])]
            for ours in (*COUNTERS, *GAUGES, *LABELLED_GAUGES, *INFOS, *HISTOGRAMS)
        }
        kinds = {
            **dict.fromkeys(COUNTERS, pb_utils.MetricFamily.COUNTER),
            **dict.fromkeys((*GAUGES, *LABELLED_GAUGES, *INFOS), pb_utils.MetricFamily.GAUGE),
            **dict.fromkeys(HISTOGRAMS, pb_utils.MetricFamily.HISTOGRAM),
        }
        helps = {
            **COUNTERS,
            **GAUGES,
            **INFOS,
            **{name: help_text for name, (help_text, _) in (*HISTOGRAMS.items(), *LABELLED_GAUGES.items())},
        }
        # The families must outlive their metrics: keep references for the sink's whole life.
        self._families = {}
        for ours, kind in kinds.items():
            for name in (ours, *(alias for alias, _, _ in self._aliases[ours])):
                if name not in self._families:
                    help_text = ALIAS_HELP.get(name, helps[ours])
                    family_kind = pb_utils.MetricFamily.GAUGE if name in ALIAS_GAUGES else kind
                    self._families[name] = pb_utils.MetricFamily(name, help_text, family_kind)
        self._metrics: dict[tuple, list] = {}
        for name in kinds:  # exported from the start, at zero
            if name not in _NOT_AT_ZERO and name not in INFOS and not name.endswith("_per_pos_total"):
                self._metric(name, None)

    def _metric(self, name: str, labels: dict | None) -> list:
        """Our metric `name` with `labels` and its aliases (created at first use)."""
        key = (name, _key(labels))
        metrics = self._metrics.get(key)
        if metrics is None:
            labels = {k: str(v) for k, v in (labels or {}).items()}
            targets = [(name, {}, {})] + self._aliases[name]
            metrics = []
            for family, added, renames in targets:
                all_labels = {**self._labels, **{renames.get(k, k): v for k, v in labels.items()}, **added}
                if name in HISTOGRAMS:
                    buckets = ALIAS_BUCKETS.get(family, HISTOGRAMS[name][1])
                    metrics.append(self._families[family].Metric(labels=all_labels, buckets=buckets))
                else:
                    metrics.append(self._families[family].Metric(labels=all_labels))
            self._metrics[key] = metrics
        return metrics

    def inc(self, name: str, value: float, labels: dict | None) -> None:
        for metric in self._metric(name, labels):
            metric.increment(value)

    def set(self, name: str, value: float) -> None:
        for metric in self._metric(name, None):
            metric.set(value)

    def observe(self, name: str, value: float) -> None:
        for metric in self._metric(name, None):
            metric.observe(value)

    def set_labelled(self, name: str, labels: dict[str, str], value: float) -> None:
        for metric in self._metric(name, labels):
            metric.set(value)

    def info(self, name: str, labels: dict[str, str], value: float) -> None:
        for metric in self._metric(name, labels):
            metric.set(value)

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
        self._infos: dict[str, tuple[dict[str, str], float]] = {}
        self._labelled: dict[tuple[str, tuple], float] = {}
        self._observations: list[tuple[str, float]] = []
        self._lock = threading.Lock()
        self._replaying = threading.Lock()  # publish() is also called from other threads (close, flush)
        self._stop = threading.Event()
        self._thread = NamedThread(self._run, "llm-metrics", service=True)

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

    def info(self, name: str, labels: dict[str, str], value: float) -> None:
        with self._lock:
            self._infos[name] = (labels, value)

    def set_labelled(self, name: str, labels: dict[str, str], value: float) -> None:
        with self._lock:
            self._labelled[(name, _key(labels))] = value

    def publish(self) -> None:
        """Replay everything buffered so far into the sink (the publisher's thread does this periodically)."""
        with self._lock:
            counters, self._counters = self._counters, defaultdict(float)
            gauges, self._gauges = self._gauges, {}
            infos, self._infos = self._infos, {}
            labelled, self._labelled = self._labelled, {}
            observations, self._observations = self._observations, []
        with self._replaying:
            for (name, labels), value in counters.items():
                self.sink.inc(name, value, dict(labels) or None)
            for name, value in gauges.items():
                self.sink.set(name, value)
            for name, (labels, value) in infos.items():
                self.sink.info(name, labels, value)
            for (name, labels), value in labelled.items():
                self.sink.set_labelled(name, dict(labels), value)
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
