"""Speculative decoding through the real server: greedy output with a draft model and with n-gram drafts
equals transformers `generate` for 24 concurrent prompts; an identical draft is always accepted."""

import pytest

from client import stream_grpc
from testkit.concurrency import raise_first_error, run_concurrently
from testkit.fidelity import first_mismatch
from testkit.prompts import MIXED_CASES

pytestmark = pytest.mark.integration

SPEC_TOTALS = (
    "llm_spec_decode_num_drafts_total",
    "llm_spec_decode_num_draft_tokens_total",
    "llm_spec_decode_num_accepted_tokens_total",
)


def _spec_deltas(server, model, before):
    after = server.settled_metrics(model)
    return {name: after.get(name, model) - before.get(name, model) for name in SPEC_TOTALS}


@pytest.mark.parametrize("model", ["llm_spec_draft", "llm_spec_ngram"])
def test_greedy_with_speculation_equals_reference(server, reference, model):
    refs = reference.many(MIXED_CASES)
    server.wait_idle(model)
    before = server.metrics()

    def one(prompt, max_tokens):
        return stream_grpc(prompt, server.grpc_url, model, max_tokens=max_tokens, temperature=0.0).completion()

    results = run_concurrently(one, MIXED_CASES)
    raise_first_error(results, f"{model} stream")
    problems = [
        f"#{i} {prompt[:40]!r}: {first_mismatch(got.token_ids, ref.token_ids)}"
        for i, ((prompt, _), ref, got) in enumerate(zip(MIXED_CASES, refs, results))
        if got.token_ids != ref.token_ids
    ]
    assert not problems, f"{model}: {len(problems)} completions differ from transformers:\n" + "\n".join(problems)
    deltas = _spec_deltas(server, model, before)
    assert deltas["llm_spec_decode_num_drafts_total"] > 0, f"{model} never speculated: {deltas}"
    assert deltas["llm_spec_decode_num_accepted_tokens_total"] > 0, f"{model} never accepted a draft: {deltas}"


def test_identical_draft_accepts_all_and_emits_k_plus_one(server, reference):
    """Draft = target (same folder, same dtype): acceptance 1.0 and k + 1 tokens per verification step."""
    model, k, rounds = "llm_spec_same", 4, 5
    prompts = [p for p, _ in MIXED_CASES[:4]]
    server.wait_idle(model)
    before = server.metrics()

    def one(prompt):
        return stream_grpc(
            prompt, server.grpc_url, model, max_tokens=1 + rounds * (k + 1), temperature=0.0, ignore_eos=True
        ).completion()

    results = run_concurrently(one, [(p,) for p in prompts])
    raise_first_error(results, "stream")
    for prompt, got in zip(prompts, results):
        ref = reference.get(prompt, 1 + rounds * (k + 1))
        assert got.token_ids[: len(ref.token_ids)] == ref.token_ids
        # the prefill's token, then whole verified drafts + bonus (k + 1 each); responses still waiting for a
        # slow client go out merged, so a response may carry several steps
        sizes = [c.num_tokens for c in got.chunks if c.num_tokens]
        assert sum(sizes) == 1 + (k + 1) * rounds
        assert all(n % (k + 1) == (1 if i == 0 else 0) for i, n in enumerate(sizes)), sizes
    deltas = _spec_deltas(server, model, before)
    assert deltas["llm_spec_decode_num_drafts_total"] == len(prompts) * rounds
    assert deltas["llm_spec_decode_num_draft_tokens_total"] == len(prompts) * rounds * k
    assert deltas["llm_spec_decode_num_accepted_tokens_total"] == deltas["llm_spec_decode_num_draft_tokens_total"]
    after = server.settled_metrics(model)
    for position in range(k):
        name = "llm_spec_decode_num_accepted_tokens_per_pos_total"
        assert (
            after.get(name, model, position=str(position)) - before.get(name, model, position=str(position))
            == len(prompts) * rounds
        )
