"""Engine faults through the real server, injected by the test-only `fault_injection` parameter of the
`llm_faults` variant (testkit/server_variants.py): a failing step errors its own request only (the others
complete exactly, blocks back to 0, the model stays READY); a dead engine thread answers every request in flight
at once, and the model unloads itself, so that its ready endpoint says not ready at once (the supervised launch
then restarts the server: test_crash_survival.py).

The engine-death test leaves `llm_faults` unloaded for the rest of the session (it is recorded in
`server.unloaded`, which the suite's last leak check skips): it runs last in this file and no other file uses
the variant."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from client import ServerError, generate_grpc, generate_http, stream_grpc
from testkit.concurrency import run_concurrently
from testkit.fidelity import first_mismatch
from testkit.prompts import MIXED_CASES

pytestmark = pytest.mark.integration

MODEL = "llm_faults"
STEP_MARKER = "<<FAIL THIS STEP>>"
DEATH_MARKER = "<<KILL THE ENGINE>>"
GOOD_CASES = [MIXED_CASES[0], MIXED_CASES[3], MIXED_CASES[14], MIXED_CASES[18]]


def model_ready(server, model: str = MODEL) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/ready", timeout=10) as resp:
            return resp.status == 200
    except urllib.error.HTTPError:
        return False


def test_a_failing_step_errors_its_requests_only(server, reference):
    server.wait_idle(MODEL)
    want = reference.many(GOOD_CASES)

    def one(kind: str, prompt: str, max_tokens: int):
        call = generate_grpc if kind == "grpc" else generate_http
        url = server.grpc_url if kind == "grpc" else server.http_url
        try:
            return call(prompt, url, MODEL, max_tokens=max_tokens, temperature=0.0)
        except ServerError as exc:
            return exc

    bad = [("grpc", STEP_MARKER + " hello", 8), ("http", "Tell me: " + STEP_MARKER, 8)]
    good = [("grpc" if i % 2 else "http", p, n) for i, (p, n) in enumerate(GOOD_CASES)]
    results = run_concurrently(one, bad + good)
    for result in results[: len(bad)]:
        assert isinstance(result, ServerError), f"the faulty request completed: {result}"
        assert "internal error while generating: injected step_error" in str(result), str(result)
    for (kind, prompt, _), got, ref in zip(good, results[len(bad) :], want):
        assert not isinstance(got, BaseException), f"{kind} {prompt!r}: {got}"
        assert got.token_ids == ref.token_ids, f"{kind} {prompt!r}: {first_mismatch(got.token_ids, ref.token_ids)}"
    idle = server.wait_idle(MODEL)
    assert idle.get("llm_kv_cache_blocks_used", MODEL) == 0
    assert idle.get("llm_engine_alive", MODEL) == 1
    assert model_ready(server)
    assert (
        generate_grpc("The capital of France is", server.grpc_url, MODEL, max_tokens=3, temperature=0.0).token_ids
        == reference.get("The capital of France is", 3).token_ids
    )


def test_zz_a_dead_engine_thread_fails_every_request_at_once(server):
    server.wait_idle(MODEL)
    in_flight = stream_grpc(
        "Write a long story about a lighthouse.",
        server.grpc_url,
        MODEL,
        max_tokens=500,
        ignore_eos=True,
        temperature=0.0,
    )
    chunks = iter(in_flight)
    next(chunks)  # it is generating
    started = time.monotonic()
    with pytest.raises(ServerError, match="the engine stopped after an internal error .*injected engine_death"):
        generate_grpc(DEATH_MARKER, server.grpc_url, MODEL, max_tokens=4)
    with pytest.raises(ServerError, match="the engine stopped"):
        for _ in chunks:
            pass
    failed_in_s = time.monotonic() - started
    deadline = time.monotonic() + 1.0
    while model_ready(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    unready_s = time.monotonic() - started
    assert not model_ready(server), "llm_faults still says READY 1 s after its engine died"
    server.unloaded.add(MODEL)
    refused = []
    for call, url in ((generate_grpc, server.grpc_url), (generate_http, server.http_url)):
        t0 = time.monotonic()
        with pytest.raises(ServerError, match="llm_faults|the engine stopped"):
            call("Hello", url, MODEL, max_tokens=4)
        refused.append(time.monotonic() - t0)
    assert max(refused) < 1.0, f"new requests took {refused} s to be refused"
    # Unloaded: its metrics (and its KV pool) are gone; the other models go on.
    m = server.wait_for(lambda m: not m.has("llm_kv_cache_blocks_total", MODEL), timeout_s=30)
    assert not m.has("llm_kv_cache_blocks_total", MODEL), "llm_faults was not unloaded in 30 s"
    assert m.get("llm_engine_alive", "llm") == 1
    assert len(generate_grpc("Hi", server.grpc_url, "llm", max_tokens=2, temperature=0.0).token_ids) == 2
    print(
        f"in-flight and dying requests failed {failed_in_s:.2f} s after the fault; the model said not ready "
        f"{unready_s:.2f} s after it; later requests refused in {max(refused) * 1000:.0f} ms"
    )
