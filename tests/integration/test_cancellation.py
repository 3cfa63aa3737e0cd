"""Streams cancelled mid-generation (gRPC stop_stream(cancel_requests=True)) leave the batch and free their
KV blocks; the server keeps serving."""

import time

import pytest

from client import generate_grpc, generate_http, stream_grpc, stream_http
from testkit.prompts import MIXED_CASES

pytestmark = pytest.mark.integration

MODEL = "llm"
NUM_STREAMS = 16
MAX_TOKENS = 1000  # far more than they get to produce: only cancellation can end them in time
TOKENS_BEFORE_CANCEL = 3


def test_cancelled_streams_free_their_blocks(server):
    server.wait_idle(MODEL)
    before = server.metrics()
    prompts = [p for p, _ in MIXED_CASES[:NUM_STREAMS]]
    streams = [
        stream_grpc(p, server.grpc_url, MODEL, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0) for p in prompts
    ]
    received = []
    try:
        iterators = [iter(s) for s in streams]
        for it in iterators:
            tokens = 0
            while tokens < TOKENS_BEFORE_CANCEL:
                chunk = next(it)
                assert chunk.finish_reason is None, "a stream ended before it was cancelled"
                tokens += len(chunk.token_ids)
            received.append(tokens)
        during = server.metrics()
        assert during.get("llm_requests_running", MODEL) > 0
        assert during.get("llm_kv_cache_blocks_used", MODEL) > 0
    finally:
        cancelled_at = time.monotonic()
        for s in streams:
            s.cancel()

    after = server.wait_idle(MODEL, timeout_s=30)
    freed_after_s = time.monotonic() - cancelled_at
    assert after.get("llm_kv_cache_blocks_used", MODEL) == 0, (
        f"{after.get('llm_kv_cache_blocks_used', MODEL):.0f} KV blocks still used 30 s after cancelling"
    )
    assert after.get("llm_requests_running", MODEL) == 0
    assert after.get("llm_requests_waiting", MODEL) == 0
    generated = after.get("llm_generation_tokens_total", MODEL) - before.get("llm_generation_tokens_total", MODEL)
    assert generated < NUM_STREAMS * MAX_TOKENS / 2, f"the cancelled streams went on generating ({generated:.0f})"
    aborted = after.get("llm_requests_finished_total", MODEL, finish_reason="abort") - before.get(
        "llm_requests_finished_total", MODEL, finish_reason="abort"
    )
    assert aborted == NUM_STREAMS, f"{aborted:.0f} requests finished as aborted, expected {NUM_STREAMS}"
    print(f"blocks freed {freed_after_s:.2f} s after cancelling; {generated:.0f} tokens generated in all")

    got = generate_grpc("The capital of France is", server.grpc_url, MODEL, max_tokens=8, temperature=0.0)
    assert len(got.token_ids) == 8 and got.finish_reason == "length"


def test_dropped_http_stream_is_cancelled(server):
    """Closing a generate_stream connection mid-generation cancels the request and frees its blocks."""
    server.wait_idle(MODEL)
    before = server.metrics()
    streams = [
        stream_http(p, server.http_url, MODEL, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
        for p, _ in MIXED_CASES[:4]
    ]
    try:
        for s in streams:
            for _ in range(TOKENS_BEFORE_CANCEL):
                assert next(s).finish_reason is None
        assert server.metrics().get("llm_kv_cache_blocks_used", MODEL) > 0
    finally:
        for s in streams:
            s.close()  # drops the connection
    after = server.wait_idle(MODEL, timeout_s=30)
    assert after.get("llm_kv_cache_blocks_used", MODEL) == 0
    assert after.get("llm_requests_running", MODEL) == 0
    aborted = after.get("llm_requests_finished_total", MODEL, finish_reason="abort") - before.get(
        "llm_requests_finished_total", MODEL, finish_reason="abort"
    )
    assert aborted == len(streams)
    got = generate_http("The capital of France is", server.http_url, MODEL, max_tokens=8, temperature=0.0)
    assert len(got.token_ids) == 8
