"""frontend/responses_api.py: Responses API bodies mapped onto the chat path (the same prompt as the equivalent
chat request) and every refusal a 400 naming the parameter."""

from __future__ import annotations

import json

import pytest

from frontend.errors import APIError
from frontend.openai_protocol import parse_chat
from tests.unit.responses_requests import CHAT_TOOL, SERVED, TOOL, WEATHER, render, responses


def refused(**body) -> APIError:
    with pytest.raises(APIError) as info:
        responses(**body)
    return info.value


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
        ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "input[0].type", "unsupported_parameter"),
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
