"""A client that opens a stream and never reads it stalls nobody: other streams finish with exact output
beside it, the stalled request still finishes generating (its KV blocks come back), and what the server holds
for it is bounded by its own output (max_tokens), not by how long the client stays silent.

Each streamed token is one SSE event of ~100 bytes; the stalled client's 4 KiB receive buffer and the server's
initial 16 KiB send buffer hold a small part of a 600-token stream, so tritonserver itself buffers the rest."""

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
STALLED_TOKENS = 600
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


def tritonserver_rss_mb(server) -> float:
    """The tritonserver process alone: it buffers what a client has not read (the stubs hold model state)."""
    return psutil.Process(server.proc.pid).memory_info().rss / 2**20


def test_a_client_that_never_reads_stalls_no_one(server, reference):
    server.wait_idle(MODEL)
    want = reference.many(OTHERS)
    rss_before = tritonserver_rss_mb(server)
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
        grown = tritonserver_rss_mb(server) - rss_before
        # Two streams of 600 SSE events are ~120 KB buffered for clients that never read; the bound leaves room
        # for the allocator's arenas, not for a copy per step or a buffer that grows with time.
        assert grown < 64, f"tritonserver RSS grew {grown:.0f} MiB for two unread streams"
        # More traffic while the clients stay silent (their requests finished): nothing more may pile up for them.
        again = run_concurrently(one, OTHERS, timeout_s=120)
        assert [got.token_ids for got in again] == [ref.token_ids for ref in want]
        server.wait_idle(MODEL, timeout_s=60)
        assert tritonserver_rss_mb(server) - rss_before < grown + 8, "tritonserver RSS grows while clients stay silent"
        print(f"other streams finished in {others_s:.1f} s beside 2 unread streams; tritonserver RSS {grown:+.1f} MiB")
    finally:
        for sock in stalled:
            sock.close()
