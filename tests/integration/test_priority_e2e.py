"""Request priority against the real server: on a KV cache too small for the load, a request of a better priority
sent while others wait is scheduled before every one of them and the load is preempted around it, each greedy
output still equal to transformers'; the gauges by priority; bad priorities refused by Triton and by the front
door, the server serving on with no block held."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from client import ServerError, generate_grpc
from testkit.fidelity import first_mismatch
from testkit.prompts import MIXED_CASES
from tests.integration.llm_testlib import post

pytestmark = pytest.mark.integration

MODEL = "llm_small_kv"  # 24 blocks of 16 tokens: the mixed cases need several times that at once
HIGH = ("The most important invention of the twentieth century was", 40)
LOAD = [case for case in MIXED_CASES if case != HIGH]
LOW = 1  # half the load sends priority 1, the other half the default, 0


def generate(server, prompt: str, max_tokens: int, priority: int | None):
    sampling = {"max_tokens": max_tokens, "temperature": 0.0}
    if priority is not None:
        sampling["priority"] = priority
    completion = generate_grpc(prompt, server.grpc_url, MODEL, sampling=sampling, return_perf_metrics=True)
    perf = [c.raw["perf_metrics"][0] for c in completion.chunks if c.raw.get("perf_metrics")][-1]
    return completion, json.loads(perf)


def waiting(m) -> float:
    return sum(m.get("llm_requests_waiting_by_priority", MODEL, priority=p) for p in (str(LOW), "0"))


def test_a_better_priority_is_scheduled_before_the_waiting_load_and_outputs_stay_exact(server, reference):
    refs = reference.many([*LOAD, HIGH])
    server.wait_idle(MODEL)
    before = server.metrics()
    with ThreadPoolExecutor(max_workers=len(LOAD)) as pool:
        load = [
            pool.submit(generate, server, prompt, max_tokens, LOW if i % 2 == 0 else None)
            for i, (prompt, max_tokens) in enumerate(LOAD)
        ]
        busy = server.wait_for(lambda m: waiting(m) >= 4, timeout_s=120, what="a queue of at least 4 requests")
        high, high_perf = generate(server, *HIGH, priority=-1)
        results = [future.result(timeout=600) for future in load]

    problems = [
        f"{prompt[:40]!r}: {first_mismatch(got.token_ids, ref.token_ids)}"
        for (prompt, _), ref, got in zip([*LOAD, HIGH], refs, [*(c for c, _ in results), high])
        if got.token_ids != ref.token_ids
    ]
    assert not problems, "outputs differ from the reference under priority preemption:\n" + "\n".join(problems)

    arrived, scheduled = high_perf["arrival_time_ns"], high_perf["first_scheduled_time_ns"]
    # the load's requests still waiting when the high-priority one arrived
    queued = [perf for _, perf in results if perf["arrival_time_ns"] < arrived < perf["first_scheduled_time_ns"]]
    assert len(queued) >= 2, f"only {len(queued)} requests were waiting when the high-priority one arrived"
    # none of them was scheduled before it, but in the one step that may have been under way when it arrived
    # (every sequence a step admits gets that step's time)
    ahead = {perf["first_scheduled_time_ns"] for perf in queued if perf["first_scheduled_time_ns"] < scheduled}
    assert len(ahead) <= 1, f"{len(ahead)} steps admitted waiting requests of a lower priority before it"

    after = server.wait_idle(MODEL)
    preempted = after.get("llm_requests_preempted_total", MODEL) - before.get("llm_requests_preempted_total", MODEL)
    assert preempted > 0, "no sequence was preempted: the test did not exercise preemption"
    assert sum(busy.get("llm_requests_running_by_priority", MODEL, priority=p) for p in (str(LOW), "0")) > 0
    assert after.has("llm_requests_running_by_priority", MODEL, priority="-1")  # it ran: its series was made
    for p in ("-1", "0", str(LOW)):  # every series seen reads 0 once idle (one never seen, e.g. waiting at -1
        for state in ("running", "waiting"):  # where it was admitted at once, is not made)
            name = f"llm_requests_{state}_by_priority"
            assert not after.has(name, MODEL, priority=p) or after.get(name, MODEL, priority=p) == 0, (state, p)
    assert after.get("llm_kv_cache_blocks_used", MODEL) == 0
    print(f"{len(queued)} requests waiting when it arrived; {preempted:.0f} preemptions; TTFT {high.ttft_s:.3f} s")


@pytest.mark.parametrize("value", [1.5, True, "high", 5000])
def test_triton_refuses_a_bad_priority_and_serves_on(server, value):
    with pytest.raises(ServerError, match=r"priority must be .*-1000 and 1000"):
        generate_grpc("Hello", server.grpc_url, MODEL, sampling={"max_tokens": 2, "priority": value})
    got = generate_grpc("The capital of France is", server.grpc_url, MODEL, max_tokens=4, temperature=0.0, priority=3)
    assert len(got.token_ids) == 4
    assert server.wait_idle(MODEL).get("llm_kv_cache_blocks_used", MODEL) == 0


def test_the_front_door_passes_priority_through_and_refuses_a_bad_one(server):
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)
    answer = client.completions.create(
        model="llm", prompt="The capital of France is", max_tokens=4, temperature=0, extra_body={"priority": -7}
    )
    assert answer.usage.completion_tokens == 4
    # the engine counted it under its priority (a series that stays, at 0 once the request is done)
    server.wait_for(lambda m: m.has("llm_requests_running_by_priority", "llm", priority="-7"), timeout_s=10)
    chat = {"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for body in ({**chat, "priority": 0.5}, {**chat, "priority": "1"}, {**chat, "priority": -1001}):
        status, error = post(server, "/v1/chat/completions", body)
        assert status == 400 and error["error"]["param"] == "priority", error
        assert error["error"]["message"].startswith("priority must be")
    status, _ = post(server, "/v1/responses", {"model": "llm", "input": "Hi", "max_output_tokens": 2, "priority": 2})
    assert status == 200
    assert server.wait_idle("llm").get("llm_kv_cache_blocks_used", "llm") == 0
