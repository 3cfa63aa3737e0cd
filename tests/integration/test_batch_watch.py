"""The batch view's watch request against the real tritonserver (docs/batch_view.md): a gRPC stream with
the request parameter `"batch_view": true` gets the engine summary, then a record per step while other
clients' requests run (prefill chunks with contiguous ranges, decodes, speculative verifications with
drafted / accepted counts); the same works over HTTP `generate_stream`; a cancelled watch leaves the
server serving."""

from __future__ import annotations

import http.client
import json
import uuid

from client.api import generate_http
from testkit.concurrency import raise_first_error, run_concurrently
from tests.integration.llm_testlib import WATCH, Watch


def by_request(steps: list[dict]) -> dict[str, list[dict]]:
    cells: dict[str, list[dict]] = {}
    for step in steps:
        for entry in step["seqs"]:
            cells.setdefault(entry["request_id"], []).append(entry)
    return cells


def test_a_watch_sees_prefill_chunks_and_decodes_of_concurrent_requests(server):
    watch = Watch(server.grpc_url, "llm")
    try:
        summary = watch.next()
        assert summary["type"] == "config" and summary["token_budget"] == 64 and summary["kv_blocks_total"] > 0
        nonce = uuid.uuid4().hex[:8]
        prompts = [
            f"({nonce}) Hello!",
            f"({nonce}) Count slowly from one to twenty: one, two, three,",
            f"({nonce}) " + "The history of the printing press is long and full of surprises. " * 6,
        ]
        results = run_concurrently(
            lambda p: generate_http(p, server.http_url, "llm", max_tokens=8, temperature=0, ignore_eos=True),
            [(p,) for p in prompts],
        )
        raise_first_error(results)
        steps = watch.steps_until_finished(len(prompts))
    finally:
        watch.close()
    cells = by_request(steps)
    assert len(cells) == len(prompts)
    lengths = sorted(r.num_input_tokens for r in results)
    assert sorted(c[0]["prompt_tokens"] for c in cells.values()) == lengths and lengths[-1] > 64
    for entries in cells.values():
        kinds = [e["kind"] for e in entries]
        num_chunks = kinds.count("prefill")
        assert kinds == ["prefill"] * num_chunks + ["decode"] * 7, kinds  # the first token comes with the prompt
        chunks = entries[:num_chunks]
        assert chunks[-1]["end"] == chunks[0]["prompt_tokens"]
        assert all(a["end"] == b["start"] for a, b in zip(chunks, chunks[1:]))
        assert [e["finished"] for e in entries] == [False] * (len(entries) - 1) + [True]
    longest = max(cells.values(), key=lambda c: c[0]["prompt_tokens"])
    assert sum(e["kind"] == "prefill" for e in longest) >= 2  # longer than the budget: chunked
    for step in steps:
        assert step["num_tokens"] == sum(e["tokens"] for e in step["seqs"]) <= step["token_budget"] == 64
        assert 0 <= step["kv_blocks_used"] <= step["kv_blocks_total"] and step["step_ms"] > 0
    assert any(len(step["seqs"]) > 1 for step in steps)
    assert [s["step"] for s in steps] == list(range(steps[0]["step"], steps[0]["step"] + len(steps)))
    assert generate_http("Still serving?", server.http_url, "llm", max_tokens=2).text  # after the cancel


def test_a_watch_sees_speculative_verifications(server):
    watch = Watch(server.grpc_url, "llm_spec_same")  # draft = the target in float32: every draft is accepted
    try:
        assert watch.next()["num_speculative_tokens"] == 4
        result = generate_http(
            f"({uuid.uuid4().hex[:8]}) Tell me about the sea.",
            server.http_url,
            "llm_spec_same",
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
        )
        assert result.num_output_tokens == 12
        steps = watch.steps_until_finished(1)
    finally:
        watch.close()
    verifies = [e for s in steps for e in s["seqs"] if e["kind"] == "verify"]
    assert verifies
    assert all(1 <= e["drafted"] <= 4 and e["accepted"] == e["drafted"] == e["tokens"] - 1 for e in verifies)


def test_a_watch_over_http_generate_stream(server):
    host, port = server.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(
            "POST",
            "/v2/models/llm/generate_stream",
            json.dumps({"text_input": "", **WATCH}),
            {"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        assert response.status == 200
        line = response.readline().decode()
        assert line.startswith("data: "), line
        records = json.loads(json.loads(line[len("data: ") :])["text_output"])["records"]
        assert records[0]["type"] == "config" and records[0]["token_budget"] == 64
    finally:
        conn.close()  # a dropped connection cancels the watch
    server.wait_idle("llm")
    assert generate_http("And still serving?", server.http_url, "llm", max_tokens=2).text
