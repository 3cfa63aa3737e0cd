"""frontend/tools.py: tool definitions checked, forced calls as a grammar that admits exactly the declared
calls, and tool calls parsed out of a choice's text whether it comes whole or in stream pieces."""

from __future__ import annotations

import json

import pytest

from frontend.generation import Generation
from frontend.openai_responses import ChatFormat, Choice
from frontend.tools import ToolCallParser, parse_tool_calling
from frontend.triton_stream import SampleDelta

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def matcher_for(tokenizer):
    """Builds an llguidance matcher for a grammar over the real SmolLM2 tokenizer."""
    import llguidance.hf
    from llguidance import LLMatcher

    vocabulary = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(grammar: str, text: str) -> bool:
        matcher = LLMatcher(vocabulary, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer(text).input_ids
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    return accepts


def test_required_admits_only_calls_of_the_declared_functions_with_valid_arguments(matcher_for):
    grammar = parse_tool_calling({"tools": TOOLS, "tool_choice": "required"}).grammar()
    good = call_text("get_weather", {"city": "Oslo", "days": 3})
    assert matcher_for(grammar, good)
    assert matcher_for(grammar, good + "\n" + call_text("get_time", {}))  # parallel calls
    assert not matcher_for(grammar, "Sure! " + good)  # no text around the calls
    assert not matcher_for(grammar, call_text("get_weather", {"city": "Oslo", "days": 9}))  # maximum 7
    assert not matcher_for(grammar, call_text("get_weather", {"city": "Oslo"}))  # days is required
    assert not matcher_for(grammar, call_text("launch", {}))  # not a declared function


def test_a_named_choice_or_no_parallel_calls_admits_exactly_one_call(matcher_for):
    named = parse_tool_calling(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    ).grammar()
    assert matcher_for(named, call_text("get_time", {}))
    assert not matcher_for(named, call_text("get_weather", {"city": "Oslo", "days": 1}))
    single = parse_tool_calling({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}).grammar()
    assert not matcher_for(single, call_text("get_time", {}) + "\n" + call_text("get_time", {}))


def test_auto_has_no_grammar_and_none_offers_no_tools():
    assert parse_tool_calling({"tools": TOOLS}).grammar() is None
    assert parse_tool_calling({"tools": TOOLS, "tool_choice": "none"}) is None
    assert parse_tool_calling({}) is None


TEXT = "Let me check. " + call_text("get_weather", {"city": "Oslo", "days": 2}) + "\n" + call_text("get_time", {})


def parse_in_pieces(text: str, size: int) -> tuple[str, list[dict]]:
    parser, content, calls = ToolCallParser({"get_weather", "get_time"}), "", []
    for start in range(0, len(text), size):
        piece, found = parser.feed(text[start : start + size])
        content, calls = content + piece, calls + found
    return content + parser.finish(), calls


@pytest.mark.parametrize("size", [1, 3, 7, len(TEXT)])
def test_calls_are_parsed_the_same_whatever_the_stream_pieces(size):
    content, calls = parse_in_pieces(TEXT, size)
    assert content == "Let me check. \n"
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Oslo", "days": 2}),
        (1, "get_time", {}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


def test_text_that_only_looks_like_a_call_stays_content():
    for text in ["a <tool_ b", call_text("launch", {}), "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{"]:
        assert parse_in_pieces(text, 2) == (text, [])


def chat_format() -> ChatFormat:
    generation = Generation(
        model="llm",
        prompts=["P"],
        sampling={},
        n=1,
        stream=True,
        include_usage=False,
        echo=False,
        logprobs=None,
        tool_calling=parse_tool_calling({"tools": TOOLS}),
    )
    return ChatFormat(generation, tokenizer=None)


def test_chat_answers_carry_tool_calls_and_finish_reason_tool_calls():
    whole = chat_format().whole_choice(0, Choice(text=TEXT, finish_reason="stop"))
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather", "get_time"]
    cut = chat_format().whole_choice(0, Choice(text=TEXT[:40], finish_reason="length"))
    assert cut == {
        "index": 0,
        "message": {"role": "assistant", "content": "Let me check. "},  # the call max_tokens cut off is dropped
        "logprobs": None,
        "finish_reason": "length",
    }


def test_a_held_back_call_start_is_content_unless_max_tokens_cut_it():
    for text in ["a <tool_", "a <tool_call>", 'a <tool_call>\n{"name": "get_time"']:
        parser = ToolCallParser({"get_time"})
        assert parser.feed(text) == ("a ", [])
        assert parser.finish(cut=True) == ""
        parser = ToolCallParser({"get_time"})
        assert parser.feed(text)[0] + parser.finish() == text


def forced(choice: object = "required") -> ChatFormat:
    fmt = chat_format()
    fmt.generation.tool_calling = parse_tool_calling({"tools": TOOLS, "tool_choice": choice})
    return fmt


def streamed_choices(fmt: ChatFormat, text: str, reason: str, size: int = 5) -> list[dict]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    return [
        fmt.delta_choice(0, SampleDelta(0, p, [1], 3, i + 1, reason if i == len(pieces) - 1 else None, None))
        for i, p in enumerate(pieces)
    ]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_off_by_max_tokens_is_length_with_no_markup(choice):
    cut = call_text("get_weather", {"city": "Oslo", "days": 2})[:30]
    whole = forced(choice).whole_choice(0, Choice(text=cut, finish_reason="length"))
    assert whole["finish_reason"] == "length" and "tool_calls" not in whole["message"]
    assert whole["message"]["content"] == ""
    chunks = streamed_choices(forced(choice), cut, "length")
    assert all(set(chunk["delta"]) <= {"content"} for chunk in chunks)
    assert "".join(chunk["delta"].get("content", "") for chunk in chunks) == ""
    assert [chunk["finish_reason"] for chunk in chunks][-1] == "length"


def test_calls_before_the_one_max_tokens_cut_stay_calls():
    first = call_text("get_weather", {"city": "Oslo", "days": 2})
    text = first + "\n" + call_text("get_time", {})[:20]
    whole = forced().whole_choice(0, Choice(text=text, finish_reason="length"))
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    chunks = streamed_choices(forced(), text, "length")
    calls = [c for chunk in chunks for c in chunk["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert "".join(chunk["delta"].get("content", "") for chunk in chunks) == ""
    assert chunks[-1]["finish_reason"] == "length"


def test_streamed_chat_deltas_carry_each_call_once_it_is_complete():
    fmt, pieces = chat_format(), [TEXT[i : i + 5] for i in range(0, len(TEXT), 5)]
    chunks = [
        fmt.delta_choice(0, SampleDelta(0, p, [1], 3, i + 1, "stop" if i == len(pieces) - 1 else None, None))
        for i, p in enumerate(pieces)
    ]
    calls = [c for chunk in chunks for c in chunk["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert "".join(chunk["delta"].get("content", "") for chunk in chunks) == "Let me check. \n"
    assert [chunk["finish_reason"] for chunk in chunks].count("tool_calls") == 1
    assert chunks[-1]["finish_reason"] == "tool_calls"
