"""frontend/responses_output.py: the answers in the openai SDK's own types, the Response and each stream event
validated with its pydantic models: text, tool calls as function_call items, incomplete and failed responses,
and output items sent back as input."""

from __future__ import annotations

import json

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from frontend.errors import APIError
from frontend.responses_output import OutputItems, ResponseAnswer
from frontend.triton_stream import SampleDelta
from tests.unit.responses_requests import TOOL, call_text, responses

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def delta(text: str, reason: str | None = None, n_out: int = 1) -> SampleDelta:
    return SampleDelta(0, text, [1], 5, n_out, reason, None)


def run_answer(texts: list[str], reason: str = "stop", **body) -> tuple[ResponseAnswer, list[dict]]:
    answer = ResponseAnswer(responses(**body))
    events = answer.opening()
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        events += answer.add(delta(text, reason if last else None, i + 1))
    events += answer.closing()
    for number, event in enumerate(events):
        event["sequence_number"] = number
        EVENTS.validate_python(event)  # the SDK's own models, strictly
    return answer, events


def test_a_text_answer_is_one_message_item_and_sdk_valid():
    answer, events = run_answer(["Hel", "lo", "!"])
    body = answer.body()
    response = Response.model_validate(body)
    assert response.output_text == "Hello!" and response.status == "completed" and response.id.startswith("resp_")
    assert body["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    }
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["usage"] is None
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello!"
    message = body["output"][0]
    assert message["id"].startswith("msg_") and message["status"] == "completed"
    assert {e.get("item_id") for e in events[3:-2]} == {message["id"]}
    assert events[-2]["item"] == message and events[-1]["response"]["output"] == [message]


def test_max_output_tokens_makes_an_incomplete_response():
    answer, events = run_answer(["a", "b"], reason="length", max_output_tokens=2)
    body = answer.body()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["max_output_tokens"] == 2
    assert events[-1]["type"] == "response.incomplete" and Response.model_validate(body).output_text == "ab"


def test_an_empty_answer_still_has_a_message():
    answer, _ = run_answer([""])
    assert Response.model_validate(answer.body()).output_text == "" and len(answer.body()["output"]) == 1


def test_tool_calls_become_function_call_items_around_the_text():
    call = call_text("get_weather", {"city": "Oslo"})
    texts = ["Let me check.", "\n" + call[:9], call[9:], "\n", call_text("get_weather", {"city": "Rome"}), "\n"]
    answer, events = run_answer(texts, tools=[TOOL])
    body = answer.body()
    response = Response.model_validate(body)
    assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
    assert response.output_text == "Let me check.\n"
    first, second = response.output[1:]
    assert (first.name, json.loads(first.arguments), first.status) == ("get_weather", {"city": "Oslo"}, "completed")
    assert first.call_id.startswith("call_") and first.id.startswith("fc_") and second.arguments == '{"city": "Rome"}'
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == [first.arguments, second.arguments]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2] and added[1]["item"]["status"] == "in_progress"
    # the whole answer is the same whatever the pieces the text came in
    whole, _ = run_answer(["".join(texts)], tools=[TOOL])
    assert [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in whole.body()["output"]] == [
        {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in body["output"]
    ]


def test_forced_calls_drop_the_newlines_between_them():
    calls = [call_text("get_weather", {"city": c}) for c in ("Oslo", "Rome")]
    answer, _ = run_answer([calls[0], "\n", calls[1]], tools=[TOOL], tool_choice="required")
    assert [item["type"] for item in answer.body()["output"]] == ["function_call", "function_call"]


@pytest.mark.parametrize("pieces", [1, 4])
def test_a_call_cut_off_by_max_output_tokens_is_an_incomplete_response_without_markup(pieces):
    text = call_text("get_weather", {"city": "Oslo"})[:24]  # tool_choice required, max_output_tokens reached
    size = -(-len(text) // pieces)
    chunks = [text[i : i + size] for i in range(0, len(text), size)]
    cut, events = run_answer(chunks, reason="length", tools=[TOOL], tool_choice="required", max_output_tokens=4)
    body = cut.body()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(item["type"], item["status"]) for item in body["output"]] == [("message", "incomplete")]
    assert body["output"][0]["content"][0]["text"] == ""  # the cut call is dropped, never shown as text
    assert "<tool_call>" not in json.dumps(events)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"] == body


def test_calls_before_the_one_max_output_tokens_cut_stay_function_calls():
    first = call_text("get_weather", {"city": "Oslo"})
    texts = [first, "\n", call_text("get_weather", {"city": "Rome"})[:20]]
    cut, events = run_answer(texts, reason="length", tools=[TOOL], tool_choice="required")
    body = cut.body()
    assert body["status"] == "incomplete" and [item["type"] for item in body["output"]] == ["function_call"]
    assert json.loads(body["output"][0]["arguments"]) == {"city": "Oslo"} and "<tool_call>" not in json.dumps(events)


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    answer = ResponseAnswer(responses())
    answer.add(delta("partial"))
    events = answer.failed(APIError(500, "internal error: boom", "internal_server_error"))
    for number, event in enumerate(events):
        EVENTS.validate_python({**event, "sequence_number": number})
    assert events[0]["type"] == "error" and events[0]["message"] == "internal error: boom"
    failed = events[1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "partial" and failed["output"][0]["status"] == "in_progress"


def test_output_items_alone():
    items = OutputItems(None)
    assert items.feed("  ") and items.output()[0]["content"][0]["text"] == "  "  # no tools: text as it is


def test_output_items_sent_back_as_the_sdk_dumps_them_are_accepted():
    answer, _ = run_answer([call_text("get_weather", {"city": "Oslo"})], tools=[TOOL])
    output = [item.model_dump() for item in Response.model_validate(answer.body()).output]  # nulls included
    parsed = responses(
        input=[
            {"role": "user", "content": "Weather?"},
            *output,
            {"type": "function_call_output", "call_id": output[0]["call_id"], "output": "-3 C"},
        ],
        tools=[TOOL],
    )
    assert '"arguments": {"city": "Oslo"}' in parsed.generation.prompts[0]
