"""frontend/anthropic_messages.py, anthropic_stream.py's content blocks and anthropic_errors.py: Messages bodies
mapped onto the chat path (the same prompt as the equivalent chat request), every refusal a 400 naming the field,
the model's text as text and tool_use blocks with Anthropic's stop reasons, errors in Anthropic's shape."""

from __future__ import annotations

import pytest

from frontend.anthropic_errors import error_body, error_response, is_anthropic_route
from frontend.anthropic_messages import MessagesRequest, parse_count_tokens, parse_messages
from frontend.anthropic_stream import MessageContent
from frontend.errors import APIError, bad_request, internal_error, model_not_found, server_busy, unauthorized
from frontend.openai_protocol import parse_chat
from frontend.tools import ToolCalling
from tests.unit.responses_requests import CHAT_TOOL, SERVED, WEATHER, call_text, render

TOOL = {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}
HI = [{"role": "user", "content": "Hi"}]


def messages(**body) -> MessagesRequest:
    return parse_messages({"model": "llm", "max_tokens": 16, "messages": HI, **body}, SERVED, render)


def chat_prompt(chat: list[dict], **body) -> str:
    return parse_chat({"model": "llm", "messages": chat, **body}, SERVED, 8, render).prompts[0]


def refused(**body) -> str:
    with pytest.raises(APIError) as info:
        parse_messages({"model": "llm", "max_tokens": 16, "messages": HI, **body}, SERVED, render)
    assert info.value.status == 400
    return error_body(info.value)["error"]["message"]


# ------------------------------------------------------------------------------------------------ requests


def test_system_messages_and_sampling_map_onto_a_chat_generation():
    parsed = messages(
        system="Be brief.",
        temperature=0,
        top_p=0.5,
        top_k=4,
        stop_sequences=["END", "###"],
        metadata={"user_id": "u1"},
        stream=True,
        cache_control={"type": "ephemeral"},
        thinking={"type": "disabled"},
    )
    g = parsed.generation
    assert g.prompts == [chat_prompt([{"role": "system", "content": "Be brief."}, *HI])]
    assert g.sampling == {
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 4,
        "stop": ["END", "###"],
        "max_tokens": 16,
        "include_stop_str_in_output": True,  # the answer says which one matched, and takes it off
    }
    assert (g.n, g.stream, g.logprobs, g.tool_calling, parsed.stop_sequences) == (1, True, None, None, ("END", "###"))
    assert messages().generation.sampling == {"max_tokens": 16} and not messages().generation.stream


def test_text_blocks_give_the_same_prompt_as_strings():
    blocks = messages(
        system=[
            {"type": "text", "text": "Be"},
            {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "c", "citations": None}]},
            {"role": "user", "content": "d"},
        ],
    )
    strings = [
        {"role": "system", "content": "Be\nbrief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ]
    assert blocks.generation.prompts == [chat_prompt(strings)]


def test_a_tool_conversation_gives_the_same_prompt_as_chat():
    conversation = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                {"type": "text", "text": "And Rome?"},
            ],
        },
    ]
    chat = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "And Rome?"},
    ]
    parsed = messages(messages=conversation, tools=[TOOL])
    assert parsed.generation.prompts == [chat_prompt(chat, tools=[CHAT_TOOL])]
    assert parsed.generation.tool_calling.choice == "auto" and "guided_grammar" not in parsed.generation.sampling
    failed = messages(
        messages=[
            *conversation[:2],
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True}]},
        ]
    )
    assert "<tool_response>\nError: \n</tool_response>" in failed.generation.prompts[0]


@pytest.mark.parametrize(
    "choice, chat_choice, parallel",
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any"}, "required", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "get_weather"}, "get_weather", True),
    ],
)
def test_tool_choice_maps_onto_chat_tool_calling(choice, chat_choice, parallel):
    tool_calling = messages(tools=[TOOL], tool_choice=choice).generation.tool_calling
    assert (tool_calling.choice, tool_calling.parallel) == (chat_choice, parallel)
    grammar = messages(tools=[TOOL], tool_choice=choice).generation.sampling.get("guided_grammar")
    assert (grammar is None) == (chat_choice == "auto")
    if grammar is not None:
        assert ('("\\n" call)*' in grammar) == (parallel and chat_choice == "required")


def test_tool_choice_none_lists_no_tools():
    parsed = messages(tools=[TOOL], tool_choice={"type": "none"})
    assert parsed.generation.tool_calling is None and parsed.generation.prompts == [chat_prompt(HI)]
    assert messages(tool_choice={"type": "auto"}).generation.tool_calling is None  # nothing to call


def test_a_last_assistant_message_is_continued():
    parsed = messages(messages=[*HI, {"role": "assistant", "content": "The answer is ("}])
    assert parsed.generation.prompts == [chat_prompt(HI) + "The answer is ("]


def test_count_tokens_renders_the_prompt_as_messages_does():
    body = {"model": "llm", "system": "Be brief.", "messages": HI, "tools": [TOOL], "tool_choice": {"type": "any"}}
    assert parse_count_tokens(body, SERVED, render) == messages(**body).generation.prompts[0]
    with pytest.raises(APIError) as info:
        parse_count_tokens({**body, "max_tokens": 5}, SERVED, render)
    assert "unrecognized request argument 'max_tokens'" in info.value.message


@pytest.mark.parametrize(
    "body, message",
    [
        ({"max_tokens": None}, "max_tokens is required"),
        ({"max_tokens": 0}, "an integer of at least 1"),
        ({"max_tokens": "8"}, "max_tokens must be an integer"),
        ({"messages": []}, "messages is required"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role must be 'user' or 'assistant'"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "unknown field(s) ['name']"),
        ({"messages": [{"role": "user", "content": []}]}, "must be a string or a non-empty array of content blocks"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "a user message's content blocks must be of type ['text', 'tool_result']",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "must be of type ['text', 'tool_result']",
        ),
        (
            {"messages": [*HI, {"role": "assistant", "content": [{"type": "image", "source": {}}]}]},
            "content blocks must be of type ['redacted_thinking', 'text', 'thinking', 'tool_use']",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "text must be a string"),
        ({"messages": [*HI, {"role": "assistant", "content": "Sure. "}]}, "cannot end with trailing whitespace"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "needs a user message before it"),
        ({"system": [{"type": "image"}]}, "system[0] must be a text block"),
        ({"temperature": 1.5}, "temperature must be from 0 to 1"),
        ({"top_p": 0}, "top_p"),
        ({"stop_sequences": "END"}, "stop_sequences must be an array"),
        ({"stop_sequences": [""]}, "stop_sequences must be an array of non-empty strings"),
        ({"stop_sequences": ["s"] * 17}, "stop_sequences: stop takes at most 16 strings"),
        ({"metadata": {"tags": "x"}}, "it takes only user_id"),
        ({"thinking": {"type": "adaptive"}}, 'thinking must be {"type": "disabled"} or {"type": "enabled"'),
        ({"thinking": {"type": "enabled", "budget_tokens": "1k"}}, 'thinking must be {"type": "disabled"}'),
        ({"output_config": {"format": {}}}, "'output_config' is not supported"),
        ({"n": 2}, "unrecognized request argument 'n'"),
        ({"tool_choice": "auto", "tools": [TOOL]}, "tool_choice must be an object"),
        ({"tool_choice": {"type": "required"}, "tools": [TOOL]}, 'tool_choice must be {"type": "auto"}'),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, "names tool 'nope', which is not"),
        ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema is required"),
        ({"tools": [{**TOOL, "name": "a b"}]}, "tools[0].name must be 1-64 letters"),
        ({"tools": [TOOL, TOOL]}, "tool names must be unique"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only custom tools"),
        ({"tools": [{**TOOL, "defer_loading": True}]}, "unknown field(s) ['defer_loading']"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "any"}, "messages": [*HI, {"role": "assistant", "content": "x"}]},
            "cannot be continued when tool_choice forces a tool call",
        ),
    ],
)
def test_refusals_name_the_field(body, message):
    assert message in refused(**body)


def test_an_unknown_model_is_not_found():
    with pytest.raises(APIError) as info:
        messages(model="nope")
    assert error_body(info.value)["error"]["type"] == "not_found_error" and info.value.status == 404


# ------------------------------------------------------------------------------------------ content blocks


def test_text_streams_as_one_text_block_and_a_stop_sequence_is_taken_off():
    content = MessageContent(None, ("END", "D"))
    first = content.feed("Hello ", None)
    assert first == [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello "}},
    ]
    last = content.feed("worldEND", "stop")
    assert [e["type"] for e in last] == ["content_block_delta", "content_block_stop"]
    assert last[0]["delta"]["text"] == "world" and content.blocks == [{"type": "text", "text": "Hello world"}]
    assert (content.stop_sequence, content.stop_reason("stop")) == ("END", "stop_sequence")  # the longest match


def test_end_of_turn_and_max_tokens():
    content = MessageContent(None, ("END",))
    content.feed("Hi there", "stop")  # stopped by the end-of-sequence token: no stop sequence at the end
    assert (content.stop_sequence, content.stop_reason("stop")) == (None, "end_turn")
    assert MessageContent(None).stop_reason("length") == "max_tokens"
    empty = MessageContent(None)
    assert empty.feed("", "stop") == [] and empty.blocks == []


def test_tool_calls_become_tool_use_blocks():
    tools = ToolCalling(tuple(messages(tools=[TOOL]).generation.tool_calling.tools), "auto")
    content = MessageContent(tools)
    text = (
        "Let me see. " + call_text("get_weather", {"city": "Oslo"}) + "\n" + call_text("get_weather", {"city": "Rome"})
    )
    events = [e for i in range(0, len(text), 7) for e in content.feed(text[i : i + 7], None)]
    events += content.feed("\n", "stop")
    assert [b["type"] for b in content.blocks] == ["text", "tool_use", "tool_use"]  # whitespace between calls dropped
    assert content.blocks[0]["text"] == "Let me see. " and content.blocks[2]["input"] == {"city": "Rome"}
    assert content.blocks[1]["id"].startswith("toolu_") and content.blocks[1]["name"] == "get_weather"
    assert [(e["type"], e["index"]) for e in events if e["type"] != "content_block_delta"] == [
        ("content_block_start", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_stop", 2),
    ]
    call_deltas = [e["delta"] for e in events if e["index"] == 1 and e["type"] == "content_block_delta"]
    assert call_deltas == [{"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}]
    assert content.stop_reason("stop") == "tool_use" and content.stop_reason("length") == "max_tokens"
    cut = MessageContent(tools)
    cut.feed("Checking. " + call_text("get_weather", {"city": "Oslo"})[:20], "length")  # max_tokens cut the call
    assert cut.blocks == [{"type": "text", "text": "Checking. "}]  # dropped: no raw markup in the text


# ------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "error, status, kind",
    [
        (bad_request("top_p must be in (0, 1]", "top_p"), 400, "invalid_request_error"),
        (unauthorized(), 401, "authentication_error"),
        (model_not_found("nope", SERVED), 404, "not_found_error"),
        (APIError(413, "too large", "invalid_request_error"), 413, "request_too_large"),
        (server_busy("server busy"), 529, "overloaded_error"),
        (APIError(503, "shutting down", "service_unavailable"), 503, "api_error"),
        (internal_error("the engine failed"), 500, "api_error"),
    ],
)
def test_errors_in_anthropic_shape(error, status, kind):
    response = error_response(error)
    assert response.status == status
    assert error_body(error) == {"type": "error", "error": {"type": kind, "message": error.message}}
    assert (response.headers.get("Retry-After") is not None) == (status == 529)


def test_a_message_names_its_field_and_only_the_anthropic_routes_use_the_shape():
    assert error_body(bad_request("must be an array", "stop_sequences"))["error"]["message"] == (
        "stop_sequences: must be an array"
    )
    assert [is_anthropic_route(p) for p in ("/v1/messages", "/v1/messages/count_tokens", "/v1/messagesx")] == [
        True,
        True,
        False,
    ]
