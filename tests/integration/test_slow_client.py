"""A client that opens a stream and never reads it stalls nobody: other streams finish with exact output
beside it, the stalled request still finishes generating (its KV blocks come back), and what the server holds
for it is bounded by its own output (max_tokens), not by how long the client stays silent."""

from __future__ import annotations

import json
import socket
import time

import psutil
import pytest

from client import generate_grpc
from testkit.concurrency import run_concurrently
from testkit.fidelity import first_mismatch
from testkit.prompts import MIXED_CASES

pytestmark = pytest.mark.integration

MODEL = "llm"
STALLED_TOKENS = 1500
OTHERS = MIXED_CASES[:4]


def open_stalled_stream(server, max_tokens: int) -> socket.socket:
    """POST generate_stream on a raw socket with a tiny receive buffer, then never read."""
    body = json.dumps(
        {
            "text_input": "Write a very long story about the sea.",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.http_port))
    sock.sendall(
        f"POST /v2/models/{MODEL}/generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def server_rss_mb(server) -> float:
    proc = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def test_a_client_that_never_reads_stalls_no_one(server, reference):
    server.wait_idle(MODEL)
    want = reference.many(OTHERS)
    rss_before = server_rss_mb(server)
    stalled = [open_stalled_stream(server, STALLED_TOKENS) for _ in range(2)]
    try:
        server.wait_for(lambda m: m.get("llm_requests_running", MODEL) >= 2, timeout_s=30)

        def one(prompt, max_tokens):
            return generate_grpc(prompt, server.grpc_url, MODEL, max_tokens=max_tokens, temperature=0.0)

        started = time.monotonic()
        results = run_concurrently(one, OTHERS, timeout_s=120)
        others_s = time.monotonic() - started
        for (prompt, _), got, ref in zip(OTHERS, results, want):
            assert not isinstance(got, BaseException), f"{prompt!r}: {got}"
            assert got.token_ids == ref.token_ids, f"{prompt!r}: {first_mismatch(got.token_ids, ref.token_ids)}"
        # The stalled requests go on generating all their tokens; then their blocks come back.
        idle = server.wait_idle(MODEL, timeout_s=300)
        assert idle.get("llm_kv_cache_blocks_used", MODEL) == 0 and idle.get("llm_requests_running", MODEL) == 0
        grown = server_rss_mb(server) - rss_before
        # Two streams of 1500 SSE events (~300 bytes each) are ~1 MB buffered for clients that never read.
        assert grown < 200, f"server RSS grew {grown:.0f} MiB for two unread streams"
        print(f"other streams finished in {others_s:.1f} s beside 2 unread streams; RSS {grown:+.1f} MiB")
    finally:
        for sock in stalled:
            sock.close()
