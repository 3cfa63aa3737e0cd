"""backend/core/metrics.py: in-process engine metrics and their mirror into Triton metric families (faked here)."""

from __future__ import annotations

import pytest

from backend.core.metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    INFOS,
    LABELLED_GAUGES,
    EngineMetrics,
    PeriodicPublisher,
    TritonMetricsSink,
)


class RecordingSink:
    def __init__(self):
        self.calls = []

    def inc(self, name, value, labels):
        self.calls.append(("inc", name, value, labels))

    def set(self, name, value):
        self.calls.append(("set", name, value))

    def observe(self, name, value):
        self.calls.append(("observe", name, value))


def test_counters_with_and_without_labels():
    m = EngineMetrics()
    m.inc("llm_prompt_tokens_total", 5)
    m.inc("llm_prompt_tokens_total")
    m.inc("llm_requests_finished_total", labels={"finish_reason": "stop"})
    m.inc("llm_requests_finished_total", 2, labels={"finish_reason": "length"})
    m.inc("llm_requests_finished_total", labels={"finish_reason": "stop"})
    assert m.total("llm_prompt_tokens_total") == 6
    assert m.total("llm_requests_finished_total") == 4
    assert m.counters["llm_requests_finished_total"][(("finish_reason", "stop"),)] == 2
    assert m.counters["llm_requests_finished_total"][(("finish_reason", "length"),)] == 2
    assert m.total("llm_engine_steps_total") == 0


def test_unknown_names_are_refused():
    m = EngineMetrics()
    with pytest.raises(AssertionError):
        m.inc("llm_no_such_counter")
    with pytest.raises(AssertionError):
        m.set("llm_prompt_tokens_total", 1)  # a counter is not a gauge
    with pytest.raises(AssertionError):
        m.observe("llm_requests_running", 1.0)


def test_sinks_mirror_updates_and_skip_no_ops():
    m = EngineMetrics()
    m.set("llm_kv_cache_blocks_total", 100)
    sink = RecordingSink()
    m.add_sink(sink)
    assert sink.calls == [("set", "llm_kv_cache_blocks_total", 100)]  # current gauges replayed
    m.inc("llm_generation_tokens_total", 0)  # nothing to add: not forwarded
    m.set("llm_kv_cache_blocks_total", 100)  # unchanged: not forwarded
    m.set("llm_requests_running", 3)
    m.inc("llm_generation_tokens_total", 2)
    m.observe("llm_step_num_tokens", 17)
    m.inc("llm_generation_tokens_total", 3)
    assert ("inc", "llm_generation_tokens_total", 2, None) not in sink.calls  # counters wait for flush()
    m.flush()
    m.flush()  # nothing new: nothing sent
    assert sink.calls[1:] == [
        ("set", "llm_requests_running", 3),
        ("observe", "llm_step_num_tokens", 17),
        ("inc", "llm_generation_tokens_total", 5, None),  # summed
    ]
    assert m.gauges == {"llm_kv_cache_blocks_total": 100, "llm_requests_running": 3}
    assert m.histograms["llm_step_num_tokens"] == [17]


def test_periodic_publisher_replays_buffered_updates_from_its_own_thread():
    """The Triton model's sink: updates are buffered (counters summed, each gauge's last value kept) and
    replayed into the real sink from the publisher's thread, never from the engine's."""
    import threading
    import time

    threads = set()

    class ThreadRecordingSink(RecordingSink):
        def __getattribute__(self, name):
            if name in ("inc", "set", "observe"):
                threads.add(threading.current_thread().name)
            return super().__getattribute__(name)

    sink = ThreadRecordingSink()
    publisher = PeriodicPublisher(sink, interval_s=0.02)
    assert not publisher.running  # started by its owner, once serving (the Triton model: at the first execute)
    publisher.start()
    publisher.start()  # idempotent
    assert publisher.running
    m = EngineMetrics()
    m.add_sink(publisher)
    m.set("llm_requests_running", 1)
    m.set("llm_requests_running", 4)
    m.inc("llm_generation_tokens_total", 2)
    m.flush()
    m.inc("llm_generation_tokens_total", 3)
    m.flush()
    m.observe("llm_step_num_tokens", 9)
    assert sink.calls == []  # nothing on the caller's thread
    deadline = time.monotonic() + 5
    while len(sink.calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    publisher.close()
    assert sorted(sink.calls, key=str) == sorted(
        [
            ("inc", "llm_generation_tokens_total", 5, None),
            ("set", "llm_requests_running", 4),
            ("observe", "llm_step_num_tokens", 9),
        ],
        key=str,
    )
    assert threads == {"llm-metrics"}


def test_histograms_stay_bounded():
    m = EngineMetrics()
    for i in range(100_001):
        m.observe("llm_step_num_sequences", i)
    values = m.histograms["llm_step_num_sequences"]
    assert len(values) == 50_001
    assert values[0] == 50_000 and values[-1] == 100_000  # the newest are kept


def test_metric_names_are_prometheus_style():
    for name in (*COUNTERS, *GAUGES, *HISTOGRAMS):
        assert name.startswith("llm_") and name == name.lower()
    assert all(name.endswith("_total") for name in COUNTERS)
    for _, buckets in HISTOGRAMS.values():
        assert buckets == sorted(buckets) and len(set(buckets)) == len(buckets)


# ----------------------------------------------------------------------------------- Triton mirror


class FakeMetric:
    def __init__(self, labels, buckets=None):
        self.labels, self.buckets = labels, buckets
        self.value = 0.0
        self.observed = []

    def increment(self, value):
        self.value += value

    def set(self, value):
        self.value = value

    def observe(self, value):
        self.observed.append(value)


class FakePbUtils:
    """The bits of triton_python_backend_utils the sink uses."""

    def __init__(self):
        self.families = {}
        pb = self

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind):
                self.name, self.description, self.kind = name, description, kind
                self.metrics = []
                pb.families[name] = self

            def Metric(self, labels=None, buckets=None):
                metric = FakeMetric(labels, buckets)
                self.metrics.append(metric)
                return metric

        self.MetricFamily = MetricFamily


def test_triton_sink_families_and_initial_metrics():
    pb = FakePbUtils()
    TritonMetricsSink(pb, {"model": "llm", "version": "1"}, names=())
    assert set(pb.families) == set(COUNTERS) | set(GAUGES) | set(LABELLED_GAUGES) | set(INFOS) | set(HISTOGRAMS)
    for name in COUNTERS:
        assert pb.families[name].kind == "counter" and pb.families[name].description == COUNTERS[name]
    for name in (*GAUGES, *LABELLED_GAUGES):
        assert pb.families[name].kind == "gauge"
    for name, (_, buckets) in HISTOGRAMS.items():
        assert pb.families[name].kind == "histogram"
        assert pb.families[name].metrics[0].buckets == buckets
    # exported at zero from the start, except the ones that only exist with labels and the engine's liveness
    # (0 means dead to the supervisor)
    for name, family in pb.families.items():
        late = name.endswith("_per_pos_total") or name in (
            "llm_requests_finished_total",
            "llm_engine_alive",
            *INFOS,
            *LABELLED_GAUGES,
        )
        assert len(family.metrics) == (0 if late else 1), name
        for metric in family.metrics:
            assert metric.labels == {"model": "llm", "version": "1"} and metric.value == 0


def test_the_same_numbers_under_vllms_and_tensorrt_llms_names():
    """Every update of one of our metrics reaches its aliases: vLLM's names (a label renamed where vLLM names it
    otherwise) and TensorRT-LLM's families (one label telling the series apart, its own histogram buckets)."""
    pb = FakePbUtils()
    sink = TritonMetricsSink(pb, {"model": "llm", "version": "1"})
    sink.inc("llm_generation_tokens_total", 5, None)
    sink.inc("llm_requests_finished_total", 1, {"finish_reason": "stop"})
    sink.set("llm_kv_cache_blocks_used", 7)
    sink.set("llm_requests_waiting", 3)
    sink.observe("llm_request_prompt_tokens", 42)
    assert pb.families["vllm:generation_tokens_total"].kind == "counter"
    assert pb.families["vllm:generation_tokens_total"].metrics[0].value == 5
    (success,) = pb.families["vllm:request_success_total"].metrics
    assert success.labels == {"model": "llm", "version": "1", "finished_reason": "stop"} and success.value == 1
    used = [
        m
        for m in pb.families["nv_trt_llm_kv_cache_block_metrics"].metrics
        if m.labels.get("kv_cache_block_type") == "used"
    ]
    assert [m.value for m in used] == [7]
    waiting = {m.labels["request_type"]: m.value for m in pb.families["nv_trt_llm_request_metrics"].metrics}
    assert waiting["waiting"] == 3 and set(waiting) == {"active", "max", "scheduled", "context", "waiting"}
    assert pb.families["vllm:num_requests_waiting"].metrics[0].value == 3
    (trt_input,) = pb.families["nv_llm_input_token_len"].metrics
    assert trt_input.buckets == [10, 50, 100, 500, 1000] and trt_input.observed == [42]
    assert pb.families["vllm:request_prompt_tokens"].metrics[0].observed == [42]
    assert pb.families["vllm:request_prompt_tokens"].metrics[0].buckets == HISTOGRAMS["llm_request_prompt_tokens"][1]


def test_tensorrt_llms_inflight_batcher_and_general_families():
    """TensorRT-LLM's per-iteration gauges: the last step's context tokens and generation requests, and its
    iteration counter, a gauge there though our step count is a counter."""
    pb = FakePbUtils()
    sink = TritonMetricsSink(pb, {"model": "llm", "version": "1"})
    sink.set("llm_step_prefill_tokens", 17)
    sink.set("llm_step_decode_sequences", 4)
    sink.inc("llm_engine_steps_total", 3, None)
    sink.set("llm_step_timestamp_seconds", 1_700_000_000)
    batcher = pb.families["nv_trt_llm_inflight_batcher_metrics"]
    values = {m.labels["inflight_batcher_specific_metric"]: m.value for m in batcher.metrics}
    assert batcher.kind == "gauge" and values == {"total_context_tokens": 17, "generation_requests": 4}
    general = pb.families["nv_trt_llm_general_metrics"]
    values = {m.labels["general_type"]: m.value for m in general.metrics}
    assert general.kind == "gauge" and values == {"iteration_counter": 3, "timestamp": 1_700_000_000}
    assert pb.families["llm_engine_steps_total"].kind == "counter"


def test_metric_names_choose_the_dialects():
    pb = FakePbUtils()
    TritonMetricsSink(pb, {"model": "llm", "version": "1"}, names=("vllm",))
    assert any(name.startswith("vllm:") for name in pb.families)
    assert not any(name.startswith("nv_") for name in pb.families)


def test_triton_sink_mirrors_engine_metrics():
    pb = FakePbUtils()
    m = EngineMetrics()
    m.set("llm_kv_cache_blocks_total", 64)
    m.set("llm_engine_alive", 1)
    m.add_sink(TritonMetricsSink(pb, {"model": "llm", "version": "1"}))
    assert pb.families["llm_kv_cache_blocks_total"].metrics[0].value == 64
    assert [metric.value for metric in pb.families["llm_engine_alive"].metrics] == [1]
    m.inc("llm_prompt_tokens_total", 10)
    m.inc("llm_prompt_tokens_total", 5)
    m.inc("llm_requests_finished_total", labels={"finish_reason": "stop"})
    m.inc("llm_requests_finished_total", labels={"finish_reason": "stop"})
    m.inc("llm_spec_decode_num_accepted_tokens_per_pos_total", labels={"position": 2})
    m.flush()
    m.set("llm_requests_running", 4)
    m.observe("llm_time_to_first_token_seconds", 0.25)
    assert pb.families["llm_prompt_tokens_total"].metrics[0].value == 15
    finished = pb.families["llm_requests_finished_total"].metrics
    assert len(finished) == 1 and finished[0].value == 2
    assert finished[0].labels == {"model": "llm", "version": "1", "finish_reason": "stop"}
    per_pos = pb.families["llm_spec_decode_num_accepted_tokens_per_pos_total"].metrics
    assert per_pos[0].labels["position"] == "2"  # label values are strings
    assert pb.families["llm_requests_running"].metrics[0].value == 4
    assert pb.families["llm_time_to_first_token_seconds"].metrics[0].observed == [0.25]


def test_an_info_gauge_stamps_its_current_label_set():
    """vllm:lora_requests_info as vLLM exports it (labels running_lora_adapters, waiting_lora_adapters, max_lora;
    the value a Unix time): each label set is a series holding when it was last current; the newest is what the
    gateway's LoRA-affinity routing reads."""
    import time

    pb = FakePbUtils()
    m = EngineMetrics()
    sink = TritonMetricsSink(pb, {"model": "llm", "version": "1"})
    m.add_sink(sink)
    idle = {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "4"}
    busy = {**idle, "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    m.info("llm_lora_requests_info", idle)
    m.info("llm_lora_requests_info", dict(idle))  # unchanged: not stamped again
    m.info("llm_lora_requests_info", busy)
    (ours_idle, vllm_idle), (ours_busy, vllm_busy) = (
        sink._metrics[("llm_lora_requests_info", tuple(sorted(labels.items())))] for labels in (idle, busy)
    )
    assert vllm_busy.labels == {"model": "llm", "version": "1", **busy}
    assert "vllm:lora_requests_info" in pb.families and abs(vllm_busy.value - time.time()) < 60
    assert vllm_busy.value >= vllm_idle.value and ours_busy.value == vllm_busy.value
    late = RecordingSink()
    late.info = lambda name, labels, value: late.calls.append(("info", name, labels))
    m.add_sink(late)  # a sink added later starts from the current labels
    assert late.calls == [("info", "llm_lora_requests_info", busy)]


def test_a_gauge_by_priority_keeps_a_series_per_value_and_zeroes_the_ones_gone():
    """llm_requests_waiting_by_priority{priority}: a series per priority counted, through the publisher to Triton;
    a priority no longer present reads 0, and a sink added later starts from the current series."""
    pb = FakePbUtils()
    m = EngineMetrics()
    publisher = PeriodicPublisher(TritonMetricsSink(pb, {"model": "llm", "version": "1"}))
    m.add_sink(publisher)
    name = "llm_requests_waiting_by_priority"
    m.set_counts(name, {0: 3, -5: 1})
    m.set_counts(name, {0: 3, 2: 1})  # -5 gone, 2 new, 0 unchanged (not sent again)
    publisher.publish()
    series = {metric.labels["priority"]: metric.value for metric in pb.families[name].metrics}
    assert series == {"0": 3, "-5": 0, "2": 1}
    assert all(metric.labels["model"] == "llm" for metric in pb.families[name].metrics)
    assert m.labelled[name] == {"0": 3, "-5": 0, "2": 1}
    late = RecordingSink()
    late.set_labelled = lambda name, labels, value: late.calls.append((name, labels, value))
    m.add_sink(late)
    assert sorted(late.calls, key=str) == sorted(
        [(name, {"priority": p}, v) for p, v in (("0", 3), ("-5", 0), ("2", 1))], key=str
    )
    with pytest.raises(AssertionError):
        m.set_counts("llm_requests_waiting", {0: 1})  # not a gauge by label
