"""The anthropic SDK's `messages.create` / `messages.stream` / `messages.count_tokens` run against the app, with a
stand-in for the Triton client: whole and streamed answers in Anthropic's event order, stop sequences, tool use,
errors before and after the first token, and the API key as `x-api-key`."""

from __future__ import annotations

import json

import aiohttp
import anthropic
import pytest

from backend.protocol.wire import INTERNAL, SERVER_BUSY, error_text
from tests.unit.responses_requests import WEATHER, call_text
from tests.unit.scripted_llm import ScriptedLLM as FakeLLM
from tests.unit.scripted_llm import sdk_runner

TOOL = {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}
HI = [{"role": "user", "content": "Hi"}]
KEY = "k-anthropic"


@pytest.fixture
def sdk(monkeypatch):
    """run(test): test(client) with an AsyncAnthropic client of the app (its API key set) served with FakeLLM."""
    return sdk_runner(
        monkeypatch, lambda url: anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0), api_key=KEY
    )


def url_of(client: anthropic.AsyncAnthropic) -> str:
    return str(client.base_url).rstrip("/")


def test_whole_and_streamed_answers(sdk):
    async def test(client):
        url = url_of(client)
        whole = await client.messages.create(
            model="llm", max_tokens=5, system="Be brief.", messages=HI, extra_body={"temperature": 0}
        )
        assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
        assert [(b.type, b.text) for b in whole.content] == [("text", "Hello")]
        assert (whole.stop_reason, whole.stop_sequence, whole.model) == ("end_turn", None, "llm")
        assert (whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.cache_read_input_tokens) == (4, 2, 0)
        assert FakeLLM.requests[-1] == ("system:Be brief.|user:Hi", {"temperature": 0, "max_tokens": 5})

        events = [e async for e in await client.messages.create(model="llm", max_tokens=5, messages=HI, stream=True)]
        assert [e.type for e in events] == [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]  # the SDK skips the ping
        assert events[0].message.usage.input_tokens == 4 and events[0].message.stop_reason is None
        assert (events[-2].delta.stop_reason, events[-2].usage.output_tokens) == ("end_turn", 2)

        async with client.messages.stream(model="llm", max_tokens=5, messages=HI) as stream:
            assert [text async for text in stream.text_stream] == ["Hel", "lo"]
            final = await stream.get_final_message()
        assert final.content[0].text == "Hello" and final.usage.output_tokens == 2

        async with aiohttp.ClientSession(headers={"x-api-key": KEY}) as session:
            body = {"model": "llm", "max_tokens": 5, "messages": HI, "stream": True}
            async with session.post(f"{url}/v1/messages", json=body) as resp:
                text = await resp.text()
        names = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
        assert names[:3] == ["message_start", "content_block_start", "ping"] and names[-1] == "message_stop"
        data = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
        assert [d["type"] for d in data] == names  # each event's name is its data's type

    sdk(test)


def test_stop_sequences_and_max_tokens(sdk):
    FakeLLM.texts = ["one, two", ", STOP"]  # the engine keeps the stop string when asked (include_stop_str_in_output)

    async def test(client):
        answer = await client.messages.create(model="llm", max_tokens=9, messages=HI, stop_sequences=["STOP", "never"])
        assert (answer.content[0].text, answer.stop_reason, answer.stop_sequence) == (
            "one, two, ",
            "stop_sequence",
            "STOP",
        )
        assert FakeLLM.requests[-1][1] == {
            "stop": ["STOP", "never"],
            "max_tokens": 9,
            "include_stop_str_in_output": True,
        }
        async with client.messages.stream(model="llm", max_tokens=9, messages=HI, stop_sequences=["STOP"]) as stream:
            assert "".join([text async for text in stream.text_stream]) == "one, two, "
            assert (await stream.get_final_message()).stop_sequence == "STOP"
        FakeLLM.reason = "length"
        cut = await client.messages.create(model="llm", max_tokens=2, messages=HI)
        assert (cut.stop_reason, cut.stop_sequence) == ("max_tokens", None)

    sdk(test)


def test_tool_use_and_count_tokens(sdk):
    written = call_text("get_weather", {"city": "Oslo"})
    FakeLLM.texts = [written[:15], written[15:]]

    async def test(client):
        whole = await client.messages.create(
            model="llm", max_tokens=30, messages=HI, tools=[TOOL], tool_choice={"type": "any"}
        )
        [block] = whole.content
        assert (block.type, block.name, block.input, whole.stop_reason) == (
            "tool_use",
            "get_weather",
            {"city": "Oslo"},
            "tool_use",
        )
        assert block.id.startswith("toolu_") and "guided_grammar" in FakeLLM.requests[-1][1]
        async with client.messages.stream(model="llm", max_tokens=30, messages=HI, tools=[TOOL]) as stream:
            types = [event.type async for event in stream]
            final = await stream.get_final_message()
        assert final.content[0].input == {"city": "Oslo"} and final.stop_reason == "tool_use"
        assert "input_json" in types  # the SDK's own event for an input_json_delta
        followed = [
            *HI,
            {"role": "assistant", "content": final.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny"}]},
        ]
        FakeLLM.texts = ["Sunny."]
        answer = await client.messages.create(model="llm", max_tokens=30, messages=followed, tools=[TOOL])
        assert answer.content[0].text == "Sunny." and "tool:Sunny" not in FakeLLM.requests[-1][0]
        assert "user:<tool_response>\nSunny\n</tool_response>" in FakeLLM.requests[-1][0]
        count = await client.messages.count_tokens(model="llm", messages=followed, tools=[TOOL], system="Be brief.")
        assert count.input_tokens == 4  # the stand-in's one token per turn: system, user, assistant, tool result

    sdk(test)


def test_errors_in_anthropic_shape(sdk):
    async def test(client):
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(model="llm", max_tokens=5, messages=[{"role": "system", "content": "x"}])
        assert (
            info.value.body["error"]["type"] == "invalid_request_error"
            and "'user' or 'assistant'" in info.value.message
        )
        with pytest.raises(anthropic.NotFoundError) as info:
            await client.messages.create(model="nope", max_tokens=5, messages=HI)
        assert info.value.body == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "The model 'nope' does not exist; served: ['llm']"},
        }
        FakeLLM.fail = error_text("server busy: the queue is full", SERVER_BUSY)
        with pytest.raises(anthropic.APIStatusError) as info:  # a refusal before the first token keeps its status
            await client.messages.create(model="llm", max_tokens=5, messages=HI, stream=True)
        assert info.value.status_code == 529 and info.value.body["error"]["type"] == "overloaded_error"
        FakeLLM.fail, FakeLLM.fail_after = None, error_text("internal error: the engine failed", INTERNAL)
        with pytest.raises(anthropic.APIStatusError) as info:  # after it: an error event ends the stream
            async for _ in await client.messages.create(model="llm", max_tokens=5, messages=HI, stream=True):
                pass
        assert info.value.body == {
            "type": "error",
            "error": {"type": "api_error", "message": "internal error: the engine failed"},
        }
        FakeLLM.fail_after = None
        assert (await client.messages.create(model="llm", max_tokens=5, messages=HI)).content[0].text == "Hello"

    sdk(test)


def test_the_api_key_as_x_api_key_or_bearer(sdk):
    async def test(client):
        url = url_of(client)
        wrong = anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as info:
            await wrong.messages.create(model="llm", max_tokens=5, messages=HI)
        assert info.value.body["error"]["type"] == "authentication_error" and "x-api-key" in info.value.message
        assert KEY not in json.dumps(info.value.body)
        await wrong.close()
        bearer = anthropic.AsyncAnthropic(base_url=url, auth_token=KEY, max_retries=0)  # Authorization: Bearer
        assert (await bearer.messages.count_tokens(model="llm", messages=HI)).input_tokens == 1
        await bearer.close()
        async with aiohttp.ClientSession(headers={"x-api-key": KEY}) as session:
            async with session.post(f"{url}/v1/completions", json={"model": "llm", "prompt": "p"}) as resp:
                assert resp.status == 200  # the header is accepted on every route the key guards

    sdk(test)
