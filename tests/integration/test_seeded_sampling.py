"""Seeded sampling is reproducible: alone or inside a busy batch, and for parallel samples (n > 1)."""

import pytest

from client import generate_grpc, generate_http, stream_grpc
from testkit.concurrency import raise_first_error, run_concurrently
from testkit.prompts import MIXED_CASES

pytestmark = pytest.mark.integration

MODEL = "llm"
SEEDED = dict(temperature=0.8, top_p=0.9, seed=1234)
SEEDED_PROMPT = "Write a short story about a robot who learns to paint."
SEEDED_MAX_TOKENS = 32


def seeded_grpc(server):
    return generate_grpc(SEEDED_PROMPT, server.grpc_url, MODEL, max_tokens=SEEDED_MAX_TOKENS, **SEEDED)


def seeded_http(server):
    return generate_http(
        SEEDED_PROMPT, server.http_url, MODEL, max_tokens=SEEDED_MAX_TOKENS, exclude_input_in_output=True, **SEEDED
    )


def test_seeded_sampling_same_alone_and_in_busy_batch(server, reference):
    server.wait_idle(MODEL)
    alone = seeded_grpc(server)
    assert len(alone.token_ids) > 0
    again = seeded_grpc(server)
    assert again.token_ids == alone.token_ids, "the same seeded request gave two different outputs"

    # Eight long requests (long prompts, chunked; ignore_eos) keep the batch busy meanwhile.
    busy_prompts = [p for p, _ in sorted(MIXED_CASES, key=lambda c: -len(c[0]))[:8]]
    busy = [
        stream_grpc(p, server.grpc_url, MODEL, max_tokens=400, ignore_eos=True, temperature=0.7, seed=i)
        for i, p in enumerate(busy_prompts)
    ]
    try:
        m = server.wait_for(lambda m: m.get("llm_requests_running", MODEL) >= len(busy), timeout_s=120)
        assert m.get("llm_requests_running", MODEL) >= len(busy), "the busy requests did not all start"
        before = server.metrics()
        results = run_concurrently(lambda f: f(server), [(seeded_grpc,), (seeded_http,)])
        raise_first_error(results, "seeded request")
        during = server.metrics()
        assert during.get("llm_requests_running", MODEL) >= len(busy), (
            "the busy requests finished before the seeded ones: the test proved nothing"
        )
        multi = during.multi_sequence_steps(MODEL) - before.multi_sequence_steps(MODEL)
        assert multi > 0
    finally:
        for s in busy:
            s.cancel()
    in_batch_grpc, in_batch_http = results
    assert in_batch_grpc.token_ids == alone.token_ids, "seeded output changed inside a busy batch (gRPC)"
    assert in_batch_grpc.text == alone.text
    assert in_batch_http.token_ids == alone.token_ids, "seeded output changed inside a busy batch (HTTP)"
    assert in_batch_http.text == alone.text
    greedy = reference.get(SEEDED_PROMPT, SEEDED_MAX_TOKENS)
    assert alone.token_ids != greedy.token_ids, "temperature 0.8 gave exactly the greedy output"
    server.wait_idle(MODEL)


def _samples_of_one_response(completion, n):
    """[(sample_index, text, token_ids)] of a non-streaming response that carries all n samples."""
    assert len(completion.chunks) == 1
    raw = completion.chunks[0].raw
    texts, indices, flat_ids = raw["text_output"], raw["sample_index"], raw["output_ids"]
    assert len(texts) == n and len(indices) == n, raw
    width = len(flat_ids) // n
    rows = [[t for t in flat_ids[i * width : (i + 1) * width] if t != -1] for i in range(n)]
    reasons = raw.get("finish_reason", [])
    assert len(reasons) == n and all(reasons), f"finish_reason for every sample expected, got {reasons}"
    return sorted(zip(indices, texts, rows))


N_PROMPT = "My favourite thing about the weekend is"
N_PARAMS = dict(n=4, seed=77, temperature=1.0, max_tokens=16)


def test_n_samples_non_streaming(server):
    first = _samples_of_one_response(generate_http(N_PROMPT, server.http_url, MODEL, **N_PARAMS), 4)
    assert [s[0] for s in first] == [0, 1, 2, 3]
    for _, text, ids in first:
        assert text.startswith(N_PROMPT), "non-streaming text must start with the prompt"
        assert ids
    assert len({tuple(ids) for _, _, ids in first}) == 4, f"the four samples are not all different: {first}"
    second = _samples_of_one_response(generate_http(N_PROMPT, server.http_url, MODEL, **N_PARAMS), 4)
    assert second == first, "a second identical seeded n=4 request gave different samples"
    over_grpc = _samples_of_one_response(generate_grpc(N_PROMPT, server.grpc_url, MODEL, stream=False, **N_PARAMS), 4)
    assert over_grpc == first


def test_n_samples_streaming(server):
    def streamed():
        got = generate_grpc(N_PROMPT, server.grpc_url, MODEL, stream=True, **N_PARAMS)
        assert sorted(got.samples) == [0, 1, 2, 3], f"sample indices {sorted(got.samples)}"
        for index, sample in got.samples.items():
            assert all(c.sample_index == index for c in sample.chunks)
            reasons = [c.finish_reason for c in sample.chunks]
            assert reasons[-1] in ("length", "stop") and not any(reasons[:-1]), (
                f"sample {index}: finish_reason must come on its last response only, got {reasons}"
            )
        assert got.chunks[-1].is_final
        assert sum(c.is_final for c in got.chunks) == 1
        return {i: (s.text, s.token_ids) for i, s in got.samples.items()}

    first = streamed()
    assert len({tuple(ids) for _, ids in first.values()}) == 4, f"the four samples are not all different: {first}"
    assert streamed() == first, "a second identical seeded streaming n=4 request gave different samples"
    # The same seed gives the same samples whether streamed or not.
    whole = _samples_of_one_response(generate_http(N_PROMPT, server.http_url, MODEL, **N_PARAMS), 4)
    for index, text, ids in whole:
        assert first[index] == (text[len(N_PROMPT) :], ids)
