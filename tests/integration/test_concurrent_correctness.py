"""Concurrent greedy requests of mixed lengths equal Hugging Face's batch-1 greedy output, token for token,
over gRPC streaming, HTTP generate and HTTP generate_stream; and the engine really batched them."""

import pytest

from client import collect_http, generate_http, stream_grpc
from testkit.concurrency import raise_first_error, run_concurrently
from testkit.fidelity import first_mismatch
from testkit.prompts import LONG_PROMPT_TOKENS, MIXED_CASES

pytestmark = pytest.mark.integration

MODEL = "llm"


@pytest.fixture(scope="module")
def mixed_refs(reference):
    refs = reference.many(MIXED_CASES)
    long_prompts = sum(len(reference.prompt_ids(p)) > LONG_PROMPT_TOKENS for p, _ in MIXED_CASES)
    assert long_prompts >= 4, "the case list must hold several prompts that are prefilled in chunks"
    return refs


def _check_against_reference(cases, refs, completions, label, eos_id):
    problems = []
    for i, ((prompt, max_tokens), ref, got) in enumerate(zip(cases, refs, completions)):
        if got.token_ids != ref.token_ids:
            problems.append(
                f"#{i} ({label}, max_tokens={max_tokens}, prompt {prompt[:40]!r}...): "
                f"{first_mismatch(got.token_ids, ref.token_ids)}"
            )
            continue
        want_reason = "length" if len(ref.token_ids) == max_tokens and ref.token_ids[-1] != eos_id else "stop"
        if got.finish_reason != want_reason:
            problems.append(f"#{i} ({label}): finish_reason {got.finish_reason!r}, expected {want_reason!r}")
    assert not problems, f"{len(problems)} of {len(cases)} completions differ from the reference:\n" + "\n".join(
        problems
    )


def _assert_batched(server, before, label):
    after = server.settled_metrics(MODEL)
    multi = after.multi_sequence_steps(MODEL) - before.multi_sequence_steps(MODEL)
    steps = after.get("llm_step_num_sequences_count", MODEL) - before.get("llm_step_num_sequences_count", MODEL)
    assert multi > 0, (
        f"{label}: none of the {steps:.0f} engine steps held more than one sequence "
        "(llm_step_num_sequences); requests were not batched together"
    )
    return multi, steps


def test_grpc_streaming_concurrent_equals_reference(server, reference, mixed_refs):
    """24 concurrent gRPC streams (one client each), temperature 0: token ids equal HF greedy output."""
    server.wait_idle(MODEL)
    before = server.metrics()

    def one(prompt, max_tokens):
        stream = stream_grpc(prompt, server.grpc_url, MODEL, max_tokens=max_tokens, temperature=0.0)
        return stream.completion()

    results = run_concurrently(one, MIXED_CASES)
    raise_first_error(results, "gRPC stream")
    _check_against_reference(MIXED_CASES, mixed_refs, results, "gRPC stream", reference.tokenizer.eos_token_id)
    for (prompt, _), ref, got in zip(MIXED_CASES, mixed_refs, results):
        assert got.text == ref.text, f"streamed text differs for prompt {prompt[:40]!r}"
        assert got.chunks[-1].is_final and sum(c.is_final for c in got.chunks) == 1
        reasons = [c.finish_reason for c in got.chunks]
        assert reasons[-1] in ("stop", "length") and not any(reasons[:-1]), (
            f"finish_reason must come on the last response only, got {reasons}"
        )
    # Test 3 of the issue: the batch held several sequences at once (from the engine's own histogram).
    _assert_batched(server, before, "gRPC streaming")
    after = server.settled_metrics(MODEL)
    prompt_tokens = after.get("llm_prompt_tokens_total", MODEL) - before.get("llm_prompt_tokens_total", MODEL)
    generated = after.get("llm_generation_tokens_total", MODEL) - before.get("llm_generation_tokens_total", MODEL)
    assert generated == sum(len(r.token_ids) for r in mixed_refs)
    assert prompt_tokens > 0


def test_http_generate_and_generate_stream_concurrent_equal_reference(server, reference, mixed_refs):
    """Each prompt once through POST generate and once through generate_stream, all 48 at the same time."""
    server.wait_idle(MODEL)
    before = server.metrics()
    calls = [("generate", p, mt) for p, mt in MIXED_CASES] + [("stream", p, mt) for p, mt in MIXED_CASES]

    def one(kind, prompt, max_tokens):
        if kind == "generate":
            return generate_http(prompt, server.http_url, MODEL, max_tokens=max_tokens, temperature=0.0)
        return collect_http(prompt, server.http_url, MODEL, max_tokens=max_tokens, temperature=0.0)

    results = run_concurrently(one, calls)
    raise_first_error(results, "HTTP request")
    generated, streamed = results[: len(MIXED_CASES)], results[len(MIXED_CASES) :]
    eos_id = reference.tokenizer.eos_token_id
    _check_against_reference(MIXED_CASES, mixed_refs, generated, "HTTP generate", eos_id)
    _check_against_reference(MIXED_CASES, mixed_refs, streamed, "HTTP generate_stream", eos_id)
    for (prompt, _), ref, whole, parts in zip(MIXED_CASES, mixed_refs, generated, streamed):
        # Non-streaming: the prompt comes first (exclude_input_in_output defaults to false).
        assert whole.text == prompt + ref.text, f"generate text is not prompt + completion for {prompt[:40]!r}"
        assert parts.text == ref.text, f"generate_stream text differs for {prompt[:40]!r}"
        assert whole.num_input_tokens == len(reference.prompt_ids(prompt))
        assert whole.num_output_tokens == len(ref.token_ids)
    _assert_batched(server, before, "HTTP")


def test_exclude_input_in_output(server, mixed_refs):
    prompt, max_tokens = MIXED_CASES[0]
    got = generate_http(
        prompt, server.http_url, MODEL, max_tokens=max_tokens, temperature=0.0, exclude_input_in_output=True
    )
    assert got.text == mixed_refs[0].text
    assert got.token_ids == mixed_refs[0].token_ids
