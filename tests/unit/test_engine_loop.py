"""backend/engine_loop.py: the engine on its own thread: outputs through on_output from the engine thread,
ServerBusy past max_queue_size, per-request errors, failing callbacks, and shutdown."""
from __future__ import annotations

import threading
import time

import pytest

from backend import EngineConfig, EngineLoop, LLMEngine, SamplingParams, ServerBusy
from backend.request import FinishReason

WAIT_S = 60


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama, block_size=4, kv_cache_blocks=256, max_queue_size=256))


@pytest.fixture
def loop(engine):
    engine.config.max_queue_size = 256
    for request_id in list(engine.requests):
        engine.abort(request_id)
    started: list[EngineLoop] = []

    def make(start: bool = True) -> EngineLoop:
        loop = EngineLoop(engine)
        if start:
            loop.start()
        started.append(loop)
        return loop

    yield make
    for loop in started:
        if loop._thread.is_alive():
            loop.shutdown(timeout_s=WAIT_S)
    assert engine.block_manager.num_used_blocks == 0


class Collector:
    """An on_output callback that records outputs, the threads they came from, and signals the final one."""

    def __init__(self, delay_s: float = 0.0):
        self.outputs = []
        self.threads = set()
        self.done = threading.Event()
        self.first = threading.Event()
        self.delay_s = delay_s

    def __call__(self, output):
        self.outputs.append(output)
        self.threads.add(threading.current_thread().name)
        self.first.set()
        if output.finished:
            self.done.set()
        if self.delay_s:
            time.sleep(self.delay_s)

    def wait(self):
        assert self.done.wait(WAIT_S), "no final output"
        return self.outputs[-1]


def test_outputs_arrive_from_the_engine_thread(engine, loop):
    running = loop()
    collectors = {}
    for i, prompt in enumerate(["Hello there", "A much longer prompt about many things", "x"]):
        collectors[i] = Collector()
        stream = i == 0
        request = engine.build_request(f"t{i}", prompt, SamplingParams(temperature=0.0, max_tokens=6),
                                       stream=stream, on_output=collectors[i])
        running.submit(request)
    for i, c in collectors.items():
        final = c.wait()
        assert final.finished and final.error is None
        assert c.threads == {"llm-engine"}
        tokens = [t for o in c.outputs for s in o.samples for t in s.token_ids]
        assert len(tokens) == 6 or tokens[-1] == 2
    assert len(collectors[0].outputs) > 1  # streamed
    assert len(collectors[1].outputs) == 1  # one final response
    running.shutdown(timeout_s=WAIT_S)
    assert not running._thread.is_alive()


def test_server_busy_past_max_queue_size(engine, loop):
    engine.config.max_queue_size = 2
    idle = loop(start=False)  # nothing drains the queue yet
    rejected_before = engine.metrics.total("llm_requests_rejected_total")
    collectors = [Collector() for _ in range(2)]
    for i, c in enumerate(collectors):
        idle.submit(engine.build_request(f"q{i}", "Hi", SamplingParams(max_tokens=2), on_output=c))
    assert idle.num_waiting == 2
    with pytest.raises(ServerBusy, match="max_queue_size=2"):
        idle.submit(engine.build_request("q2", "Hi", SamplingParams(max_tokens=2), on_output=Collector()))
    assert engine.metrics.total("llm_requests_rejected_total") == rejected_before + 1
    idle.start()  # the queued requests are served
    for c in collectors:
        assert c.wait().error is None
    # and the queue has room again
    late = Collector()
    idle.submit(engine.build_request("q3", "Hi", SamplingParams(max_tokens=2), on_output=late))
    assert late.wait().finished


def test_zero_max_queue_size_means_unbounded(engine, loop):
    engine.config.max_queue_size = 0
    idle = loop(start=False)
    collectors = [Collector() for _ in range(20)]
    for i, c in enumerate(collectors):
        idle.submit(engine.build_request(f"u{i}", "Hi", SamplingParams(max_tokens=1), on_output=c))
    idle.start()
    assert all(c.wait().finished for c in collectors)


def test_duplicate_request_id_gets_an_error_output(engine, loop):
    running = loop(start=False)
    first, second = Collector(), Collector()
    running.submit(engine.build_request("same", "Hi", SamplingParams(max_tokens=4), on_output=first))
    running.submit(engine.build_request("same", "Hi", SamplingParams(max_tokens=4), on_output=second))
    running.start()
    error = second.wait()
    assert error.finished and error.samples == [] and "already in flight" in error.error
    assert first.wait().error is None


def test_failing_callback_aborts_only_its_request(engine, loop):
    running = loop()
    calls = []

    def broken(output):
        calls.append(output)
        raise RuntimeError("client went away")

    good = Collector()
    running.submit(engine.build_request("broken", "Tell me a long story", SamplingParams(max_tokens=200,
                   ignore_eos=True), stream=True, on_output=broken))
    running.submit(engine.build_request("good", "Hi", SamplingParams(max_tokens=5), on_output=good))
    assert good.wait().error is None
    deadline = time.monotonic() + WAIT_S
    while "broken" in engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "broken" not in engine.requests  # aborted after its first failed delivery
    assert len(calls) == 1


def test_cancelled_request_through_the_loop(engine, loop):
    running = loop()
    cancel = threading.Event()
    c = Collector(delay_s=0.005)  # slow deliveries: generation cannot finish before the next poll
    running.submit(engine.build_request("cx", "Count to a thousand", SamplingParams(max_tokens=400, ignore_eos=True),
                                        stream=True, on_output=c, is_cancelled=cancel.is_set))
    assert c.first.wait(WAIT_S)
    cancel.set()
    final = c.wait()
    assert final.samples[-1].finish_reason == FinishReason.ABORT
    assert sum(len(s.token_ids) for o in c.outputs for s in o.samples) < 400


def test_shutdown_answers_requests_in_flight(engine, loop):
    running = loop()
    slow = Collector(delay_s=0.005)  # each delivery takes a while: generation cannot finish first
    running.submit(engine.build_request("long", "Write an essay", SamplingParams(max_tokens=400, ignore_eos=True),
                                        stream=True, on_output=slow))
    assert slow.first.wait(WAIT_S)
    running.shutdown(timeout_s=WAIT_S)
    assert not running._thread.is_alive()
    final = slow.outputs[-1]
    assert final.finished and final.error == "the server is shutting down"
    assert sum(len(s.token_ids) for o in slow.outputs for s in o.samples) < 400
    assert not engine.requests and engine.block_manager.num_used_blocks == 0
    with pytest.raises(ServerBusy, match="shutting down"):
        running.submit(engine.build_request("after", "Hi", SamplingParams(max_tokens=2)))


def _shutdown_while_first_is_sent(engine, running, first_id: str, second_id: str):
    """Submit a long request whose first delivery blocks the engine thread, queue a second one, then shut
    down; returns the two collectors once shutdown has finished."""
    gate = threading.Event()
    first = Collector()

    def blocking(output):  # holds the engine thread inside its first delivery
        first(output)
        gate.wait(WAIT_S)

    running.submit(engine.build_request(first_id, "Hi", SamplingParams(max_tokens=300, ignore_eos=True),
                                        stream=True, on_output=blocking))
    assert first.first.wait(WAIT_S)
    second = Collector()
    running.submit(engine.build_request(second_id, "Hi", SamplingParams(max_tokens=2), on_output=second))
    stopper = threading.Thread(target=running.shutdown, kwargs={"timeout_s": WAIT_S})
    stopper.start()
    deadline = time.monotonic() + WAIT_S
    while not running._stopping.is_set() and time.monotonic() < deadline:
        time.sleep(0.001)
    gate.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    return first, second


def test_shutdown_answers_requests_still_queued(engine, loop):
    blocker, queued = _shutdown_while_first_is_sent(engine, loop(), "blocker", "queued")
    never_admitted = queued.wait()
    assert never_admitted.error == "the server is shutting down" and never_admitted.samples == []
    in_flight = blocker.wait()
    assert in_flight.error == "the server is shutting down"
    assert in_flight.samples and in_flight.samples[-1].finish_reason == FinishReason.ABORT
    assert not engine.requests and engine.block_manager.num_used_blocks == 0


def test_shutdown_answers_each_request_exactly_once_even_with_duplicate_ids(engine, loop):
    original, duplicate = _shutdown_while_first_is_sent(engine, loop(), "same-id", "same-id")
    assert sum(o.finished for o in original.outputs) == 1
    assert sum(o.finished for o in duplicate.outputs) == 1
