"""backend/serving/batch_view.py: step records built from a real (tiny) engine's steps (prefill chunks with their
ranges, decodes, speculative verifications), none built when nobody watches, bounded watcher queues that
drop the oldest record, and the watch stream's life cycle (records out, ends on cancel, close or a failed
send)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from backend import LLMEngine, SamplingParams
from backend.engine import llm_engine as engine_module
from backend.engine.step_records import DECODE, PREFILL, VERIFY, StepWatcher, StepWatchers, describe, step_record
from backend.serving.batch_view import WatchStream, engine_summary, is_watch_request

PROMPT = "Once upon a time, in a land far away, there lived a very curious cat who wanted to see the sea."


@pytest.fixture(scope="module")
def make_engine(make_engine):
    """conftest's engines with a small token budget and batch: several steps per prompt, few sequences."""
    settings = dict(kv_cache_blocks=128, max_num_batched_tokens=16, max_num_seqs=8, seed=7)
    return lambda **overrides: make_engine(**{**settings, **overrides})


def run_watched(engine: LLMEngine, requests, capacity: int = 10_000) -> list[dict]:
    """Run the requests to the end with one watcher attached; returns its step records."""
    watcher = engine.watchers.add(capacity)
    try:
        for request in requests:
            engine.add_request(request)
        for _ in range(500):
            if not engine.has_work():
                break
            engine.step()
        assert not engine.has_work()
        return watcher.take(0)
    finally:
        engine.watchers.remove(watcher)


def seq_cells(records: list[dict], request_id: str) -> list[dict]:
    return [e for r in records for e in r["seqs"] if e["request_id"] == request_id]


def test_records_show_prefill_chunks_with_ranges_then_decodes(make_engine):
    engine = make_engine()
    long = engine.build_request("long", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    short = engine.build_request("short", "Hi", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    records = run_watched(engine, [short, long])  # the short one decodes while the long one prefills
    total = len(long.prompt_token_ids)
    assert total > 16  # two or more chunks
    cells = seq_cells(records, "long")
    chunks = [c for c in cells if c["kind"] == PREFILL]
    assert len(chunks) >= 2 and chunks[0]["start"] == 0
    assert all(a["end"] == b["start"] for a, b in zip(chunks, chunks[1:])) and chunks[-1]["end"] == total
    assert all(c["prompt_tokens"] == total and c["tokens"] == c["end"] - c["start"] for c in chunks)
    decodes = [c for c in cells if c["kind"] == DECODE]
    assert len(decodes) == 3 and all(c["tokens"] == 1 for c in decodes)  # the 1st token came with the prefill
    assert [c["finished"] for c in cells] == [False] * (len(cells) - 1) + [True]
    for r in records:
        assert r["type"] == "step" and r["num_tokens"] == sum(e["tokens"] for e in r["seqs"]) <= 16
        assert r["token_budget"] == 16 and r["kv_blocks_total"] == 128 and 0 <= r["kv_blocks_used"] <= 128
        assert r["step_ms"] > 0 and r["running"] + r["waiting"] <= 2
    steps = [r["step"] for r in records]
    assert steps == list(range(steps[0], steps[0] + len(steps)))
    # the short request's decodes share steps with the long one's chunks
    assert any({e["kind"] for e in r["seqs"]} == {PREFILL, DECODE} for r in records)
    assert records[-1]["kv_blocks_used"] == 0 and records[-1]["running"] == 0


def test_describe_is_the_log_line(make_engine):
    engine = make_engine()
    request = engine.build_request(
        "viz", "Seen by no other test: " + PROMPT, SamplingParams(temperature=0, max_tokens=2)
    )
    engine.add_request(request)
    total = len(request.prompt_token_ids)
    sched = engine.scheduler.schedule()
    line = describe(step_record(engine.num_steps, sched, {}, engine.scheduler, engine.config.max_num_batched_tokens))
    assert f"[viz#0 prefill 0:16/{total} 16t]" in line and "16/16 tokens" in line
    engine.abort("viz")
    record = run_watched(engine, [engine.build_request("viz2", "Hi", SamplingParams(temperature=0, max_tokens=2))])
    assert "[viz2#0 decode 1t]" in describe(record[-1]) and "1/16 tokens" in describe(record[-1])


def test_speculative_verifications_carry_drafted_and_accepted(make_engine):
    engine = make_engine(draft_model="self", draft_dtype="float32", num_speculative_tokens=3, max_num_batched_tokens=64)
    request = engine.build_request("spec", PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    records = run_watched(engine, [request])
    verifies = [c for c in seq_cells(records, "spec") if c["kind"] == VERIFY]
    assert verifies
    for c in verifies:  # the draft is the target: every draft is accepted
        assert 1 <= c["drafted"] <= 3 and c["accepted"] == c["drafted"] and c["tokens"] == c["drafted"] + 1
    assert "draft (3 accepted)" in describe(next(r for r in records if r["seqs"][0].get("drafted") == 3))
    assert engine_summary(engine)["num_speculative_tokens"] == 3


def test_no_record_is_built_when_nobody_watches(make_engine, monkeypatch):
    engine = make_engine()
    built = []
    monkeypatch.setattr(engine_module, "step_record", lambda *a: built.append(1) or step_record(*a))
    engine.add_request(engine.build_request("quiet", "Hi", SamplingParams(temperature=0, max_tokens=3)))
    while engine.has_work():
        engine.step()
    assert built == []
    run_watched(engine, [engine.build_request("seen", "Hi", SamplingParams(temperature=0, max_tokens=3))])
    assert len(built) >= 3


def test_an_unread_watcher_drops_its_oldest_records_and_never_blocks_the_engine(make_engine):
    engine = make_engine()
    request = engine.build_request("flood", "Hi", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    watcher = engine.watchers.add(capacity=4)
    try:
        engine.add_request(request)
        while engine.has_work():
            engine.step()
        records = watcher.take(0)
    finally:
        engine.watchers.remove(watcher)
    assert len(records) == 4 and watcher.dropped == 20 - 4  # 20 steps: one prefill, 19 decodes
    assert records[-1]["seqs"][0]["finished"] and [r["step"] for r in records] == list(
        range(records[0]["step"], records[0]["step"] + 4)
    )
    assert not engine.watchers.active


def test_watcher_queue_is_bounded_and_take_waits():
    watcher = StepWatcher(capacity=3)
    for i in range(5):
        watcher.put({"step": i})
    assert [r["step"] for r in watcher.take(0)] == [2, 3, 4] and watcher.dropped == 2
    assert watcher.take(0) == []
    threading.Timer(0.05, watcher.put, args=({"step": 9},)).start()
    started = time.monotonic()
    assert watcher.take(5.0) == [{"step": 9}] and time.monotonic() - started < 2.0
    watcher.close()
    started = time.monotonic()
    assert watcher.take(5.0) == [] and time.monotonic() - started < 1.0  # a closed watcher does not wait


def test_publish_reaches_every_watcher_and_close_ends_them():
    watchers = StepWatchers()
    assert not watchers.active
    a, b = watchers.add(), watchers.add()
    watchers.publish({"step": 1})
    assert a.take(0) == b.take(0) == [{"step": 1}]
    watchers.remove(a)
    watchers.publish({"step": 2})
    assert a.take(0) == [] and b.take(0) == [{"step": 2}] and a.closed
    watchers.close()
    assert b.closed and not watchers.active


class FakeClient:
    """The callbacks a Triton response sender gives a WatchStream."""

    def __init__(self, fail_after: int | None = None):
        self.sent: list[dict] = []
        self.cancelled = False
        self.finished = threading.Event()
        self.fail_after = fail_after

    def send(self, text: str) -> None:
        if self.fail_after is not None and len(self.sent) >= self.fail_after:
            raise RuntimeError("the client is gone")
        self.sent.append(json.loads(text))

    def stream(self, watchers: StepWatchers, capacity: int = 512) -> WatchStream:
        return WatchStream(
            watchers,
            {"type": "config", "token_budget": 16},
            self.send,
            lambda: self.cancelled,
            self.finished.set,
            poll_s=0.01,
            capacity=capacity,
        ).start()


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_watch_stream_sends_the_summary_then_records_until_cancelled():
    watchers = StepWatchers()
    client = FakeClient()
    stream = client.stream(watchers)
    assert watchers.active
    wait_until(lambda: client.sent)
    assert client.sent[0] == {"records": [{"type": "config", "token_budget": 16}], "dropped": 0}
    for step in range(3):
        watchers.publish({"type": "step", "step": step})
    wait_until(lambda: sum(len(m["records"]) for m in client.sent) == 4)
    assert [r["step"] for m in client.sent[1:] for r in m["records"]] == [0, 1, 2]
    client.cancelled = True
    assert client.finished.wait(5.0)
    stream.thread.join(5.0)
    assert not watchers.active  # the watcher is gone with its client


def test_watch_stream_ends_on_close_and_on_a_failed_send():
    watchers = StepWatchers()
    closing = FakeClient()
    closing.stream(watchers)
    wait_until(lambda: closing.sent)
    watchers.close()
    assert closing.finished.wait(5.0)

    failing = FakeClient(fail_after=1)  # the summary goes out, the first records do not
    failing.stream(watchers)
    wait_until(lambda: failing.sent)
    watchers.publish({"type": "step", "step": 1})
    assert failing.finished.wait(5.0)
    wait_until(lambda: not watchers.active)


@pytest.mark.parametrize(
    "parameters, expected",
    [
        ("", False),
        ("{}", False),
        ('{"max_tokens": 4}', False),
        ('{"batch_view": true}', True),
        ('{"batch_view": "true"}', True),
        ('{"batch_view": false}', False),
        ('{"batch_view": 1}', False),
        ("not json batch_view", False),
        ('["batch_view"]', False),
    ],
)
def test_is_watch_request(parameters, expected):
    assert is_watch_request(parameters) is expected
