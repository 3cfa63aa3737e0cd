"""Reasoning through the front door, read by the openai and anthropic SDKs, with a scripted stand-in for Triton
(tests/unit/scripted_llm.py) and a chat template that opens `<think>` in the prompt: chat's reasoning_content
(whole and streamed) and reasoning tokens, chat_template_kwargs, the Responses API's reasoning item and events,
Anthropic's thinking block, and nothing changed with `reasoning_parser: none`."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.unit.responses_requests import CHAT_TOOL, call_text
from tests.unit.scripted_llm import ScriptedLLM as FakeLLM
from tests.unit.scripted_llm import sdk_runner

THOUGHT = ["Let me ", "think.", "</think>", "\n\n", "Hello"]  # one token each


class Tokenizer:
    """A template that opens `<think>` for the answer, or writes the empty pair with enable_thinking false."""

    vocab_size = 100
    chat_template = "{{ messages }}{% if enable_thinking is false %}<think></think>{% else %}<think>{% endif %}"

    def render_chat(self, messages, template_kwargs=None):
        thinking = (template_kwargs or {}).get("enable_thinking", True)
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + (
            "<think>" if thinking else "<think></think>"
        )

    def encode(self, text):
        return list(range(len(text.split("|"))))

    def decode(self, token_ids):
        return "".join(FakeLLM.texts[i] for i in token_ids)

    def token_text(self, token_id):
        return str(token_id)


def openai_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def anthropic_client(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


def runner(monkeypatch, make_client, **settings):
    """sdk_runner with the thinking template's tokenizer, the model answering THOUGHT."""
    run = sdk_runner(monkeypatch, make_client, Tokenizer(), **settings)
    FakeLLM.texts = list(THOUGHT)
    return run


@pytest.fixture
def oai(monkeypatch):
    return runner(monkeypatch, openai_client)


@pytest.fixture
def claude(monkeypatch):
    return runner(monkeypatch, anthropic_client)


HI = [{"role": "user", "content": "Hi"}]


def test_chat_splits_the_reasoning_whole_and_streamed(oai):
    async def test(client):
        whole = await client.chat.completions.create(model="llm", messages=HI)
        message = whole.choices[0].message
        assert (message.reasoning_content, message.content) == ("Let me think.", "Hello")
        assert whole.usage.completion_tokens == 5 and whole.usage.completion_tokens_details.reasoning_tokens == 2
        chunks = [c async for c in await client.chat.completions.create(model="llm", messages=HI, stream=True)]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        thought = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
        answer = [d.content for d in deltas if d.content]
        assert thought == ["Let me ", "think."] and answer == ["Hello"]
        last_thought = max(i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None))
        assert last_thought < min(i for i, d in enumerate(deltas) if d.content)
        chunks = await client.chat.completions.create(
            model="llm", messages=HI, stream=True, stream_options={"include_usage": True}
        )
        usage = [c.usage async for c in chunks if c.usage][-1]
        assert usage.completion_tokens_details.reasoning_tokens == 2

    oai(test)


def test_an_answer_cut_off_while_thinking_is_all_reasoning(oai):
    FakeLLM.texts, FakeLLM.reason = ["Hmm", ", so", " </thi"], "length"

    async def test(client):
        whole = await client.chat.completions.create(model="llm", messages=HI, max_tokens=3)
        message = whole.choices[0].message
        assert (message.reasoning_content, message.content) == ("Hmm, so </thi", None)
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens_details.reasoning_tokens == 3

    oai(test)


def test_chat_template_kwargs_reach_the_template(oai):
    async def test(client):
        FakeLLM.texts = ["Hello"]
        whole = await client.chat.completions.create(
            model="llm", messages=HI, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        assert FakeLLM.requests[-1][0] == "user:Hi<think></think>"
        message = whole.choices[0].message
        assert (message.reasoning_content, message.content) == (None, "Hello")
        assert whole.usage.completion_tokens_details.reasoning_tokens == 0
        with pytest.raises(openai.BadRequestError, match="may not set 'messages'"):
            await client.chat.completions.create(
                model="llm", messages=HI, extra_body={"chat_template_kwargs": {"messages": []}}
            )

    oai(test)


def test_tool_calls_after_the_reasoning(oai):
    FakeLLM.texts = ["Weather it is.", "</think>\n\n", call_text("get_weather", {"city": "Oslo"})]

    async def test(client):
        whole = await client.chat.completions.create(model="llm", messages=HI, tools=[CHAT_TOOL])
        message = whole.choices[0].message
        assert message.reasoning_content == "Weather it is." and message.content is None
        assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Oslo"}
        assert whole.choices[0].finish_reason == "tool_calls"
        # a forced call or structured output is a grammar from the first token: all of it is the answer
        FakeLLM.texts = [call_text("get_weather", {"city": "Oslo"})]
        forced = await client.chat.completions.create(
            model="llm", messages=HI, tools=[CHAT_TOOL], tool_choice="required"
        )
        assert (
            getattr(forced.choices[0].message, "reasoning_content", None) is None
            and forced.choices[0].message.tool_calls
        )
        FakeLLM.texts = ['{"a": 1}']
        shaped = await client.chat.completions.create(model="llm", messages=HI, response_format={"type": "json_object"})
        assert (getattr(shaped.choices[0].message, "reasoning_content", None), shaped.choices[0].message.content) == (
            None,
            '{"a": 1}',
        )

    oai(test)


def test_with_no_reasoning_parser_nothing_changes(monkeypatch):
    run = runner(monkeypatch, openai_client, reasoning_parser="none")

    async def test(client):
        whole = await client.chat.completions.create(model="llm", messages=HI)
        assert whole.choices[0].message.content == "".join(THOUGHT)
        assert "reasoning_content" not in whole.choices[0].message.model_dump(exclude_none=True)
        assert whole.usage.completion_tokens_details is None
        response = await client.responses.create(model="llm", input="Hi")
        assert [item.type for item in response.output] == ["message"]

    run(test)


def test_the_responses_api_has_a_reasoning_item_first(oai):
    async def test(client):
        whole = await client.responses.create(model="llm", input="Hi")
        thought, message = whole.output
        assert thought.type == "reasoning" and thought.summary == [] and thought.status == "completed"
        assert [(c.type, c.text) for c in thought.content] == [("reasoning_text", "Let me think.")]
        assert message.type == "message" and whole.output_text == "Hello"
        assert whole.usage.output_tokens_details.reasoning_tokens == 2
        events = [e async for e in await client.responses.create(model="llm", input="Hi", stream=True)]
        kinds = [e.type for e in events]
        assert kinds[2:6] == [
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
        ]
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
        done = next(e for e in events if e.type == "response.reasoning_text.done")
        assert done.text == "Let me think." and done.output_index == 0
        assert next(e for e in events if e.type == "response.output_text.delta").output_index == 1
        async with client.responses.stream(model="llm", input="Hi") as stream:
            final = await stream.get_final_response()
        assert final.output[0].content[0].text == "Let me think." and final.output_text == "Hello"
        # the output sent back as input: the reasoning item is accepted (and not shown to the model again)
        again = await client.responses.create(
            model="llm", input=[{"role": "user", "content": "Hi"}, *[i.model_dump() for i in final.output]]
        )
        assert again.status == "completed"

    oai(test)


def test_a_responses_answer_cut_off_while_thinking(oai):
    FakeLLM.texts, FakeLLM.reason = ["Hmm", "..."], "length"

    async def test(client):
        whole = await client.responses.create(model="llm", input="Hi", max_output_tokens=2)
        [thought] = whole.output
        assert thought.status == "incomplete" and thought.content[0].text == "Hmm..."
        assert whole.status == "incomplete" and whole.usage.output_tokens_details.reasoning_tokens == 2

    oai(test)


def test_anthropic_thinking_block_when_asked_for(claude):
    thinking = {"type": "enabled", "budget_tokens": 1024}

    async def test(client):
        message = await client.messages.create(model="llm", max_tokens=2048, messages=HI, thinking=thinking)
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "Let me think." and message.content[0].signature == ""
        assert message.content[1].text == "Hello"
        async with client.messages.stream(model="llm", max_tokens=2048, messages=HI, thinking=thinking) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_message()
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
        assert deltas == ["thinking_delta", "thinking_delta", "signature_delta", "text_delta"]
        assert final.content[0].thinking == "Let me think." and final.content[1].text == "Hello"
        # the thinking block sent back in the next turn
        history = [*HI, {"role": "assistant", "content": final.content}, {"role": "user", "content": "And?"}]
        again = await client.messages.create(model="llm", max_tokens=2048, messages=history, thinking=thinking)
        assert again.stop_reason == "end_turn"
        # without thinking, the answer is the text as written
        plain = await client.messages.create(model="llm", max_tokens=64, messages=HI)
        assert [block.type for block in plain.content] == ["text"] and plain.content[0].text == "".join(THOUGHT)
        with pytest.raises(anthropic.BadRequestError, match="cannot be used when tool_choice forces tool use"):
            await client.messages.create(
                model="llm",
                max_tokens=2048,
                messages=HI,
                thinking=thinking,
                tools=[{"name": "f", "input_schema": {"type": "object"}}],
                tool_choice={"type": "any"},
            )
        with pytest.raises(anthropic.BadRequestError, match="thinking must be"):
            await client.messages.create(
                model="llm", max_tokens=64, messages=HI, thinking={"type": "enabled", "budget_tokens": 0}
            )

    claude(test)


def test_anthropic_thinking_needs_a_reasoning_parser(monkeypatch):
    run = runner(monkeypatch, anthropic_client, reasoning_parser="none")

    async def test(client):
        with pytest.raises(anthropic.BadRequestError, match="needs a reasoning model"):
            await client.messages.create(
                model="llm", max_tokens=2048, messages=HI, thinking={"type": "enabled", "budget_tokens": 1024}
            )

    run(test)
