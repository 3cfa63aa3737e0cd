"""The Responses API (`POST /v1/responses`) through the real stack and the official `openai` SDK: greedy text
equal to /v1/chat/completions for the same messages, whole and streamed; a forced tool call, whole and
streamed, and the conversation going on with its output items; a text.format JSON schema answer that parses and
fits; a call cut off by max_output_tokens an incomplete Response (and chat's `length`) without raw markup; the
stateless refusals. Every answer is short, and no KV block is left behind."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "llm"
INSTRUCTIONS = "Answer briefly."
QUESTION = "Name three colours of the rainbow."
# an enum keeps the constrained call short (each constrained token costs a grammar step)
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "Asia/Tokyo"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_time", "description": "The time in a time zone", "parameters": ZONE}
TIME_QUESTION = "What time is it in Tokyo?"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)


def blocks_back_to_zero(server) -> None:
    assert server.wait_idle(MODEL).get("llm_kv_cache_blocks_used", MODEL) == 0


def test_greedy_text_equals_chat_whole_and_streamed(server, client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=12,
    )
    kw = dict(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, temperature=0, max_output_tokens=12)
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == MODEL
    assert whole.output_text == chat.choices[0].message.content
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    length = chat.choices[0].finish_reason == "length"
    assert whole.status == ("incomplete" if length else "completed")
    assert (whole.incomplete_details.reason if length else whole.incomplete_details) == (
        "max_output_tokens" if length else None
    )
    assert whole.instructions == INSTRUCTIONS and whole.max_output_tokens == 12 and whole.temperature == 0

    events = list(client.responses.create(**kw, stream=True))
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text, "not streamed, or not the same text"
    final = events[-1]
    assert final.type == f"response.{whole.status}" and final.response.output_text == whole.output_text
    assert final.response.usage.model_dump() == whole.usage.model_dump()
    blocks_back_to_zero(server)


def test_a_forced_tool_call_whole_and_streamed_and_the_conversation_going_on(server, client):
    kw = dict(
        model=MODEL,
        input=TIME_QUESTION,
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_time"},
        temperature=0,
        max_output_tokens=40,
    )
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ZONE)

    events = list(
        client.responses.create(**{**kw, "tool_choice": "required", "parallel_tool_calls": False}, stream=True)
    )
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ], types
    assert events[2].item.type == "function_call" and events[4].arguments == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments

    # the next turn: the call and its result sent back as output items (the unit tests hold the prompt to chat's)
    answer = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": TIME_QUESTION},
            *whole.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": "09:30"},
        ],
        tools=[TOOL],
        tool_choice="none",
        temperature=0,
        max_output_tokens=8,
    )
    assert answer.output[0].type == "message" and answer.output_text
    blocks_back_to_zero(server)


def test_a_call_cut_off_by_max_tokens_is_incomplete_never_raw_markup(server, client):
    """tool_choice required and too few tokens for the call: the Response is incomplete (max_output_tokens) with
    no markup in it; chat's answer is finish_reason length with no markup in content, whole and streamed."""
    kw = dict(model=MODEL, input=TIME_QUESTION, tools=[TOOL], tool_choice="required", temperature=0)
    whole = client.responses.create(**kw, max_output_tokens=5)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert "<tool_call" not in whole.model_dump_json() and whole.output_text == ""
    events = list(client.responses.create(**kw, max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == (
        "max_output_tokens"
    )
    assert not any("<tool_call" in event.model_dump_json() for event in events)

    chat_tool = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    chat_kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": TIME_QUESTION}],
        tools=[chat_tool],
        tool_choice="required",
        temperature=0,
        max_tokens=5,
    )
    answer = client.chat.completions.create(**chat_kw)
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert "<tool_call" not in (choice.message.content or "")
    chunks = list(client.chat.completions.create(**chat_kw, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call" not in content and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    blocks_back_to_zero(server)


def test_a_json_schema_text_format_answer_parses_and_fits(server, client):
    schema = {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    reply = client.responses.create(
        model=MODEL,
        input="Pick a colour and a count.",
        temperature=0,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
    )
    assert reply.status == "completed" and reply.text.format.type == "json_schema"
    jsonschema.validate(json.loads(reply.output_text), schema)
    blocks_back_to_zero(server)


@pytest.mark.parametrize(
    "kw, param, code",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "unsupported_parameter"),
        ({"store": True}, "store", "unsupported_parameter"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "unsupported_parameter"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate", "unknown_parameter"),
    ],
)
def test_stateful_and_unsupported_requests_are_400s(client, kw, param, code):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, **kw)
    assert (info.value.body["param"], info.value.body["code"]) == (param, code)
    if param in ("previous_response_id", "store"):
        assert "stateless" in info.value.message
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False).output_text
