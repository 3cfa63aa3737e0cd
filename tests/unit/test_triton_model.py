"""model_repository/llm/1/model.py, the Triton glue, with a fake `triton_python_backend_utils` that records every
round trip a real stub would make to the server (metric updates, responses, unloads) and the thread it came from.

Pinned here: while `initialize` runs, every round trip is made by the thread that called it, and no thread of the
model talks to the server before the first `execute` (two stub threads making metric round trips while
`initialize` ran is what a start hang was traced to: docs/engine.md, "Start and stop"); a dead engine thread
answers the requests in flight with its error and makes the model unload itself (Triton finishes those
responses before it finalizes the model)."""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
import threading
import time
import types
import weakref

import numpy as np
import pytest

from launcher.paths import DEFAULT_MODEL_REPOSITORY

DEATH = "<<KILL THE ENGINE>>"


class FakePbUtils(types.ModuleType):
    """The parts of triton_python_backend_utils the model uses; each server round trip is logged with its thread."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    def __init__(self):
        super().__init__("triton_python_backend_utils")
        self.trips: list[tuple[str, str]] = []  # (what, thread name)
        self.lock = threading.Lock()
        pb = self

        def trip(what: str) -> None:
            with pb.lock:
                pb.trips.append((what, threading.current_thread().name))

        self.trip = trip

        class Metric:
            def __init__(self, labels, buckets=None):
                trip("metric new")

            def increment(self, value):
                trip("metric increment")

            def set(self, value):
                trip("metric set")

            def observe(self, value):
                trip("metric observe")

        class MetricFamily:
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name, description, kind):
                trip("family new")

            def Metric(self, labels, buckets=None):  # noqa: N802 - Triton's name
                return Metric(labels, buckets)

        class Logger:
            log_info = log_error = log_warn = staticmethod(lambda message: None)

        class Tensor:
            def __init__(self, name, array):
                self.name, self.array = name, array

            def as_numpy(self):
                return self.array

        class InferenceResponse:
            def __init__(self, output_tensors=(), error=None):
                self.output_tensors, self.error = list(output_tensors), error

        class TritonError:
            def __init__(self, message):
                self.message = message

        self.MetricFamily, self.Logger, self.Tensor = MetricFamily, Logger, Tensor
        self.InferenceResponse, self.TritonError = InferenceResponse, TritonError
        self.TritonModelException = RuntimeError
        self.unloaded: list[str] = []

    def using_decoupled_model_transaction_policy(self, config):
        return config["model_transaction_policy"]["decoupled"]

    def get_input_tensor_by_name(self, request, name):
        return request.tensors.get(name)

    def unload_model(self, name):
        self.trip("unload")
        self.unloaded.append(name)


class FakeSender:
    def __init__(self, pb: FakePbUtils):
        self.pb, self.responses, self.done = pb, [], threading.Event()
        self.cancelled = False  # the client is gone

    def send(self, response=None, flags=0):
        self.pb.trip("send final" if flags & self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL else "send")
        self.responses.append(response)
        if flags:
            self.done.set()

    def is_cancelled(self):
        self.pb.trip("is_cancelled")
        return self.cancelled


class FakeRequest:
    def __init__(
        self, pb: FakePbUtils, prompt: str, max_tokens: int, requested: tuple[str, ...] = (), parameters: str = "{}"
    ):
        self.requested = requested  # Triton passes every output when the client names none
        self._parameters = parameters
        self.tensors = {
            "text_input": pb.Tensor("text_input", np.array([prompt.encode()], dtype=object)),
            "max_tokens": pb.Tensor("max_tokens", np.array([max_tokens], dtype=np.int32)),
        }
        self.sender = FakeSender(pb)

    def get_response_sender(self):
        return self.sender

    def requested_output_names(self):
        return set(self.requested)

    def parameters(self):
        return self._parameters


@pytest.fixture
def triton_model(monkeypatch, tiny_llama):
    """(model class, fake pb_utils, initialize args) with the fake installed as triton_python_backend_utils."""
    pb = FakePbUtils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    path = DEFAULT_MODEL_REPOSITORY / "llm" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("llm_triton_model_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "exit_stub_process", lambda: pb.trip("exit"))  # not the test process
    parameters = {
        "model": tiny_llama,
        "dtype": "float32",
        "quantization": "none",
        "draft_model": "",
        "kv_cache_blocks": "32",
        "max_num_seqs": "2",
        "fault_injection": f"engine_death:{DEATH}",
    }
    config = {
        "model_transaction_policy": {"decoupled": True},
        "parameters": {k: {"string_value": v} for k, v in parameters.items()},
    }
    args = {
        "model_config": json.dumps(config),
        "model_repository": str(DEFAULT_MODEL_REPOSITORY / "llm"),
        "model_name": "llm_glue",
        "model_version": "1",
    }
    return module.TritonPythonModel, pb, args


def wait(event: threading.Event, what: str, timeout_s: float = 60.0) -> None:
    assert event.wait(timeout_s), f"timed out after {timeout_s:.0f} s waiting for {what}"


def test_initialize_makes_every_round_trip_on_its_own_thread_and_starts_no_publisher(triton_model):
    model_class, pb, args = triton_model
    model = model_class()
    model.initialize(args)
    try:
        caller = threading.current_thread().name
        during = list(pb.trips)
        assert during, "initialize published nothing: the gauges would be missing once READY"
        assert {thread for _, thread in during} == {caller}, f"round trips from other threads: {during}"
        assert not model.metrics_publisher.running, "the metrics thread runs before initialize has returned"
        request = FakeRequest(pb, "Hello there", 3)
        model.execute([request])
        wait(request.sender.done, "the request's final response")
        assert model.metrics_publisher.running, "execute did not start the metrics thread"
        # After execute: the publishing thread, and the sender, which publishes what is pending before a final
        # response (so the request is counted when its client could scrape).
        publishers = {"llm-metrics", "llm-output-sender"}
        deadline = time.monotonic() + 10
        while not any(t in publishers for _, t in pb.trips[len(during) :]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any(t in publishers for _, t in pb.trips[len(during) :]), "nothing published after execute"
        final = next(i for i, (what, _) in enumerate(pb.trips) if what.startswith("send") and "final" in what)
        assert any(t == "llm-output-sender" and w.startswith("metric") for w, t in pb.trips[len(during) : final]), (
            "the final response went out before the request's counts were published"
        )
        assert all(r.error is None for r in request.sender.responses)
    finally:
        model.finalize()
    assert not model.metrics_publisher.running
    assert pb.trips[-1] == ("exit", caller), "finalize did not end the stub process last"


def test_a_dead_engine_unloads_its_model_after_answering_the_requests_in_flight(triton_model):
    """...and lets go of each request's response sender once its final response is out, without waiting for
    the cycle collector: Triton cannot finish unloading a model while one of its response senders lives."""
    model_class, pb, args = triton_model
    model = model_class()
    model.initialize(args)
    gc.disable()  # a sender kept alive by a reference cycle would survive until a collection that may never come
    try:
        request = FakeRequest(pb, DEATH, 3)
        sender = weakref.ref(request.sender)
        model.execute([request])
        wait(request.sender.done, "the dying request's error")
        deadline = time.monotonic() + 10
        while not pb.unloaded and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pb.unloaded == ["llm_glue"]
        (response,) = request.sender.responses
        assert "the engine stopped after an internal error" in response.error.message
        del request, response
        deadline = time.monotonic() + 10
        while sender() is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sender() is None, "the dying request's response sender is still referenced after its final response"
        assert ("unload", "llm-engine") in pb.trips  # from the dying engine thread, not a stub thread of Triton's
        later = FakeRequest(pb, "Hello", 2)
        model.execute([later])
        wait(later.sender.done, "the later request's refusal")
        assert "the engine stopped" in later.sender.responses[-1].error.message
    finally:
        gc.enable()
        model.finalize()


def test_responses_carry_only_the_outputs_the_request_names(triton_model):
    model_class, pb, args = triton_model
    model = model_class()
    model.initialize(args)
    try:
        named = FakeRequest(pb, "Hello there", 3, requested=("text_output",))
        every = FakeRequest(pb, "Hello there", 3)
        model.execute([named, every])
        wait(named.sender.done, "the first request's final response")
        wait(every.sender.done, "the second request's final response")
        sent = [r for r in named.sender.responses if r is not None]
        assert sent and all({t.name for t in r.output_tensors} == {"text_output"} for r in sent)
        full = [r for r in every.sender.responses if r is not None]
        assert full and all(
            {"text_output", "output_ids", "sample_index"} <= {t.name for t in r.output_tensors} for r in full
        )
    finally:
        model.finalize()


def test_each_kind_of_request_gets_its_answer_and_a_cancelled_client_frees_its_blocks(triton_model):
    """`execute` routes by kind: a LoRA admin action and a forwarding model's cancellation are answered at once; a
    generation whose client is gone is noticed by the output sender's sweep, which tells the engine loop: the request
    ends early with its final response, and its KV blocks are free again."""
    model_class, pb, args = triton_model
    model = model_class()
    model.initialize(args)
    try:
        admin = FakeRequest(pb, "", 1, parameters=json.dumps({"lora_adapters": {"action": "list"}}))
        cancel = FakeRequest(pb, "", 1, parameters=json.dumps({"cancel_forwarded": "not-in-flight"}))
        gone = FakeRequest(
            pb, "Count to a thousand", 100, parameters=json.dumps({"ignore_eos": True, "return_finish_reason": True})
        )
        gone.sender.cancelled = True
        model.execute([admin, cancel, gone])
        wait(admin.sender.done, "the admin action's answer")
        wait(cancel.sender.done, "the cancellation's answer")
        wait(gone.sender.done, "the cancelled request's final response")
        (answer,) = admin.sender.responses
        assert json.loads(answer.output_tensors[0].array[0])["status"] == 200
        assert cancel.sender.responses == [None]
        (final,) = gone.sender.responses
        tensors = {t.name: t.array for t in final.output_tensors}
        assert tensors["finish_reason"].ravel()[0] == b"abort"
        assert tensors["output_ids"].size < 100
        engine = model.engine._engine
        deadline = time.monotonic() + 10
        while engine.requests and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.requests and engine.block_manager.num_used_blocks == 0
    finally:
        model.finalize()


def test_with_vllm_backends_health_check_off_a_dead_engine_leaves_its_model_loaded(triton_model):
    """ENABLE_VLLM_HEALTH_CHECK false (vllm_backend's parameter): the dying request and every later one get the
    engine's error, as with it on, but the model does not unload itself."""
    model_class, pb, args = triton_model
    config = json.loads(args["model_config"])
    config["parameters"]["ENABLE_VLLM_HEALTH_CHECK"] = {"string_value": "false"}
    model = model_class()
    model.initialize({**args, "model_config": json.dumps(config)})
    try:
        request = FakeRequest(pb, DEATH, 3)
        model.execute([request])
        wait(request.sender.done, "the dying request's error")
        assert "the engine stopped after an internal error" in request.sender.responses[-1].error.message
        later = FakeRequest(pb, "Hello", 2)
        model.execute([later])
        wait(later.sender.done, "the later request's refusal")
        assert "[unavailable] the engine stopped" in later.sender.responses[-1].error.message
        time.sleep(0.2)
        assert pb.unloaded == [] and not any(what == "unload" for what, _ in pb.trips)
    finally:
        model.finalize()
