"""frontend/responses_api.py and responses_output.py: Responses API bodies mapped onto the chat path (the same
prompt as the equivalent chat request), every refusal a 400 naming the parameter, and the answers in the
openai SDK's own types: the Response and each stream event validated with its pydantic models, and the SDK's
`responses.create` / `responses.stream` run against the app with a stand-in for the Triton client."""

from __future__ import annotations

import asyncio
import json

import openai
import pydantic
import pytest
from aiohttp.test_utils import TestServer
from openai.types.responses import Response, ResponseStreamEvent

from backend.protocol.wire import INTERNAL, SERVER_BUSY, error_text
from frontend import app as app_module
from frontend.app import Settings, create_app
from frontend.errors import APIError
from frontend.openai_protocol import parse_chat
from frontend.responses_api import parse_responses
from frontend.responses_output import OutputItems, ResponseAnswer
from frontend.tools import CALL_CLOSE, CALL_OPEN
from frontend.triton_stream import EngineError, SampleDelta

SERVED = ["llm"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def render(messages: list[dict]) -> str:
    """A stand-in chat template: role: content lines, then the assistant's turn."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def responses(**body):
    return parse_responses({"model": "llm", "input": "Hi", **body}, SERVED, 256, render)


def refused(**body) -> APIError:
    with pytest.raises(APIError) as info:
        responses(**body)
    return info.value


def call_text(name: str, arguments: dict) -> str:
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


# ------------------------------------------------------------------------------------------------- parsing


def test_input_instructions_and_sampling_map_onto_a_chat_generation():
    parsed = responses(
        instructions="Be brief.",
        temperature=0,
        top_p=0.5,
        max_output_tokens=12,
        stream=True,
        metadata={"k": "v"},
        user="u1",
        safety_identifier="s1",
        store=False,
        truncation="disabled",
    )
    g = parsed.generation
    assert g.prompts == ["system: Be brief.\nuser: Hi\nassistant:"]
    assert g.sampling == {"temperature": 0, "top_p": 0.5, "max_tokens": 12}
    assert (g.n, g.stream, g.logprobs, g.tool_calling) == (1, True, None, None)
    assert parsed.settings["metadata"] == {"k": "v"} and parsed.settings["instructions"] == "Be brief."
    assert parsed.settings["max_output_tokens"] == 12 and parsed.settings["text"] == {"format": {"type": "text"}}
    default = responses()
    assert default.generation.sampling == {"max_tokens": 256} and not default.generation.stream
    assert default.settings["max_output_tokens"] is None and default.settings["temperature"] == 1.0


def test_message_items_give_the_same_prompt_as_chat():
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "c", "annotations": [], "logprobs": []}],
        },
        {"role": "user", "content": "d"},
    ]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ]
    assert (
        responses(input=items).generation.prompts
        == parse_chat({"model": "llm", "messages": chat}, SERVED, 8, render).prompts
    )


def test_a_tool_conversation_gives_the_same_prompt_as_chat():
    items = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
            "status": "completed",
        },
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "-3 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20 C"}]},
    ]
    chat = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
                }
                for i, city in ((1, "Oslo"), (2, "Rome"))
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "20 C"},
    ]
    mine = responses(input=items, tools=[TOOL], instructions="Be brief.").generation
    theirs = parse_chat(
        {"model": "llm", "messages": [{"role": "system", "content": "Be brief."}] + chat, "tools": [CHAT_TOOL]},
        SERVED,
        8,
        render,
    )
    assert mine.prompts == theirs.prompts and mine.tool_calling == theirs.tool_calling
    assert "<tool_response>\n20 C\n</tool_response>" in mine.prompts[0]


def test_tools_and_tool_choice_in_the_flat_shape():
    auto = responses(tools=[TOOL])
    assert auto.generation.tool_calling.choice == "auto" and "guided_grammar" not in auto.generation.sampling
    assert auto.settings["tools"] == [
        {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER, "strict": None}
    ]
    assert auto.settings["tool_choice"] == "auto" and auto.settings["parallel_tool_calls"] is True
    named = responses(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    assert named.generation.tool_calling.choice == "get_weather" and not named.generation.tool_calling.parallel
    assert "guided_grammar" in named.generation.sampling
    assert named.settings["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert "guided_grammar" in responses(tools=[TOOL], tool_choice="required").generation.sampling
    none = responses(tools=[TOOL], tool_choice="none")
    assert none.generation.tool_calling is None and none.generation.prompts == ["user: Hi\nassistant:"]


def test_text_format_becomes_a_structured_output_key():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    parsed = responses(text={"format": fmt})
    assert parsed.generation.sampling["guided_json"] == schema and parsed.settings["text"] == {"format": fmt}
    assert responses(text={"format": {"type": "json_object"}}).generation.sampling["guided_json_object"] is True
    assert responses(text={"format": {"type": "text"}}).generation.sampling == {"max_tokens": 256}
    assert responses(text={"format": fmt}, tools=[TOOL], tool_choice="none").generation.sampling["guided_json"]


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
        ({"store": True}, "store", "unsupported_parameter"),
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"messages": []}, "messages", "unknown_parameter"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "unsupported_parameter"),
        ({"include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "unsupported_parameter"),
        ({"tools": [CHAT_TOOL]}, "tools[0]", None),
        ({"tools": [{**TOOL, "defer_loading": True}]}, "tools[0].defer_loading", "unsupported_parameter"),
        ({"tools": [{**TOOL, "name": "has space"}]}, "tools[0].name", None),
        ({"tools": [TOOL, TOOL]}, "tools", None),
        ({"tools": []}, "tools", None),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", None),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice", None),
        ({"tools": [TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "unsupported_parameter"),
        ({"tools": [TOOL], "text": {"format": {"type": "json_object"}}}, "text.format", None),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", None),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", None),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", None),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "unsupported_parameter"),
        ({"input": []}, "input", None),
        ({"input": ""}, "input", None),
        ({"input": 5}, "input", None),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "unsupported_parameter"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", None),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
            "unsupported_parameter",
        ),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name", "unsupported_parameter"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments", None),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output", None),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", None),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options", "unsupported_parameter"),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"max_output_tokens": "8"}, "max_output_tokens", None),
        ({"temperature": -1}, "temperature", None),
        ({"top_p": 0}, "top_p", None),
        ({"metadata": {"k": 1}}, "metadata", None),
        ({"model": None}, "model", None),
    ],
)
def test_bad_fields_are_400s_naming_the_parameter(body, param, code):
    err = refused(**body)
    assert (err.status, err.type, err.param, err.code) == (400, "invalid_request_error", param, code), err.body()
    assert err.message


def test_the_stateless_refusals_say_why():
    assert "stateless" in refused(previous_response_id="resp_1").message
    assert "stateless" in refused(store=True).message
    assert "flat" in refused(tools=[CHAT_TOOL]).message


def test_an_unknown_model_is_404():
    err = refused(model="gpt-4o")
    assert (err.status, err.code) == (404, "model_not_found")


# -------------------------------------------------------------------------------------------------- shapes


def delta(text: str, reason: str | None = None, n_out: int = 1) -> SampleDelta:
    return SampleDelta(0, text, [1], 5, n_out, reason, None)


def run_answer(texts: list[str], reason: str = "stop", **body) -> tuple[ResponseAnswer, list[dict]]:
    answer = ResponseAnswer(responses(**body))
    events = answer.opening()
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        events += answer.add(delta(text, reason if last else None, i + 1))
    events.append(answer.closing())
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
    cut, _ = run_answer([calls[0][:20]], reason="length", tools=[TOOL], tool_choice="required")
    assert cut.body()["output"][0]["content"][0]["text"] == calls[0][:20]  # a cut-off call stays text


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


# -------------------------------------------------------------------------- the SDK against the app


class Tokenizer:
    def render_chat(self, messages):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    def token_text(self, token_id):
        return str(token_id)


class FakeLLM:
    """Answers with the pieces of `texts`, one delta each (the last with `reason`); records each request."""

    texts = ["Hel", "lo"]
    reason = "stop"
    fail: str | None = None  # an engine error, before the first delta
    fail_after: str | None = None  # an engine error, after the first delta
    requests: list = []

    def __init__(self, url):
        pass

    async def close(self):
        pass

    async def is_model_ready(self, model):
        return True

    async def model_parameters(self, model):
        return {}

    async def generate(self, model, prompt, sampling, n):
        FakeLLM.requests.append((prompt, sampling))
        if self.fail:
            raise EngineError(self.fail)
        for i, text in enumerate(self.texts):
            last = i == len(self.texts) - 1
            yield SampleDelta(0, text, [i], 4, i + 1, self.reason if last else None, None)
            if self.fail_after:
                raise EngineError(self.fail_after)


@pytest.fixture
def sdk(monkeypatch):
    """run(test): test(client) with an AsyncOpenAI client of the app served with FakeLLM."""
    FakeLLM.texts, FakeLLM.reason, FakeLLM.fail, FakeLLM.fail_after, FakeLLM.requests = (
        ["Hel", "lo"],
        "stop",
        None,
        None,
        [],
    )
    monkeypatch.setattr(app_module, "TritonLLM", FakeLLM)

    def run(test):
        async def main():
            server = TestServer(
                create_app(Settings("unused:1", SERVED, "unused"), Tokenizer()), handler_cancellation=True
            )
            await server.start_server()
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
            try:
                await test(client)
            finally:
                await client.close()
                await server.close()

        asyncio.run(main())

    return run


def test_the_sdk_reads_whole_and_streamed_answers(sdk):
    async def test(client):
        whole = await client.responses.create(
            model="llm", input="Hi", instructions="Be brief.", max_output_tokens=5, temperature=0
        )
        assert whole.output_text == "Hello" and whole.status == "completed" and whole.usage.output_tokens == 2
        assert FakeLLM.requests[-1] == ("system:Be brief.|user:Hi", {"temperature": 0, "max_tokens": 5})
        events = [e async for e in await client.responses.create(model="llm", input="Hi", stream=True)]
        assert [type(e).__name__ for e in events[:3]] == [
            "ResponseCreatedEvent",
            "ResponseInProgressEvent",
            "ResponseOutputItemAddedEvent",
        ]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
        assert type(events[-1]).__name__ == "ResponseCompletedEvent" and events[-1].response.output_text == "Hello"
        async with client.responses.stream(model="llm", input="Hi") as stream:
            final = await stream.get_final_response()
        assert final.output_text == "Hello" and final.usage.total_tokens == 6

    sdk(test)


def test_the_sdk_reads_function_calls(sdk):
    FakeLLM.texts = [call_text("get_weather", {"city": "Oslo"})[:15], call_text("get_weather", {"city": "Oslo"})[15:]]

    async def test(client):
        whole = await client.responses.create(model="llm", input="Weather?", tools=[TOOL], tool_choice="required")
        [call] = whole.output
        assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Oslo"}
        async with client.responses.stream(
            model="llm",
            input="Weather?",
            tools=[{**TOOL, "strict": True}],
            tool_choice={"type": "function", "name": "get_weather"},
        ) as stream:
            types = [event.type async for event in stream]
            final = await stream.get_final_response()
        assert final.output[0].parsed_arguments == {"city": "Oslo"}  # the SDK parsed the strict tool's arguments
        assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"

    sdk(test)


def test_errors_through_the_sdk(sdk):
    async def test(client):
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model="llm", input="Hi", store=True)
        assert info.value.body["param"] == "store" and "stateless" in info.value.message
        FakeLLM.fail = error_text("server busy: the queue is full", SERVER_BUSY)
        with pytest.raises(openai.InternalServerError) as info:  # a refusal before the first token keeps its 503
            await client.responses.create(model="llm", input="Hi", stream=True)
        assert info.value.status_code == 503
        FakeLLM.fail, FakeLLM.fail_after = None, error_text("internal error: the engine failed", INTERNAL)
        events = [e async for e in await client.responses.create(model="llm", input="Hi", stream=True)]
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert events[-1].response.error.message == "internal error: the engine failed"

    sdk(test)


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
