"""The OpenAI-compatible front door (frontend/), against the session's real tritonserver, through the official
`openai` SDK and raw HTTP: chat and completions, whole and streamed; n with a seed; stop; logprobs; greedy chat
output against `transformers` `generate` on the chat-templated prompt; concurrent streams; dropped streams
freeing their KV blocks; bad requests answered in OpenAI's error format; a full queue answered 503."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request

import openai
import pytest
import torch

from backend.model.hardware import resolve_for_model
from launcher.paths import MODEL_DIR
from testkit.concurrency import raise_first_error, run_concurrently
from testkit.fidelity import summarize
from testkit.hf_reference import HFReference
from testkit.prompts import MIXED_CASES
from tests.integration.llm_testlib import post, sse_events

pytestmark = pytest.mark.integration

MODEL = "llm"
GREETING = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)


# ------------------------------------------------------------------------------------------- routes, health


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data][:1] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert post(server, "/health", None, method="GET") == (200, {"status": "ok"})
    status, ready = post(server, "/health/ready", None, method="GET")
    assert status == 200 and ready["models"][MODEL] is True
    base = server.openai_url.removesuffix("/v1")
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert "frontdoor_requests_in_flight" in text and "\nllm_kv_cache_blocks_total{" in text  # ours, Triton's
    with urllib.request.urlopen(urllib.request.Request(base + "/metrics", method="HEAD"), timeout=30) as resp:
        assert resp.status == 200  # AIPerf's server-metrics probe sends HEAD


# ----------------------------------------------------------------------------------------- chat, completions


def test_chat_whole_and_streamed_give_the_same_greedy_answer_and_usage(server, client):
    whole = client.chat.completions.create(model=MODEL, messages=GREETING, temperature=0, max_tokens=24)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 10 and 0 < whole.usage.completion_tokens <= 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=GREETING,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2, "not streamed"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason
    ]
    assert chunks[-1].choices == []
    # the same prompt again: the prefix cache the first request filled serves its full blocks, so only the cached
    # count differs (a whole number of 16-token blocks of the prompt, at least the first request's)
    streamed, first = chunks[-1].usage.model_dump(), whole.usage.model_dump()
    cached, cached_before = (u.pop("prompt_tokens_details")["cached_tokens"] for u in (streamed, first))
    assert streamed == first
    assert 0 < cached <= whole.usage.prompt_tokens and cached % 16 == 0 and cached_before <= cached
    assert all(c.usage is None for c in chunks[:-1])

    events = sse_events(
        server, "/v1/chat/completions", {"model": MODEL, "messages": GREETING, "max_tokens": 4, "stream": True}
    )
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_completions_take_a_string_or_a_list_and_echo(client):
    one = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert one.object == "text_completion" and len(one.choices) == 1 and one.choices[0].text
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 8

    prompts = ["The capital of France is", "One, two, three,"]
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, echo=True)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == prompts[0] + one.choices[0].text
    assert many.choices[1].text.startswith(prompts[1]) and len(many.choices[1].text) > len(prompts[1])
    assert many.usage.completion_tokens == 16 and many.usage.prompt_tokens > one.usage.prompt_tokens

    streamed = list(
        client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, echo=True, stream=True)
    )
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in many.choices]


def test_n2_with_a_seed_is_reproducible(client):
    def ask():
        answer = client.chat.completions.create(
            model=MODEL, messages=GREETING, n=2, seed=1234, temperature=1.0, max_tokens=16
        )
        return [c.message.content for c in sorted(answer.choices, key=lambda c: c.index)]

    first = ask()
    assert len(first) == 2 and all(first)
    assert ask() == first
    streamed = client.chat.completions.create(
        model=MODEL, messages=GREETING, n=2, seed=1234, temperature=1.0, max_tokens=16, stream=True
    )
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == first


def test_stop_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16, temperature=0)
    text = full.choices[0].text
    assert " 6" in text, text
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 6"])
    assert cut.choices[0].text == text[: text.index(" 6")]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_come_back(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=GREETING, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely one
        assert t.bytes == list(t.token.encode())

    text = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == text.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) == 2 and max(top.values()) == p for top, p in zip(lp.top_logprobs, lp.token_logprobs))


# ----------------------------------------------------------------------------------------------- fidelity

# `llm` is float32 by configuration; `llm_default` is the default repository, whose dtype `auto` resolves here
# as on this machine's server.
SERVED = [("llm", "float32"), ("llm_default", resolve_for_model(str(MODEL_DIR), "auto", "auto", "cpu")[0])]
CHATS = [[{"role": "user", "content": p}] for p, _ in MIXED_CASES[:6]] + [
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Because air scatters blue light more."},
        {"role": "user", "content": "And sunsets?"},
    ],
]
MAX_TOKENS = 24


@pytest.mark.parametrize("model, dtype", SERVED)
def test_greedy_chat_equals_transformers_generate_on_the_chat_template(client, model, dtype):
    reference = HFReference(MODEL_DIR, getattr(torch, dtype))
    tok = reference.tokenizer

    def one(messages):
        answer = client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            max_tokens=MAX_TOKENS,
            logprobs=True,
            top_logprobs=5,
            extra_body={"return_tokens_as_token_ids": True},
        )
        return answer.choices[0]

    choices = run_concurrently(one, [(m,) for m in CHATS])
    raise_first_error(choices, "chat")
    verdicts = []
    for messages, choice in zip(CHATS, choices):
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok(prompt).input_ids == list(
            tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        )
        want = reference.greedy(prompt, MAX_TOKENS)
        entries = [
            {
                "token_id": int(t.token.removeprefix("token_id:")),
                "top_logprobs": {int(a.token.removeprefix("token_id:")): a.logprob for a in t.top_logprobs},
            }
            for t in choice.logprobs.content
        ]
        ours = [e["token_id"] for e in entries]
        verdict = reference.judge(prompt, ours, want, entries)
        verdicts.append(verdict)
        if verdict.identical:
            assert choice.message.content == tok.decode(want, skip_special_tokens=True)
    print(f"\n[front door chat, {model}, {dtype}] {summarize(verdicts)}")
    rule = (lambda v: v.identical) if dtype == "float32" else (lambda v: v.near_tie)
    bad = [f"#{i}: {v.detail}" for i, v in enumerate(verdicts) if not rule(v)]
    assert not bad, summarize(verdicts) + "\n" + "\n".join(bad)


# -------------------------------------------------------------------------------------------- concurrency


def test_16_concurrent_streams_all_complete(server, client):
    server.wait_idle(MODEL)

    def one(prompt, max_tokens):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0.7,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, reasons, usage = "", [], None
        for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                reasons += [c.finish_reason] if c.finish_reason else []
            usage = chunk.usage or usage
        return text, reasons, usage, max_tokens

    results = run_concurrently(one, [(p, min(m, 32)) for p, m in MIXED_CASES[:16]])
    raise_first_error(results, "stream")
    for text, reasons, usage, max_tokens in results:
        assert text and len(reasons) == 1 and reasons[0] in ("stop", "length")
        assert 0 < usage.completion_tokens <= max_tokens
    server.wait_idle(MODEL)


def _open_stream(server, prompt: str) -> socket.socket:
    """A raw HTTP streaming chat request; returns the socket once the first token's chunk has arrived."""
    url = urllib.parse.urlparse(server.openai_url)
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 1000,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=120)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    received = b""
    while received.count(b"data: ") < 3:  # the role chunk, then tokens
        data = sock.recv(65536)
        assert data, received
        received += data
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    return sock


def test_dropped_streams_free_their_kv_blocks(server, client):
    server.wait_idle(MODEL)
    before = server.settled_metrics(MODEL)
    sockets = [_open_stream(server, p) for p, _ in MIXED_CASES[:8]]
    during = server.metrics()
    assert during.get("llm_kv_cache_blocks_used", MODEL) > 0
    for sock in sockets:
        sock.close()
    after = server.wait_idle(MODEL, timeout_s=30)
    assert after.get("llm_kv_cache_blocks_used", MODEL) == 0, "KV blocks still used after the clients left"
    after = server.settled_metrics(MODEL)
    aborted = after.get("llm_requests_finished_total", MODEL, finish_reason="abort") - before.get(
        "llm_requests_finished_total", MODEL, finish_reason="abort"
    )
    assert aborted == 8, f"{aborted:.0f} requests were aborted, expected the 8 dropped ones"
    generated = after.get("llm_generation_tokens_total", MODEL) - before.get("llm_generation_tokens_total", MODEL)
    assert generated < 8 * 1000 / 2, f"the dropped streams went on generating ({generated:.0f} tokens)"
    answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens == 4


# --------------------------------------------------------------------------------------------------- errors

OK_CHAT = {"model": MODEL, "messages": GREETING, "max_tokens": 4}
BAD_REQUESTS = [  # (what, path, body or raw bytes, expected status)
    ("invalid JSON", "/v1/chat/completions", b"{not json", 400),
    ("body not an object", "/v1/chat/completions", [1, 2], 400),
    ("unknown parameter", "/v1/chat/completions", {**OK_CHAT, "frobnicate": True}, 400),
    ("unknown model", "/v1/chat/completions", {**OK_CHAT, "model": "gpt-4o"}, 404),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400),
    ("temperature out of range", "/v1/chat/completions", {**OK_CHAT, "temperature": -0.5}, 400),
    ("temperature not a number", "/v1/chat/completions", {**OK_CHAT, "temperature": "warm"}, 400),
    ("logit_bias out of range", "/v1/chat/completions", {**OK_CHAT, "logit_bias": {"42": 500}}, 400),
    ("a tool without a function", "/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function"}]}, 400),
    ("n above the model's max_n", "/v1/chat/completions", {**OK_CHAT, "n": 64}, 400),
    (
        "prompt longer than the model",
        "/v1/completions",
        {"model": MODEL, "prompt": "word " * 9000, "max_tokens": 4},
        400,
    ),
    (
        "stream_options without stream",
        "/v1/completions",
        {"model": MODEL, "prompt": "Hi", "stream_options": {"include_usage": True}},
        400,
    ),
    ("token id outside the vocabulary", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 49152]}, 400),
    ("unknown route", "/v1/embeddings", {"model": MODEL, "input": "x"}, 404),
    ("JSON nested 100,000 deep", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),
]


@pytest.mark.parametrize("what, path, body, status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, what, path, body, status):
    got, answer = post(
        server, path, None if isinstance(body, bytes) else body, raw=body if isinstance(body, bytes) else None
    )
    assert got == status, (what, answer)
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"], answer
    print(f"{what}: {got} {error['message'][:120]}")
    assert post(server, "/v1/chat/completions", OK_CHAT)[0] == 200  # and the server keeps answering


def test_wrong_method_and_sdk_errors(server, client):
    status, answer = post(server, "/v1/chat/completions", None, method="GET")
    assert status == 405 and answer["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=GREETING)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=GREETING, top_p=7)
    assert info.value.body["param"] == "top_p" and "top_p" in info.value.body["message"]


def test_a_body_over_the_limit_is_413_and_never_reaches_triton(server):
    before = server.settled_metrics(MODEL)
    huge = json.dumps({"model": MODEL, "prompt": "x" * (8 << 20), "max_tokens": 1}).encode()  # 8 MB
    url = urllib.parse.urlparse(server.openai_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=huge, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, answer = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 413, answer
    assert answer["error"]["code"] == "request_too_large" and "limit" in answer["error"]["message"]
    after = server.settled_metrics(MODEL)
    assert after.get("llm_prompt_tokens_total", MODEL) == before.get("llm_prompt_tokens_total", MODEL)
    assert server.alive()
    assert post(server, "/v1/chat/completions", OK_CHAT)[0] == 200


def test_a_full_queue_is_503(server, client):
    """`llm_small_queue` runs two sequences and lets four wait: a burst of twelve is partly refused at once."""
    model = "llm_small_queue"
    server.wait_idle(model)

    def one(i):
        try:
            client.completions.create(
                model=model, prompt=f"Story {i}:", max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
            )
            return 200
        except openai.APIStatusError as exc:
            return exc.status_code, exc.body

    results = run_concurrently(one, [(i,) for i in range(12)])
    busy = [r for r in results if r != 200]
    assert 200 in results and busy, results
    for status, body in busy:
        assert status == 503 and body["code"] == "server_busy" and "server busy" in body["message"], body
    server.wait_idle(model)
