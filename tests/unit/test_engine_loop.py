"""backend/engine/loop.py: the engine on its own thread: outputs through each request's transport from the output
sender's thread, ServerBusy past max_queue_size, per-request errors, failing callbacks, cancellation as a message to
the loop, and shutdown."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

from backend import EngineConfig, EngineLoop, EngineStopped, LLMEngine, SamplingParams, ServerBusy
from backend.core.request import FinishReason
from backend.engine.output_sender import Transport

WAIT_S = 60


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(
        EngineConfig(model=tiny_llama, dtype="float32", block_size=4, kv_cache_blocks=256, max_queue_size=256)
    )


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
    """A transport's send that records outputs, the threads they came from, and signals the final one."""

    def __init__(self):
        self.outputs = []
        self.threads = set()
        self.done = threading.Event()
        self.first = threading.Event()

    def __call__(self, output):
        self.outputs.append(output)
        self.threads.add(threading.current_thread().name)
        self.first.set()
        if output.finished:
            self.done.set()

    def wait(self):
        assert self.done.wait(WAIT_S), "no final output"
        return self.outputs[-1]


def _wait_for(condition) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@contextmanager
def steps_held_while(engine, hold):
    """Each engine step first waits while hold() is true: orders the engine thread against the client's actions
    instead of racing it (the output sender keeps a slow client from slowing generation, so delays prove nothing)."""
    step = engine.step

    def held_step():
        assert _wait_for(lambda: not hold()), "the engine step was held too long"
        return step()

    engine.step = held_step
    try:
        yield
    finally:
        del engine.step  # back to the class's method


def test_outputs_arrive_from_the_output_sender_thread(engine, loop):
    running = loop()
    collectors = {}
    for i, prompt in enumerate(["Hello there", "A much longer prompt about many things", "x"]):
        collectors[i] = Collector()
        stream = i == 0
        request = engine.build_request(f"t{i}", prompt, SamplingParams(temperature=0.0, max_tokens=6), stream=stream)
        running.submit(request, Transport(collectors[i]))
    for c in collectors.values():
        final = c.wait()
        assert final.finished and final.error is None
        assert c.threads == {"llm-output-sender"}  # the engine thread never waits on a client
        tokens = [t for o in c.outputs for s in o.samples for t in s.token_ids]
        assert len(tokens) == 6 or tokens[-1] == 2
    assert len(collectors[1].outputs) == 1  # one final response
    running.shutdown(timeout_s=WAIT_S)
    assert not running._thread.is_alive()


def test_a_slow_client_gets_its_waiting_deltas_merged(engine, loop):
    """While a delivery is slow the engine keeps generating; the deltas waiting for that stream go out as
    one response, in order, with exactly one final."""
    running = loop()
    steps_at_start = engine.num_steps
    slow = Collector()
    first_delivery = slow.__call__

    def slow_first_delivery(output):  # the first delivery lasts until the engine has made 10 more steps
        if not slow.outputs:
            assert _wait_for(lambda: engine.num_steps >= steps_at_start + 11)
        first_delivery(output)

    request = engine.build_request(
        "slow",
        "Count",
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        stream=True,
    )
    with steps_held_while(engine, lambda: engine.num_steps >= steps_at_start + 20 and len(slow.outputs) < 2):
        running.submit(request, Transport(slow_first_delivery))
        final = slow.wait()
    tokens = [t for o in slow.outputs for s in o.samples for t in s.token_ids]
    assert len(tokens) == 40 and final.samples[-1].num_output_tokens == 40
    assert 1 < len(slow.outputs) < 40  # streamed, and merged while the client was slow:
    assert max(len(o.samples[0].token_ids) for o in slow.outputs) >= 5  # the deltas of the held delivery went as one
    assert sum(o.finished for o in slow.outputs) == 1
    text = "".join(s.text for o in slow.outputs for s in o.samples)
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_server_busy_past_max_queue_size(engine, loop):
    engine.config.max_queue_size = 2
    idle = loop(start=False)  # nothing drains the queue yet
    rejected_before = engine.metrics.total("llm_requests_rejected_total")
    collectors = [Collector() for _ in range(2)]
    for i, c in enumerate(collectors):
        idle.submit(engine.build_request(f"q{i}", "Hi", SamplingParams(max_tokens=2)), Transport(c))
    assert idle.num_waiting == 2
    with pytest.raises(ServerBusy, match="max_queue_size=2"):
        idle.submit(engine.build_request("q2", "Hi", SamplingParams(max_tokens=2)), Transport(Collector()))
    assert engine.metrics.total("llm_requests_rejected_total") == rejected_before + 1
    idle.start()  # the queued requests are served
    for c in collectors:
        assert c.wait().error is None
    # and the queue has room again
    late = Collector()
    idle.submit(engine.build_request("q3", "Hi", SamplingParams(max_tokens=2)), Transport(late))
    assert late.wait().finished


def test_zero_max_queue_size_means_unbounded(engine, loop):
    engine.config.max_queue_size = 0
    idle = loop(start=False)
    collectors = [Collector() for _ in range(20)]
    for i, c in enumerate(collectors):
        idle.submit(engine.build_request(f"u{i}", "Hi", SamplingParams(max_tokens=1)), Transport(c))
    idle.start()
    assert all(c.wait().finished for c in collectors)


def test_duplicate_request_id_gets_an_error_output(engine, loop):
    running = loop(start=False)
    first, second = Collector(), Collector()
    running.submit(engine.build_request("same", "Hi", SamplingParams(max_tokens=4)), Transport(first))
    running.submit(engine.build_request("same", "Hi", SamplingParams(max_tokens=4)), Transport(second))
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
    running.submit(
        engine.build_request(
            "broken",
            "Tell me a long story",
            SamplingParams(max_tokens=200, ignore_eos=True),
            stream=True,
        ),
        Transport(broken),
    )
    running.submit(engine.build_request("good", "Hi", SamplingParams(max_tokens=5)), Transport(good))
    assert good.wait().error is None
    deadline = time.monotonic() + WAIT_S
    while "broken" in engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "broken" not in engine.requests  # aborted after its first failed delivery
    assert len(calls) == 1


def test_cancelled_request_through_the_loop(engine, loop):
    running = loop()
    cancel, seen = threading.Event(), threading.Event()
    c = Collector()

    def is_cancelled() -> bool:
        if cancel.is_set():
            seen.set()
        return cancel.is_set()

    # after its first output the request makes no progress until the cancellation sweep has seen the flag
    with steps_held_while(engine, lambda: c.first.is_set() and not seen.is_set()):
        running.submit(
            engine.build_request(
                "cx",
                "Count to a thousand",
                SamplingParams(max_tokens=400, ignore_eos=True),
                stream=True,
            ),
            Transport(c, is_cancelled),
        )
        assert c.first.wait(WAIT_S)
        cancel.set()
        final = c.wait()
    assert final.samples[-1].finish_reason == FinishReason.ABORT
    assert sum(len(s.token_ids) for o in c.outputs for s in o.samples) < 400


def test_an_abort_sent_before_its_request_is_admitted_still_aborts_it(engine, loop):
    """Aborts are messages taken after the requests submitted before them: one that arrives while its request still
    waits to be admitted is not lost."""
    idle = loop(start=False)
    c = Collector()
    request = engine.build_request("early", "Count to a thousand", SamplingParams(max_tokens=400, ignore_eos=True))
    idle.submit(request, Transport(c))
    idle.abort_requests([request.key])
    idle.start()
    final = c.wait()
    assert final.finished and [s.finish_reason for s in final.samples] == [FinishReason.ABORT]
    assert final.samples[0].token_ids == []


def test_shutdown_answers_requests_in_flight(engine, loop):
    running = loop()
    first = Collector()
    # after its first output the request makes no progress until shutdown has begun
    with steps_held_while(engine, lambda: first.first.is_set() and not running._stopping.is_set()):
        running.submit(
            engine.build_request(
                "long", "Write an essay", SamplingParams(max_tokens=400, ignore_eos=True), stream=True
            ),
            Transport(first),
        )
        assert first.first.wait(WAIT_S)
        running.shutdown(timeout_s=WAIT_S)
    assert not running._thread.is_alive()
    final = first.outputs[-1]
    assert final.finished and final.error == "the server is shutting down"
    assert sum(len(s.token_ids) for o in first.outputs for s in o.samples) < 400
    assert not engine.requests and engine.block_manager.num_used_blocks == 0
    with pytest.raises(EngineStopped, match="shutting down"):
        running.submit(engine.build_request("after", "Hi", SamplingParams(max_tokens=2)), Transport(Collector()))


def _shutdown_while_first_is_sent(engine, running, first_id: str, second_id: str):
    """Submit a long request, hold the engine thread inside the step that produced its first output, queue
    a second one, then shut down; returns the two collectors once shutdown has finished."""
    gate, held = threading.Event(), threading.Event()
    first = Collector()
    step = engine.step

    def held_step():  # the engine thread stays inside the step that produced outputs until the gate opens
        outputs = step()
        if outputs:
            held.set()
            gate.wait(WAIT_S)
        return outputs

    engine.step = held_step
    try:
        running.submit(
            engine.build_request(first_id, "Hi", SamplingParams(max_tokens=300, ignore_eos=True), stream=True),
            Transport(first),
        )
        assert held.wait(WAIT_S)
        second = Collector()
        running.submit(engine.build_request(second_id, "Hi", SamplingParams(max_tokens=2)), Transport(second))
        stopper = threading.Thread(target=running.shutdown, kwargs={"timeout_s": WAIT_S})
        stopper.start()
        deadline = time.monotonic() + WAIT_S
        while not running._stopping.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        gate.set()
        stopper.join(WAIT_S)
        assert not stopper.is_alive()
    finally:
        del engine.step  # back to the class's method
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


def test_a_dead_engine_thread_answers_every_request_at_once(tiny_llama):
    engine = LLMEngine(
        EngineConfig(
            model=tiny_llama, dtype="float32", block_size=4, kv_cache_blocks=256, fault_injection="engine_death:DIE"
        )
    )
    running = EngineLoop(engine)
    long, dying = Collector(), Collector()
    running.start()
    running.submit(
        engine.build_request("long", "Write an essay", SamplingParams(max_tokens=400, ignore_eos=True), stream=True),
        Transport(long),
    )
    assert long.first.wait(WAIT_S)
    running.submit(engine.build_request("die", "DIE please", SamplingParams(max_tokens=4)), Transport(dying))
    assert dying.wait().error.startswith("the engine stopped after an internal error (InjectedFault: injected")
    assert long.wait().error == dying.outputs[-1].error  # the request in flight is answered too
    running._thread.join(WAIT_S)
    assert not running._thread.is_alive() and running.failure == dying.outputs[-1].error
    assert engine.metrics.gauges["llm_engine_alive"] == 0
    assert engine.block_manager.num_used_blocks == 0
    started = time.monotonic()
    with pytest.raises(EngineStopped, match="the model must be reloaded"):
        running.submit(engine.build_request("after", "Hi", SamplingParams(max_tokens=2)), Transport(Collector()))
    assert time.monotonic() - started < 1.0
    running.shutdown(timeout_s=WAIT_S)


def test_load_engine_builds_on_a_thread_that_ends(tiny_llama, monkeypatch):
    """The loading thread's OpenMP pool must not outlive the load (see load_engine): it runs elsewhere and ends."""
    from backend.engine import loop as loop_module

    built_on = []

    class Recording(LLMEngine):
        def __init__(self, config):
            built_on.append(threading.current_thread())
            super().__init__(config)

    monkeypatch.setattr(loop_module, "LLMEngine", Recording)
    engine = loop_module.load_engine(EngineConfig(model=tiny_llama, dtype="float32", block_size=4, kv_cache_blocks=8))
    assert isinstance(engine, Recording)
    assert built_on[0] is not threading.current_thread() and not built_on[0].is_alive()


def test_load_engine_raises_what_the_load_raised(tmp_path):
    from backend.engine.loop import load_engine

    with pytest.raises(ValueError, match=f"parameter 'model': model '{tmp_path}': no config.json"):
        load_engine(EngineConfig(model=str(tmp_path), dtype="float32"))
