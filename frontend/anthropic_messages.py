"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) mapped onto the chat path.

A Messages body becomes chat messages, rendered with the model's chat template as /v1/chat/completions renders
them (tools listed and earlier calls written back as frontend/tools.py does): `system` is a first system message,
a user turn's `tool_result` blocks are `tool` messages, an assistant turn's `tool_use` blocks are its
`tool_calls`. A last assistant turn is a prefill: the answer continues its text. Then it is a `Generation` whose
`stop_sequences` go to the model as `stop` with the stop string kept in the text, so the answer can say which
one matched (frontend/anthropic_stream.py takes it off). docs/frontend.md "Anthropic Messages API" has the
mapping.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import bad_request, unsupported
from .generation import Generation, make_generation
from .request_fields import TYPES, check_fields, served_model
from .tools import ToolCalling, conversation, parse_tool_calling, tool_constraint

PROMPT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control"})
FIELDS = PROMPT_FIELDS | {"max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "metadata", "stream"}
# Messages API parameters this server knows of and cannot honour: a 400 that says so (not "unknown").
UNSUPPORTED = frozenset(
    {
        "container",
        "context_management",
        "diagnostics",
        "inference_geo",
        "mcp_servers",
        "output_config",
        "service_tier",
        "speed",
    }
)
FIELD_TYPES = {
    **TYPES,
    "system": (str, list),
    "stop_sequences": (list,),
    "metadata": (dict,),
    "tool_choice": (dict,),
    "thinking": (dict,),
    "cache_control": (dict,),
}
ROLES = ("user", "assistant")
BLOCK_KEYS = {  # the fields of each content block this server reads or may ignore, by the role it belongs to
    "user": {
        "text": {"type", "text", "cache_control", "citations"},
        "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    },
    "assistant": {
        "text": {"type", "text", "cache_control", "citations"},
        "tool_use": {"type", "id", "name", "input", "cache_control"},
        "thinking": {"type", "thinking", "signature"},  # an earlier answer's reasoning, sent back
        "redacted_thinking": {"type", "data"},
    },
}
TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control"}
CHOICE_KEYS = {
    "auto": {"type", "disable_parallel_tool_use"},
    "any": {"type", "disable_parallel_tool_use"},
    "tool": {"type", "name", "disable_parallel_tool_use"},
    "none": {"type"},
}
CHAT_CHOICE = {"auto": "auto", "any": "required", "none": "none"}  # tool_choice types in chat's terms
NAMES = {"stop": "stop_sequences", "guided_grammar": "tools"}  # the engine's keys as this API names them
JOIN = "\n"  # between the text blocks of one turn

_STRING = (str, "a string")
BLOCK_FIELDS: dict[str, dict[str, tuple]] = {  # the JSON type of each block field (None: may be left out)
    "text": {"text": _STRING},
    "tool_use": {"id": _STRING, "name": _STRING, "input": (dict, "an object")},
    "thinking": {"thinking": _STRING},
    "redacted_thinking": {"data": _STRING},
    "tool_result": {
        "tool_use_id": _STRING,
        "content": (str | list | None, "a string or an array of text blocks"),
        "is_error": (bool | None, "a boolean"),
    },
}


@dataclass
class MessagesRequest:
    """A Messages request in the model's terms, and the stop sequences its answer reports."""

    generation: Generation
    stop_sequences: tuple[str, ...]
    thinking: bool = False  # thinking {"type": "enabled"}: the answer's reasoning is a thinking block


def parse_messages(body: Any, served: list[str], render_chat: Callable[[list[dict]], str]) -> MessagesRequest:
    """A /v1/messages body; `render_chat` applies the model's chat template."""
    body = check_fields(body, FIELDS, UNSUPPORTED, FIELD_TYPES)
    model = served_model(body, served)
    max_tokens = body.get("max_tokens")
    if max_tokens is None or max_tokens < 1:
        raise bad_request(
            f"max_tokens is required: the most tokens to generate, an integer of at least 1 (got {max_tokens!r})",
            "max_tokens",
        )
    if not 0 <= body.get("temperature", 0) <= 1:
        raise bad_request(f"temperature must be from 0 to 1, got {body['temperature']}", "temperature")
    _check_metadata(body.get("metadata"))
    stops = _stop_sequences(body.get("stop_sequences", []))
    prompt, tool_calling = render_prompt(body, render_chat)
    sampling_body = {key: body[key] for key in ("temperature", "top_p", "top_k", "stream") if key in body}
    extra = tool_constraint(tool_calling, {}, "tools")
    if stops:
        sampling_body["stop"] = list(stops)
        extra["include_stop_str_in_output"] = True  # the answer names the stop sequence that matched
    generation = make_generation(sampling_body, model, [prompt], max_tokens, None, False, NAMES, extra)
    generation.tool_calling = tool_calling
    return MessagesRequest(generation, stops, body.get("thinking", {}).get("type") == "enabled")


def parse_count_tokens(body: Any, served: list[str], render_chat: Callable[[list[dict]], str]) -> str:
    """The prompt a /v1/messages/count_tokens body stands for, rendered as /v1/messages renders it."""
    body = check_fields(body, PROMPT_FIELDS, UNSUPPORTED, FIELD_TYPES)
    served_model(body, served)
    return render_prompt(body, render_chat)[0]


def render_prompt(body: dict, render_chat: Callable[[list[dict]], str]) -> tuple[str, ToolCalling | None]:
    """The prompt text of a checked body's system, messages and tools, and the tools the model may call."""
    _check_thinking(body.get("thinking", {"type": "disabled"}))
    tool_calling = _tool_calling(body)
    messages = _messages(body.get("messages"))
    prefill = _prefill(messages, tool_calling)
    system = _text(body["system"], "system") if "system" in body else ""
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return render_chat(conversation(messages, tool_calling)) + prefill, tool_calling


def _check_thinking(thinking: dict) -> None:
    """{"type": "disabled"}, or {"type": "enabled", "budget_tokens": n} (n accepted, not enforced)."""
    budget = thinking.get("budget_tokens")
    if thinking == {"type": "disabled"} or (
        thinking.get("type") == "enabled"
        and set(thinking) == {"type", "budget_tokens"}
        and isinstance(budget, int)
        and not isinstance(budget, bool)
        and budget >= 1
    ):
        return
    raise bad_request(
        'thinking must be {"type": "disabled"} or {"type": "enabled", "budget_tokens": n} (n at least 1; '
        f"the model's reasoning is not cut at n tokens: max_tokens limits it), got {thinking!r}",
        "thinking",
    )


def _check_metadata(metadata: dict | None) -> None:
    if metadata is None:
        return
    extra = set(metadata) - {"user_id"}
    if extra:
        raise bad_request(f"metadata has unknown field(s) {sorted(extra)}; it takes only user_id", "metadata")
    if not isinstance(metadata.get("user_id", ""), str | None):
        raise bad_request(f"metadata.user_id must be a string, got {metadata['user_id']!r}", "metadata.user_id")


def _stop_sequences(stops: list) -> tuple[str, ...]:
    if not all(isinstance(s, str) and s for s in stops):
        raise bad_request(f"stop_sequences must be an array of non-empty strings, got {stops!r}", "stop_sequences")
    return tuple(stops)


def _messages(messages: Any) -> list[dict]:
    """`messages` as chat messages: user and assistant turns (with their tool_calls) and `tool` results."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages is required: a non-empty array of {role, content} messages", "messages")
    out: list[dict] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object with role and content, got {message!r}", param)
        extra = set(message) - {"role", "content"}
        if extra:
            raise bad_request(f"{param} has unknown field(s) {sorted(extra)}; a message has role and content", param)
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(
                f"{param}.role must be 'user' or 'assistant', got {role!r} (a system prompt goes in the "
                "top-level system field)",
                f"{param}.role",
            )
        blocks = _blocks(message.get("content"), role, f"{param}.content")
        out += _user_turns(blocks) if role == "user" else [_assistant_turn(blocks)]
    return out


def _blocks(content: Any, role: str, param: str) -> list[dict]:
    """A message's content as checked blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise bad_request(f"{param} must be a string or a non-empty array of content blocks, got {content!r}", param)
    allowed = BLOCK_KEYS[role]
    for j, block in enumerate(content):
        where = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise bad_request(
                f"{where}: {'an' if role == 'assistant' else 'a'} {role} message's content blocks must be of type "
                f"{sorted(allowed)}, got "
                f"{str(block)[:80]} (other block types are not supported by this server)",
                where,
            )
        extra = {key for key, value in block.items() if value is not None} - allowed[kind]
        if extra:
            raise bad_request(f"{where} ({kind}) has unknown field(s) {sorted(extra)}", where)
        for key, (types, name) in BLOCK_FIELDS[kind].items():
            if not isinstance(block.get(key), types):
                raise bad_request(f"{where}.{key} must be {name}, got {block.get(key)!r}", f"{where}.{key}")
    return content


def _user_turns(blocks: list[dict]) -> list[dict]:
    """A user message: its text blocks as user turns, each tool_result as a `tool` message, in order."""
    turns: list[dict] = []
    texts: list[str] = []
    for block in blocks:
        if block["type"] == "text":
            texts.append(block["text"])
            continue
        if texts:
            turns.append({"role": "user", "content": JOIN.join(texts)})
            texts = []
        result = block.get("content")
        result = "" if result is None else _text(result, f"tool_result {block['tool_use_id']!r} content")
        if block.get("is_error"):
            result = f"Error: {result}"
        turns.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
    if texts:
        turns.append({"role": "user", "content": JOIN.join(texts)})
    return turns


def _assistant_turn(blocks: list[dict]) -> dict:
    """An assistant message: its text, its tool_use blocks as the turn's tool_calls, and its thinking blocks as
    its reasoning_content (the chat template decides whether to show it; redacted thinking is dropped)."""
    calls = [
        {
            "id": block["id"],
            "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])},
        }
        for block in blocks
        if block["type"] == "tool_use"
    ]
    text = JOIN.join(block["text"] for block in blocks if block["type"] == "text")
    thought = JOIN.join(block["thinking"] for block in blocks if block["type"] == "thinking")
    return {
        "role": "assistant",
        "content": text,
        "tool_calls": calls,
        **({"reasoning_content": thought} if thought else {}),
    }


def _prefill(messages: list[dict], tool_calling: ToolCalling | None) -> str:
    """The text a last assistant turn starts the answer with (taken off `messages`), or ""."""
    last = messages[-1]
    if last["role"] != "assistant":
        return ""
    where = f"messages[{len(messages) - 1}]"
    if last["tool_calls"]:
        raise bad_request(
            f"{where}: the last message is an assistant turn with tool_use blocks; send their tool_result "
            "blocks in a user message after it",
            where,
        )
    if tool_calling is not None and tool_calling.choice != "auto":
        raise bad_request(
            f"{where}: a last assistant message (prefill) cannot be continued when tool_choice forces a tool call",
            where,
        )
    if last["content"] != last["content"].rstrip():
        raise bad_request(f"{where}: the final assistant content cannot end with trailing whitespace", where)
    if len(messages) == 1:
        raise bad_request(f"{where}: an assistant message to continue needs a user message before it", where)
    messages.pop()
    return last["content"]


def _text(content: Any, param: str) -> str:
    """A string, or a non-empty array of text blocks (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, block in enumerate(content):
            if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
                raise bad_request(
                    f"{param}[{j}] must be a text block {{'type': 'text', 'text': ...}} (other block types are not "
                    f"supported by this server), got {str(block)[:80]}",
                    param,
                )
            texts.append(block["text"])
        return JOIN.join(texts)
    raise bad_request(f"{param} must be a string or a non-empty array of text blocks, got {content!r}", param)


def _tool_calling(body: dict) -> ToolCalling | None:
    """Anthropic's tools and tool_choice, checked as chat's are (tools.py) once in chat's shape."""
    tools = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(body.get("tools") or [])]
    names = [tool["function"]["name"] for tool in tools]
    chat: dict[str, Any] = {"tools": tools} if tools else {}
    if "tool_choice" in body:
        choice, parallel = _tool_choice(body["tool_choice"], names)
        if tools or choice not in ("auto", "none"):  # auto or none without tools: nothing to call
            chat["tool_choice"], chat["parallel_tool_calls"] = choice, parallel
    return parse_tool_calling(chat, flat=True)  # errors name tools[i].name, not tools[i].function.name


def _tool(tool: Any, param: str) -> dict:
    """A custom tool {"name", "description", "input_schema"} in chat's shape."""
    if not isinstance(tool, dict):
        raise bad_request(f'{param} must be a tool {{"name", "description", "input_schema"}}, got {tool!r}', param)
    if tool.get("type", "custom") not in ("custom", None):
        raise unsupported(param, f" (a {tool['type']!r} tool: only custom tools with an input_schema are supported)")
    extra = {key for key, value in tool.items() if value is not None} - TOOL_KEYS
    if extra:
        raise bad_request(f"{param} has unknown field(s) {sorted(extra)}; a tool has {sorted(TOOL_KEYS)}", param)
    schema = tool.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise bad_request(
            f'{param}.input_schema is required: a JSON schema object with "type": "object", got {schema!r}',
            f"{param}.input_schema",
        )
    function = {"name": tool.get("name"), "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict, names: list[str]) -> tuple[Any, bool]:
    """tool_choice in chat's terms, and whether more than one call is allowed."""
    kind = choice.get("type")
    if kind not in CHOICE_KEYS or set(choice) - CHOICE_KEYS[kind]:
        raise bad_request(
            'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or '
            f'{{"type": "none"}} (auto, any and tool may add disable_parallel_tool_use), got {choice!r}',
            "tool_choice",
        )
    disable_parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable_parallel, bool):
        raise bad_request(
            f"tool_choice.disable_parallel_tool_use must be a boolean, got {disable_parallel!r}", "tool_choice"
        )
    if kind != "tool":
        return CHAT_CHOICE[kind], not disable_parallel
    if choice.get("name") not in names:
        raise bad_request(
            f"tool_choice names tool {choice.get('name')!r}, which is not among the tools {names}", "tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}, not disable_parallel
