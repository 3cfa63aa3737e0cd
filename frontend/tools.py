"""Tool calling on /v1/chat/completions: OpenAI's `tools` / `tool_choice` in, `tool_calls` out.

The model is told about the tools in a system message and calls one by writing
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (the Hermes format that Qwen2.5, Hermes and many
fine-tunes use). With `tool_choice` `required` or a named function the output is *constrained* to such calls
(an llguidance Lark grammar embedding each function's parameter schema), so the arguments always parse and fit
the schema; with `auto` the model may answer in text or call, and the calls it writes are parsed out of its
text. Earlier turns (assistant `tool_calls`, `tool` results) are written back into the conversation in the
same format, so any chat template renders them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import APIError, bad_request

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Compact JSON (as backend/sampling/structured_output.py asks for): flexible whitespace lets a small model pad forever.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolCalling:
    """The tools a chat request offers and how the model must use them: `choice` is `auto`, `required`, or the
    name of the one function it must call; `parallel`: more than one call per answer is allowed."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {tool.name for tool in self.tools}

    def system_prompt(self) -> str:
        listing = "\n".join(
            json.dumps(
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                }
            )
            for t in self.tools
        )
        return (
            "You may call one or more functions to help with the user's request. The functions are listed "
            f"within <tools></tools> tags:\n<tools>\n{listing}\n</tools>\n"
            "To call a function, write a JSON object with the function's name and its arguments within "
            "<tool_call></tool_call> tags:\n"
            f'{CALL_OPEN}{{"name": <function-name>, "arguments": <arguments-object>}}{CALL_CLOSE}'
        )

    def grammar(self) -> str | None:
        """The Lark grammar the output must follow, or None (`auto`: the model chooses)."""
        if self.choice == "auto":
            return None
        tools = [t for t in self.tools if self.choice == "required" or t.name == self.choice]
        schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in tools
            ],
            "x-guidance": _COMPACT_JSON,
        }
        call = f"{json.dumps(CALL_OPEN)} %json {json.dumps(schema)} {json.dumps(CALL_CLOSE)}"
        repeat = ' ("\\n" call)*' if self.parallel and self.choice == "required" else ""
        return f"start: call{repeat}\ncall: {call}\n"


def parse_tool_calling(body: dict, flat: bool = False) -> ToolCalling | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body; None when no tool may be called. `flat`:
    the route's own tools hold their fields at the top (`tools[i].name`), and its errors name them so."""
    if flat:
        try:
            return parse_tool_calling(body)
        except APIError as exc:
            exc.message = exc.message.replace(".function.", ".")
            exc.param = exc.param and exc.param.replace(".function.", ".")
            raise
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if not tools:
        if "tools" in body:
            raise bad_request("tools must be a non-empty array of function tools", "tools")
        if choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    parsed = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise bad_request(f"tool names must be unique, got {names}", "tools")
    if choice == "none":
        return None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or "name" not in function:
            raise bad_request(
                'tool_choice must be "none", "auto", "required" or {"type": "function", '
                f'"function": {{"name": ...}}}}, got {choice!r}',
                "tool_choice",
            )
        if function["name"] not in names:
            raise bad_request(
                f"tool_choice names function {function['name']!r}, which is not among the tools {names}", "tool_choice"
            )
        choice = function["name"]
    elif choice not in ("auto", "required"):
        raise bad_request(
            f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}', "tool_choice"
        )
    return ToolCalling(parsed, choice, body.get("parallel_tool_calls", True))


def tool_constraint(tool_calling: ToolCalling | None, constraint: dict[str, Any], format_param: str) -> dict:
    """The output constraint of a request that may offer tools: with tools, a forced call's grammar (none for
    `auto`), and a format constraint (`format_param`: response_format, text.format) is a 400 beside them."""
    if tool_calling is None:
        return constraint
    if constraint:
        raise bad_request(f'give {format_param} or tools, not both (unless tool_choice is "none")', format_param)
    grammar = tool_calling.grammar()
    return {"guided_grammar": grammar} if grammar else {}


def _tool(tool: Any, param: str) -> Tool:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(
            f'{param} must be {{"type": "function", "function": {{...}}}} (only function tools are supported)', param
        )
    function = tool["function"]
    extra = set(function) - {"name", "description", "parameters", "strict"}
    if extra:
        raise bad_request(f"{param}.function has unknown field(s) {sorted(extra)}", f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(
            f"{param}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}", f"{param}.function.name"
        )
    description = function.get("description", "")
    if not isinstance(description, str):
        raise bad_request(f"{param}.function.description must be a string", f"{param}.function.description")
    parameters = function.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise bad_request(
            f"{param}.function.parameters must be a JSON schema object, got {parameters!r}",
            f"{param}.function.parameters",
        )
    return Tool(name, description, parameters)


def conversation(messages: list[dict], tool_calling: ToolCalling | None) -> list[dict]:
    """The messages as plain role/content turns (an assistant's reasoning_content kept): the tool listing in the
    system message, earlier assistant tool calls and `tool` results written out in the call format."""
    out = []
    for message in messages:
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif message.get("tool_calls"):
            calls = "\n".join(_written_call(call) for call in message["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(filter(None, [message.get("content"), calls]))})
        else:
            out.append({"role": message["role"], "content": message["content"]})
        if message["role"] == "assistant" and message.get("reasoning_content"):
            out[-1]["reasoning_content"] = message["reasoning_content"]  # the template decides whether to show it
    if tool_calling is not None:
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tool_calling.system_prompt()}"}
        else:
            out.insert(0, {"role": "system", "content": tool_calling.system_prompt()})
    return out


def _written_call(call: dict) -> str:
    function = call["function"]
    arguments = function["arguments"]  # OpenAI sends them as a JSON string
    try:
        arguments = json.loads(arguments)
    except json.JSONDecodeError:
        pass  # written as the string it is
    return f"{CALL_OPEN}{json.dumps({'name': function['name'], 'arguments': arguments})}{CALL_CLOSE}"


class ToolCallParser:
    """Splits one choice's text, fed in pieces as it streams, into content and completed tool calls. Text that
    may be the start of a call is held back until it is known; a call whose JSON does not parse, or names a
    function that was not offered, stays in the content as written; a call that max_tokens cut off is dropped
    (`finish(cut=True)`)."""

    def __init__(self, names: set[str]):
        self.names = names
        self.num_calls = 0
        self._pending = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content known so far (joined) and the calls completed by `text`."""
        pieces = self.pieces(text)
        return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, dict)]

    def pieces(self, text: str) -> list[str | dict]:
        """What `text` makes known, in the order written: content strings and completed calls."""
        self._pending += text
        pieces: list[str | dict] = []
        while True:
            if not self._in_call:
                start = self._pending.find(CALL_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._pending, CALL_OPEN)
                    pieces.append(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                pieces.append(self._pending[:start])
                self._pending = self._pending[start + len(CALL_OPEN) :]
                self._in_call = True
            end = self._pending.find(CALL_CLOSE)
            if end < 0:
                break
            body, self._pending, self._in_call = self._pending[:end], self._pending[end + len(CALL_CLOSE) :], False
            call = self._call(body)
            pieces.append(CALL_OPEN + body + CALL_CLOSE if call is None else call)
        return [p for p in pieces if p]

    def finish(self, cut: bool = False) -> str:
        """The text still held back: an unfinished call stays content, unless `cut` (max_tokens ended the text
        inside it): a call cut off, or the start of its opening tag, is dropped, never shown as raw markup."""
        rest = "" if cut else (CALL_OPEN if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return rest

    def _call(self, body: str) -> dict | None:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not (isinstance(call, dict) and call.get("name") in self.names and isinstance(call.get("arguments"), dict)):
            return None
        self.num_calls += 1
        return {
            "index": self.num_calls - 1,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
        }


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
