"""The openai SDK's `responses.create` / `responses.stream` run against the app, with a stand-in for the Triton
client: whole and streamed answers, function calls, and errors before and after the first token."""

from __future__ import annotations

import json

import openai
import pytest

from backend.protocol.wire import INTERNAL, SERVER_BUSY, error_text
from tests.unit.responses_requests import TOOL, call_text
from tests.unit.scripted_llm import ScriptedLLM as FakeLLM
from tests.unit.scripted_llm import sdk_runner


@pytest.fixture
def sdk(monkeypatch):
    """run(test): test(client) with an AsyncOpenAI client of the app served with FakeLLM."""
    return sdk_runner(
        monkeypatch, lambda url: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    )


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
