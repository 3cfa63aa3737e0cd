"""backend/engine/output_sender.py: outputs delivered off the engine thread through each request's transport, merged
per stream, cancellation noticed by the periodic sweep and told to the engine loop, a failing client cut off after its
first failure."""

from __future__ import annotations

import threading
import time

from backend.core.client_request import ClientRequest
from backend.core.request import FinishReason, RequestOutput, SampleOutput
from backend.engine import output_sender
from backend.engine.output_sender import OutputSender, Transport, merge_outputs
from backend.protocol.sampling_params import SamplingParams

WAIT_S = 10
SWEEP_S = 0.0625  # the sweep interval of the frozen-clock test: a binary fraction, so the clock's sums are exact


class Tracked:
    """A request the sender tracks: its record, its transport, and whether the sender told the loop to abort it."""

    def __init__(self, on_output, is_cancelled, rid):
        self.client = ClientRequest(rid, "p", [1, 2], SamplingParams(), stream=True)
        self.request_id, self.key = rid, self.client.key
        self.transport = Transport(on_output, is_cancelled)


def request(on_output=lambda o: None, is_cancelled=lambda: False, rid="r") -> Tracked:
    return Tracked(on_output, is_cancelled, rid)


class Aborts:
    """The engine loop's side: the keys the sender asked it to abort."""

    def __init__(self):
        self.keys: list[int] = []

    def __call__(self, keys):
        self.keys += keys

    def cancelled(self, req: Tracked) -> bool:
        return req.key in self.keys


def track(sender: OutputSender, req: Tracked) -> None:
    sender.track(req.key, req.request_id, req.transport)


def delta(req, text, ids, index=0, finished=False, reason=None, logprobs=None) -> RequestOutput:
    sample = SampleOutput(index, text, ids, reason, len(ids), logprobs)
    return RequestOutput(req.request_id, [sample], 2, finished, None, req.key, num_cached_tokens=1)


def wait_until(predicate) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


def test_merge_concatenates_the_deltas_of_each_sample_in_order():
    a, b = request(rid="a"), request(rid="b")
    outputs = [
        delta(a, "Hel", [1], logprobs=[{"t": 1}]),
        delta(b, "x", [9]),
        delta(a, "lo", [2], logprobs=[{"t": 2}]),
        delta(a, "!", [3], index=1),
        delta(a, "", [4], finished=True, reason=FinishReason.STOP, logprobs=[{"t": 4}]),
    ]
    merged = merge_outputs(outputs)
    assert [o.request_id for o in merged] == ["a", "b"]
    first = merged[0]
    assert first.finished and first.num_cached_tokens == 1  # the request's, carried through the merge
    s0, s1 = first.samples
    assert (s0.text, s0.token_ids, s0.finish_reason) == ("Hello", [1, 2, 4], FinishReason.STOP)
    assert s0.logprobs == [{"t": 1}, {"t": 2}, {"t": 4}]
    assert (s1.sample_index, s1.text, s1.token_ids) == (1, "!", [3])
    assert merged[1].samples[0].text == "x" and not merged[1].finished


def test_outputs_go_out_from_the_sender_thread():
    threads, got = set(), threading.Event()

    def record(output):
        threads.add(threading.current_thread().name)
        got.set()

    sender = OutputSender()
    req = request(record)
    track(sender, req)
    sender.put(delta(req, "a", [1]))
    assert got.wait(WAIT_S)
    assert threads == {"llm-output-sender"}
    sender.close()


class FrozenClock:
    """The sender's clock, moved by the test only: its sweep's timing without timing bounds."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_the_sweep_notices_cancellation_and_asks_no_more_than_once_per_interval(monkeypatch):
    clock = FrozenClock()
    monkeypatch.setattr(output_sender, "time", clock)
    cancelled, asked, delivered = threading.Event(), [], []

    def is_cancelled():
        asked.append(clock.now)
        return cancelled.is_set()

    req = request(on_output=lambda o: delivered.extend(o.samples[0].token_ids), is_cancelled=is_cancelled)
    aborts = Aborts()
    sender = OutputSender(aborts, sweep_interval_s=SWEEP_S)
    track(sender, req)
    for interval in (1, 2):  # a busy stream: one check per interval, however many outputs it delivers
        clock.now = SWEEP_S * interval
        for token in range(100 * interval, 100 * interval + 10):
            sender.put(delta(req, "x", [token]))
            assert wait_until(lambda token=token: delivered and delivered[-1] == token)
        assert asked == [SWEEP_S * k for k in range(1, interval + 1)]
    assert not aborts.cancelled(req)
    cancelled.set()
    clock.now = 3 * SWEEP_S
    sender.put(delta(req, "y", [1]))
    assert wait_until(lambda: aborts.cancelled(req))
    sender.close()
    assert asked == [SWEEP_S, 2 * SWEEP_S, 3 * SWEEP_S]


def test_many_streams_are_asked_in_turns_of_a_few_per_sweep():
    """20 in flight, 8 asks a sweep: no sweep asks more than 8, every request is asked within 3 sweeps, and a
    cancellation among them is noticed."""
    asked: list[tuple[float, str]] = []

    def watcher(rid):
        return lambda: asked.append((time.monotonic(), rid)) or rid == "r13" and len(asked) > 20

    reqs = [request(is_cancelled=watcher(f"r{i}"), rid=f"r{i}") for i in range(20)]
    aborts = Aborts()
    sender = OutputSender(aborts, sweep_interval_s=0.05, checks_per_sweep=8)
    for r in reqs:
        track(sender, r)
    assert wait_until(lambda: aborts.cancelled(reqs[13]))
    sender.close()
    sweeps: dict[int, list[str]] = {}
    start = asked[0][0]
    for when, rid in asked:
        sweeps.setdefault(round((when - start) / 0.05), []).append(rid)
    assert max(len(s) for s in sweeps.values()) <= 8
    first_three = [rid for i in sorted(sweeps)[:3] for rid in sweeps[i]]
    assert set(first_three) == {r.request_id for r in reqs}
    assert not any(aborts.cancelled(r) for r in reqs if r.request_id != "r13")


def test_a_failing_client_is_cancelled_and_sent_nothing_more():
    calls = []

    def broken(output):
        calls.append(output)
        raise RuntimeError("client went away")

    req = request(broken)
    aborts = Aborts()
    sender = OutputSender(aborts)
    track(sender, req)
    sender.put(delta(req, "a", [1]))
    assert wait_until(lambda: aborts.cancelled(req))
    sender.put(delta(req, "", [], finished=True, reason=FinishReason.ABORT))
    sender.close()
    assert len(calls) == 1


def test_close_sends_everything_queued():
    got = []
    req = request(got.append)
    sender = OutputSender()
    track(sender, req)
    for i in range(50):
        sender.put(delta(req, str(i), [i], finished=i == 49))
    sender.close()
    assert "".join(s.text for o in got for s in o.samples) == "".join(str(i) for i in range(50))
    assert got[-1].finished and sum(o.finished for o in got) == 1


def test_outputs_name_their_request_by_key_and_an_untracked_one_is_dropped():
    got = []
    first, second = request(got.append), request(got.append)  # the same request id: keys tell them apart
    assert first.request_id == second.request_id and first.key != second.key
    sender = OutputSender()
    track(sender, first)
    sender.put(delta(second, "dropped", [1], finished=True))
    sender.put(delta(first, "kept", [2], finished=True))
    sender.close()
    assert [s.text for o in got for s in o.samples] == ["kept"]
