"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) through the real stack and the
official `anthropic` SDK: greedy text equal to /v1/chat/completions for the same messages, whole, streamed with
`messages.stream` and as raw events in Anthropic's order; stop sequences and max_tokens; a forced tool call whose
input fits its schema, and the conversation going on with its tool_result (the same text as chat's); count_tokens
equal to a real request's input tokens; the API key as x-api-key; bad requests answered 400 in Anthropic's error
shape while the server goes on serving. Every answer is short, and no KV block is left behind."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

import launcher
from launcher.paths import MODEL_DIR
from tests.integration.llm_testlib import post

pytestmark = pytest.mark.integration

MODEL = "llm"
SYSTEM = "Answer briefly."
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
# an enum keeps the constrained call short (each constrained token costs a grammar step)
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "Asia/Tokyo"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOL = {"name": "get_time", "description": "The time in a time zone", "input_schema": ZONE}
TIME_QUESTION = [{"role": "user", "content": "What time is it in Tokyo?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK has no temperature argument: it goes in the body as is
# Anthropic's event order: the message, then each block (start, deltas, stop), then its end
EVENT_ORDER = re.compile(
    r"message_start( content_block_start( content_block_delta)+ content_block_stop)* message_delta message_stop"
)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.openai_url.removesuffix("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)


def blocks_back_to_zero(server) -> None:
    assert server.wait_idle(MODEL).get("llm_kv_cache_blocks_used", MODEL) == 0


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed answer, read off the wire (the SDK hides the pings)."""
    request = urllib.request.Request(
        server.openai_url.removesuffix("/v1") + "/v1/messages",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        frames = resp.read().decode().strip().split("\n\n")
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_greedy_text_equals_chat_whole_and_streamed(server, client, chat):
    reference = chat.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *QUESTION], temperature=0, max_tokens=12
    )
    text = reference.choices[0].message.content
    kw = dict(model=MODEL, system=SYSTEM, messages=QUESTION, max_tokens=12, **GREEDY)
    whole = client.messages.create(**kw)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert [(b.type, b.text) for b in whole.content] == [("text", text)]
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reference.choices[0].finish_reason]
    # Anthropic's input_tokens leave out the prompt tokens read from the (prefix) cache: the sum is the prompt
    assert (whole.usage.input_tokens + whole.usage.cache_read_input_tokens, whole.usage.output_tokens) == (
        reference.usage.prompt_tokens,
        reference.usage.completion_tokens,
    )

    with client.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) >= 2 and "".join(pieces) == text, "not streamed, or not the same text"
    assert final.content[0].text == text and final.usage.output_tokens == whole.usage.output_tokens

    events = list(client.messages.create(**kw, stream=True))
    assert EVENT_ORDER.fullmatch(" ".join(e.type for e in events)), [e.type for e in events]
    start = events[0].message.usage
    assert start.input_tokens + start.cache_read_input_tokens == reference.usage.prompt_tokens
    assert (events[-2].delta.stop_reason, events[-2].usage.output_tokens) == (
        whole.stop_reason,
        whole.usage.output_tokens,
    )

    wire = raw_events(server, {"model": MODEL, "system": SYSTEM, "messages": QUESTION, "max_tokens": 4})
    names = [name for name, _ in wire]
    assert names[:3] == ["message_start", "content_block_start", "ping"] and names[-1] == "message_stop"
    assert all(data["type"] == name for name, data in wire)
    assert EVENT_ORDER.fullmatch(" ".join(n for n in names if n != "ping"))
    blocks_back_to_zero(server)


def test_stop_sequences_and_max_tokens(server, client):
    kw = dict(model=MODEL, system=SYSTEM, messages=QUESTION, **GREEDY)
    free = client.messages.create(**kw, max_tokens=12).content[0].text
    words = re.findall(r"[A-Za-z]{3,}", free)
    assert len(words) >= 2, free
    stop = words[1]  # a word the greedy answer writes: the same answer stops just before it
    stopped = client.messages.create(**kw, max_tokens=12, stop_sequences=["#never#", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == free[: free.index(stop)]
    with client.messages.stream(**kw, max_tokens=12, stop_sequences=[stop]) as stream:
        assert "".join(stream.text_stream) == free[: free.index(stop)]
        assert stream.get_final_message().stop_sequence == stop

    cut = client.messages.create(**kw, max_tokens=3)
    assert (cut.stop_reason, cut.stop_sequence, cut.usage.output_tokens) == ("max_tokens", None, 3)
    blocks_back_to_zero(server)


def test_a_forced_tool_call_and_its_result(server, client, chat):
    kw = dict(model=MODEL, messages=TIME_QUESTION, tools=[TOOL], max_tokens=40, **GREEDY)
    whole = client.messages.create(**kw, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    [call] = whole.content
    assert call.type == "tool_use" and call.name == "get_time" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, ZONE)
    assert whole.stop_reason == "tool_use"
    with client.messages.stream(**kw, tool_choice={"type": "tool", "name": "get_time"}) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].input == call.input and final.stop_reason == "tool_use"
    assert "input_json" in types  # the SDK's event for an input_json_delta

    # the next turn: the call sent back as it came, its result as a tool_result block; chat's equivalent
    # request (the assistant's tool_calls, a tool message) gives the same greedy text
    followed = client.messages.create(
        model=MODEL,
        messages=[
            *TIME_QUESTION,
            {"role": "assistant", "content": whole.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "09:30"}]},
        ],
        tools=[TOOL],
        tool_choice={"type": "none"},
        max_tokens=8,
        **GREEDY,
    )
    arguments = json.dumps(call.input)
    reference = chat.chat.completions.create(
        model=MODEL,
        messages=[
            *TIME_QUESTION,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "09:30"},
        ],
        temperature=0,
        max_tokens=8,
    )
    assert followed.content[0].text == reference.choices[0].message.content
    assert followed.usage.input_tokens + followed.usage.cache_read_input_tokens == reference.usage.prompt_tokens
    blocks_back_to_zero(server)


def test_count_tokens_equals_the_input_tokens_of_a_request(client):
    for kw in (
        dict(system=SYSTEM, messages=QUESTION),
        dict(messages=TIME_QUESTION, tools=[TOOL], tool_choice={"type": "any"}),
    ):
        answer = client.messages.create(model=MODEL, max_tokens=1, **kw, **GREEDY)
        prompt = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
        assert client.messages.count_tokens(model=MODEL, **kw).input_tokens == prompt > 10


@pytest.mark.parametrize(
    "body, message",
    [
        ({"messages": QUESTION, "max_tokens": None}, "max_tokens is required"),
        ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "must be 'user' or 'assistant'"),
        (
            {"messages": QUESTION, "max_tokens": 4, "tools": [TOOL], "tool_choice": {"type": "required"}},
            'tool_choice must be {"type": "auto"}, {"type": "any"}',
        ),
        ({"messages": QUESTION, "max_tokens": 4, "temperature": 3}, "temperature must be from 0 to 1"),
    ],
)
def test_bad_requests_are_400s_in_anthropic_shape(server, client, body, message):
    status, answer = post(server, "/v1/messages", {"model": MODEL, **body})
    assert status == 400 and answer["type"] == "error", answer
    assert answer["error"]["type"] == "invalid_request_error" and message in answer["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:  # the SDK reads it (the body's fields sent as they are)
        client.messages.create(model=MODEL, max_tokens=4, messages=QUESTION, extra_body=body)
    assert message in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4, messages=QUESTION)
    assert client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).content[0].text  # still serving


def test_the_api_key_as_x_api_key(server, monkeypatch, tmp_path):
    key = "k-" + "5" * 30
    monkeypatch.setenv("LLM_API_KEY", key)
    port = launcher.free_port()
    log = tmp_path / "frontend.log"
    proc = launcher.start_frontend(server.grpc_url, port, log, models=(MODEL,), model_dir=MODEL_DIR)
    try:
        launcher.wait_until_frontend_ready(port, proc, 120)
        base = f"http://127.0.0.1:{port}"
        with pytest.raises(anthropic.AuthenticationError) as info:
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.count_tokens(
                model=MODEL, messages=QUESTION
            )
        assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"
        keyed = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)  # sends x-api-key
        assert keyed.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).content[0].text
        request = urllib.request.Request(f"{base}/v1/messages", data=b"{}", method="POST")  # no key at all
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401 and json.loads(refused.value.read())["type"] == "error"
    finally:
        launcher.stop_server(proc, timeout_s=10)
    assert key not in log.read_text()
