"""OpenAI's Responses API (`POST /v1/responses`) mapped onto the chat path: the body checked and turned into
chat messages (rendered with the model's chat template, tools listed as on /v1/chat/completions) and a
`Generation`. frontend/responses_output.py builds the answer.

The server is stateless: nothing is stored, so `previous_response_id` and `store: true` are refused and a
client sends the whole conversation in `input` each time, earlier `function_call` and `function_call_output`
items included (a Response's `output` items can be appended to `input` as they are). docs/frontend.md
"Responses API" has the mapping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import bad_request, unsupported
from .generation import Generation, make_generation
from .request_fields import TYPES, check_fields, served_model
from .tools import ToolCalling, conversation, parse_tool_calling, tool_constraint

FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "truncation",
        "metadata",
        "user",
        "safety_identifier",
        "store",
        "previous_response_id",
        "priority",
    }
)
# Responses API parameters this server knows of and cannot honour: a 400 that says so (not "unknown").
UNSUPPORTED = frozenset(
    {
        "background",
        "conversation",
        "include",
        "max_tool_calls",
        "prompt",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning",
        "service_tier",
        "top_logprobs",
        "context_management",
        "access_programs",
        "image",
        "moderation",
    }
)
FIELD_TYPES = {
    **TYPES,
    "input": (str, list),
    "instructions": (str,),
    "max_output_tokens": (int,),
    "text": (dict,),
    "truncation": (str,),
    "metadata": (dict,),
    "safety_identifier": (str,),
    "store": (bool,),
    "previous_response_id": (str,),
}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
ITEM_KEYS = {  # the fields of each input item this server reads or may ignore (ids and statuses of echoed output)
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},  # dropped: see _input
}
TEXT_PARTS = ("input_text", "output_text")
PART_KEYS = {"type", "text", "annotations", "logprobs"}
FORMAT_KEYS = {"type", "name", "schema", "strict", "description"}
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
STATELESS = "this server is stateless: it stores no responses, so send the whole conversation in input"


@dataclass
class ResponsesRequest:
    """A Responses API request: what to generate, and the settings the Response object repeats."""

    generation: Generation
    settings: dict[str, Any]


def parse_responses(
    body: Any, served: list[str], default_max_tokens: int, render_chat: Callable[[list[dict]], str]
) -> ResponsesRequest:
    """A /v1/responses body; `render_chat` applies the model's chat template."""
    body = check_fields(body, FIELDS, UNSUPPORTED, FIELD_TYPES)
    model = served_model(body, served)
    if "previous_response_id" in body:
        raise bad_request(
            f"previous_response_id is not supported: {STATELESS}", "previous_response_id", "unsupported_parameter"
        )
    if body.get("store"):
        raise bad_request(
            f"store: true is not supported: {STATELESS} (send store: false or leave it out)",
            "store",
            "unsupported_parameter",
        )
    if body.get("truncation", "disabled") != "disabled":
        raise unsupported("truncation", ' other than "disabled" (a prompt too long for the model is a 400)')
    _check_stream_options(body)
    _check_metadata(body.get("metadata"))
    text_format = _text_format(body.get("text"))
    constraint = _constraint(text_format)
    tool_calling = _tool_calling(body)
    constraint = tool_constraint(tool_calling, constraint, "text.format")
    messages = _input(body.get("input"))
    if "instructions" in body:
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    prompt = render_chat(conversation(messages, tool_calling))
    names = {
        "max_tokens": "max_output_tokens",
        "guided_json": "text.format",
        "guided_json_object": "text.format",
        "guided_grammar": "tools",
    }
    sampling_body = {key: body[key] for key in ("temperature", "top_p", "stream", "priority") if key in body}
    generation = make_generation(
        sampling_body,
        model,
        [prompt],
        body.get("max_output_tokens", default_max_tokens),
        None,
        False,
        names,
        constraint,
    )
    generation.tool_calling = tool_calling
    return ResponsesRequest(
        generation,
        {
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata", {}),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "safety_identifier": body.get("safety_identifier"),
            "store": False,
            "temperature": body.get("temperature", 1.0),
            "text": {"format": text_format},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": [
                {
                    "type": "function",
                    "name": t["name"],
                    "description": t.get("description"),
                    "parameters": t.get("parameters"),
                    "strict": t.get("strict"),
                }
                for t in body.get("tools", [])
            ],
            "top_p": body.get("top_p", 1.0),
            "truncation": "disabled",
            "user": body.get("user"),
        },
    )


def _check_stream_options(body: dict) -> None:
    options = body.get("stream_options")
    if options is None:
        return
    if not body.get("stream"):
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if set(options) - {"include_obfuscation"} or options.get("include_obfuscation", False) is not False:
        raise unsupported("stream_options", " (only include_obfuscation: false: events carry no obfuscation field)")


def _check_metadata(metadata: Any) -> None:
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise bad_request("metadata must be an object of string keys and string values", "metadata")


def _text_format(text: Any) -> dict:
    """`text.format` as given (the Response repeats it): {"type": "text"} when absent."""
    if text is None:
        return {"type": "text"}
    if set(text) - {"format"}:
        raise unsupported(f"text.{sorted(set(text) - {'format'})[0]}")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad_request(f"text.format must be an object, got {fmt!r}", "text.format")
    if set(fmt) - FORMAT_KEYS:
        raise bad_request(f"text.format has unknown field(s) {sorted(set(fmt) - FORMAT_KEYS)}", "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str):
            raise bad_request("text.format.name is required (a string) with type json_schema", "text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request(
                f"text.format.schema must be a JSON schema object, got {fmt.get('schema')!r}", "text.format.schema"
            )
    elif kind not in ("text", "json_object"):
        raise bad_request(
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "text.format.type"
        )
    return fmt


def _constraint(fmt: dict) -> dict[str, Any]:
    """The model's structured-output key for a checked `text.format`: {} for text."""
    if fmt["type"] == "json_object":
        return {"guided_json_object": True}
    if fmt["type"] == "json_schema":
        return {"guided_json": fmt["schema"]}
    return {}


def _tool_calling(body: dict) -> ToolCalling | None:
    """The Responses API's flat function tools and tool_choice, checked as chat's (tools.py)."""
    chat = {key: body[key] for key in ("tools", "parallel_tool_calls") if key in body}
    if "tools" in body:
        chat["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(body["tools"])]
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return parse_tool_calling(chat, flat=True)  # errors name tools[i].name, not tools[i].function.name


def _tool(tool: Any, param: str) -> dict:
    """A {"type": "function", "name", ...} tool in chat's shape."""
    if not isinstance(tool, dict):
        raise bad_request(
            f'{param} must be a function tool {{"type": "function", "name": ..., "parameters": {{...}}}}, got {tool!r}',
            param,
        )
    if tool.get("type") != "function":
        raise unsupported(param, f" (a {tool.get('type')!r} tool: only function tools are supported)")
    if "function" in tool:
        raise bad_request(
            f'{param}: a Responses API function tool is flat, {{"type": "function", "name": ..., '
            '"parameters": {...}}, not nested under "function" as on /v1/chat/completions',
            param,
        )
    extra = set(tool) - TOOL_KEYS
    if extra:
        raise unsupported(f"{param}.{sorted(extra)[0]}")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}}


def _tool_choice(choice: Any) -> Any:
    """tool_choice in chat's shape: the strings as they are, {"type": "function", "name": f} nested."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise unsupported(
            "tool_choice", f" (type {choice.get('type')!r}: only none, auto, required or a named function)"
        )
    if not isinstance(choice.get("name"), str) or set(choice) != {"type", "name"}:
        raise bad_request(
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": ...}}, got {choice!r}',
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _input(items: Any) -> list[dict]:
    """`input` as chat messages (role, content, tool_calls): a string is one user message."""
    if isinstance(items, str):
        if not items:
            raise bad_request("input must not be empty", "input")
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input is required: a string or a non-empty array of input items", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be an input item (an object), got {item!r}", param)
        kind = item.get("type", "message")
        if kind not in ITEM_KEYS:
            raise unsupported(f"{param}.type", f" ({kind!r} items; supported: {sorted(ITEM_KEYS)})")
        extra = {key for key, value in item.items() if value is not None} - ITEM_KEYS[kind]
        if extra:
            raise unsupported(f"{param}.{sorted(extra)[0]}")
        if kind == "reasoning":
            continue  # an earlier answer's reasoning, sent back with its output: not shown to the model again
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{param}.role must be one of {list(ROLES)}, got {role!r}", f"{param}.role")
            messages.append(
                {"role": ROLES[role], "content": _text(item.get("content"), f"{param}.content"), "tool_calls": []}
            )
            continue
        for key in ("call_id", "name", "arguments") if kind == "function_call" else ("call_id",):
            if not isinstance(item.get(key), str):
                raise bad_request(f"{param}.{key} must be a string, got {item.get(key)!r}", f"{param}.{key}")
        if kind == "function_call":  # an earlier call: part of the assistant turn it follows
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": "", "tool_calls": []})
            messages[-1]["tool_calls"].append(call)
        else:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _text(item.get("output"), f"{param}.output"),
                }
            )
    return messages


def _text(content: Any, param: str) -> str:
    """A string, or a non-empty list of input_text / output_text parts (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad_request(f"{param} must be a string or an array of text parts, got {content!r}", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise unsupported(f"{param}[{j}]", f" (only text parts {list(TEXT_PARTS)}; got {str(part)[:60]})")
        extra = {key for key, value in part.items() if value is not None} - PART_KEYS
        if extra:
            raise unsupported(f"{param}[{j}].{sorted(extra)[0]}")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{param}[{j}].text must be a string", f"{param}[{j}].text")
        texts.append(part["text"])
    return "".join(texts)
