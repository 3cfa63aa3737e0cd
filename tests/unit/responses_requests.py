"""Responses API requests in unit tests: the served model, a tool in the flat (Responses) and nested (chat)
shapes, a stand-in chat template, a body parsed as /v1/responses parses it, and a tool call as the model writes it."""

from __future__ import annotations

import json

from frontend.responses_api import ResponsesRequest, parse_responses
from frontend.tools import CALL_CLOSE, CALL_OPEN

SERVED = ["llm"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
}


def render(messages: list[dict]) -> str:
    """A stand-in chat template: role: content lines, then the assistant's turn."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def responses(**body) -> ResponsesRequest:
    return parse_responses({"model": "llm", "input": "Hi", **body}, SERVED, 256, render)


def call_text(name: str, arguments: dict) -> str:
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"
