"""A KV cache too small for the load: sequences are preempted and recomputed, and every output still equals
the reference."""

import pytest

from client import ServerError, generate_grpc
from testkit.concurrency import raise_first_error, run_concurrently
from testkit.fidelity import first_mismatch
from testkit.prompts import MIXED_CASES

pytestmark = pytest.mark.integration

MODEL = "llm_small_kv"


def test_preemption_keeps_outputs_exact(server, reference):
    refs = reference.many(MIXED_CASES)
    server.wait_idle(MODEL)
    before = server.metrics()
    total_blocks = before.get("llm_kv_cache_blocks_total", MODEL)
    block_size = int(server.variants[MODEL].get("block_size", "16"))
    needed = sum(-(-(len(reference.prompt_ids(p)) + mt) // block_size) for p, mt in MIXED_CASES)
    assert needed > total_blocks, "the variant's KV cache must be too small for the whole load"

    results = run_concurrently(
        lambda p, mt: generate_grpc(p, server.grpc_url, MODEL, max_tokens=mt, temperature=0.0), MIXED_CASES
    )
    raise_first_error(results, "request")
    problems = [
        f"#{i} (prompt {p[:40]!r}): {first_mismatch(got.token_ids, ref.token_ids)}"
        for i, ((p, _), ref, got) in enumerate(zip(MIXED_CASES, refs, results))
        if got.token_ids != ref.token_ids
    ]
    assert not problems, "outputs differ from the reference under preemption:\n" + "\n".join(problems)

    after = server.wait_idle(MODEL)
    preempted = after.get("llm_requests_preempted_total", MODEL) - before.get("llm_requests_preempted_total", MODEL)
    assert preempted > 0, "no sequence was preempted: the test did not exercise preemption"
    assert after.get("llm_kv_cache_blocks_used", MODEL) == 0
    print(f"{preempted:.0f} preemptions; {needed} blocks needed at once vs {total_blocks:.0f} in the pool")


NEVER_FITS = ("The history of the bicycle begins in the early nineteenth century. " * 8, 600)  # ~100 + 600 tokens


def test_request_that_can_never_fit_the_kv_cache_is_refused(server):
    """prompt + max_tokens beyond the whole pool (384 tokens) but within max_model_len: a clear error."""
    prompt, max_tokens = NEVER_FITS
    with pytest.raises(ServerError, match="can never fit the KV cache of 384 tokens"):
        generate_grpc(prompt, server.grpc_url, MODEL, max_tokens=max_tokens, temperature=0.0)
    got = generate_grpc("The capital of France is", server.grpc_url, MODEL, max_tokens=4, temperature=0.0)
    assert len(got.token_ids) == 4


def test_never_fitting_request_counts_as_rejected(server):
    prompt, max_tokens = NEVER_FITS
    before = server.metrics().get("llm_requests_rejected_total", MODEL)
    with pytest.raises(ServerError):
        generate_grpc(prompt, server.grpc_url, MODEL, max_tokens=max_tokens, temperature=0.0)
    after = server.settled_metrics(MODEL).get("llm_requests_rejected_total", MODEL)
    assert after == before + 1
