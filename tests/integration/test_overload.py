"""Past the queue limit a request is refused at once with a clear message; every accepted one completes."""

import time

import pytest

from client import ServerError, generate_grpc
from testkit.concurrency import run_concurrently

pytestmark = pytest.mark.integration

MODEL = "llm_small_queue"  # max_num_seqs 2, max_queue_size 4
NUM_REQUESTS = 30
MAX_TOKENS = 12


def test_flood_is_partly_refused_fast_and_the_rest_completes(server):
    server.wait_idle(MODEL)
    before = server.metrics()

    def one(i):
        started = time.perf_counter()
        try:
            got = generate_grpc(
                f"Request number {i}: tell me a fact about the number {i}.",
                server.grpc_url,
                MODEL,
                stream=False,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                temperature=0.0,
            )
            return ("ok", time.perf_counter() - started, got)
        except ServerError as exc:
            return ("refused", time.perf_counter() - started, str(exc))

    results = run_concurrently(one, [(i,) for i in range(NUM_REQUESTS)])
    unexpected = [r for r in results if isinstance(r, BaseException)]
    assert not unexpected, unexpected
    accepted = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "refused"]

    assert refused, "a flood of 30 requests against max_queue_size=4, max_num_seqs=2 refused nothing"
    assert len(accepted) >= 4, f"only {len(accepted)} requests were accepted (the queue alone holds 4)"
    for _, _, message in refused:
        assert "server busy" in message and "max_queue_size=4" in message, message
    for _, _, got in accepted:
        assert len(got.token_ids) == MAX_TOKENS and got.finish_reason == "length"
    refusal_times = sorted(t for _, t, _ in refused)
    slowest_completion = max(t for _, t, _ in accepted)
    median = refusal_times[len(refusal_times) // 2]
    assert median < 0.5, f"refusals took {refusal_times} s: not immediate"
    assert refusal_times[-1] < min(2.0, slowest_completion), f"refusals took {refusal_times} s"

    after = server.wait_idle(MODEL)
    rejected = after.get("llm_requests_rejected_total", MODEL) - before.get("llm_requests_rejected_total", MODEL)
    assert rejected == len(refused)
    print(
        f"{len(accepted)} accepted, {len(refused)} refused; refusals in {refusal_times[0]:.3f}.."
        f"{refusal_times[-1]:.3f} s; slowest completion {slowest_completion:.2f} s"
    )
