"""/v1/chat/completions and /v1/completions bodies checked and mapped onto the model's inputs (docs/frontend.md
has the table).

A chat or completion body becomes a `Generation` (frontend/generation.py): the prompt text(s) to send as
`text_input`, or token ids as `input_ids` (one Triton request per prompt; chat messages go through the model's
chat template) and the JSON for the model's `sampling_parameters`. Every field is type-checked
(frontend/request_fields.py) before anything is sent, and a field this server does not act on is a 400, never
silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import bad_request, unsupported
from .generation import PASSTHROUGH, Generation, make_generation
from .request_fields import check_fields, served_model
from .tools import conversation, parse_tool_calling, tool_constraint

DEFAULT_MAX_PROMPTS_PER_REQUEST = 64
COMMON = frozenset(
    PASSTHROUGH + ("model", "max_tokens", "stream", "stream_options", "user", "return_tokens_as_token_ids")
)
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
}
# chat_template_kwargs may not name the variables the chat template is rendered with already
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "logprobs", "suffix", "best_of"}
ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any, served: list[str], default_max_tokens: int, render_chat: Callable[..., str]) -> Generation:
    """A /v1/chat/completions body; `render_chat` applies the model's chat template (with
    `template_kwargs=` when the body gives chat_template_kwargs)."""
    body = check_fields(body, CHAT_FIELDS)
    model = served_model(body, served)
    if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] != body["max_completion_tokens"]:
        raise bad_request(
            "give max_completion_tokens or max_tokens, not both with different values", "max_completion_tokens"
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    constraint = _response_format(body.get("response_format"))
    tool_calling = parse_tool_calling(body)
    constraint = tool_constraint(tool_calling, constraint, "response_format")
    logprobs = None
    if body.get("logprobs"):
        logprobs = body.get("top_logprobs", 0)
    elif "top_logprobs" in body:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if "logprobs" in body and not isinstance(body["logprobs"], bool):
        raise bad_request(f"logprobs must be a boolean, got {body['logprobs']!r}", "logprobs")
    messages = conversation(chat_messages(body.get("messages")), tool_calling)
    template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    prompt = render_chat(messages, template_kwargs=template_kwargs) if template_kwargs else render_chat(messages)
    names = {
        "max_tokens": "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
        "logprobs": "top_logprobs",
    }
    if "response_format" in body:
        names.update(guided_json="response_format", guided_json_object="response_format")
    if tool_calling is not None:
        names["guided_grammar"] = "tools"
    generation = make_generation(body, model, [prompt], max_tokens, logprobs, False, names, constraint)
    generation.tool_calling = tool_calling
    return generation


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's chat_template_kwargs: more variables for the chat template (e.g. {"enable_thinking": false})."""
    taken = sorted(set(kwargs or {}) & set(TEMPLATE_VARIABLES))
    if taken:
        raise bad_request(
            f"chat_template_kwargs may not set {taken[0]!r}: the request's own fields give the template "
            f"{list(TEMPLATE_VARIABLES)}",
            "chat_template_kwargs",
        )
    return kwargs or {}


def _response_format(response_format: Any) -> dict[str, Any]:
    """OpenAI's response_format as the model's structured-output key: {} for text."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"guided_json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                'response_format.json_schema must be an object {"name": ..., "schema": {...}}',
                "response_format.json_schema",
            )
        schema = spec.get("schema")
        if schema is None:
            return {"guided_json_object": True}
        if not isinstance(schema, dict):
            raise bad_request(
                f"response_format.json_schema.schema must be a JSON schema object, got {schema!r}",
                "response_format.json_schema.schema",
            )
        return {"guided_json": schema}
    raise bad_request(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format.type"
    )


def parse_completion(
    body: Any,
    served: list[str],
    default_max_tokens: int,
    vocab_size: int,
    max_prompts: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
) -> Generation:
    """A /v1/completions body: `prompt` a string, a list of strings, a list of token ids or a list of such
    lists; at most `max_prompts` choices (prompts x n). `echo` with `logprobs` scores the prompt too."""
    body = check_fields(body, COMPLETION_FIELDS)
    model = served_model(body, served)
    if body.get("suffix"):
        raise unsupported("suffix")
    prompts = completion_prompts(body.get("prompt"), vocab_size)
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise bad_request(
            f"logprobs must be an integer (the number of alternatives, 0-20), got {logprobs!r}", "logprobs"
        )
    n = body.get("n", 1)
    if body.get("best_of", n) != n:
        raise unsupported("best_of", " (other than equal to n)")
    if isinstance(n, int) and len(prompts) * n > max_prompts:
        raise bad_request(
            f"this request asks for {len(prompts)} prompt(s) x n={n} = {len(prompts) * n} "
            f"completions; at most {max_prompts} are allowed per request (max_prompts_per_request)",
            "prompt",
            "too_many_prompts",
        )
    echo, max_tokens = body.get("echo", False), body.get("max_tokens", default_max_tokens)
    if max_tokens == 0 and not echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 only with echo: the prompt scored, nothing generated)", "max_tokens"
        )
    scoring = {"prompt_logprobs": logprobs or 0} if echo and (logprobs is not None or max_tokens == 0) else {}
    return make_generation(body, model, prompts, max_tokens, logprobs, echo, {}, scoring)


def chat_messages(messages: Any) -> list[dict]:
    if not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object with role and content", param)
        extra = set(message) - {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
        if extra:
            raise unsupported(f"{param}.{sorted(extra)[0]}")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"{param}.role must be one of {list(ROLES)}, got {role!r}", f"{param}.role")
        if not isinstance(message.get("reasoning_content", ""), str):
            raise bad_request(f"{param}.reasoning_content must be a string", f"{param}.reasoning_content")
        tool_calls = _tool_calls(message.get("tool_calls"), role, param)
        content = message.get("content")
        content = "" if content is None and tool_calls else _content(content, f"{param}.content")
        out.append(
            {**message, "role": "system" if role == "developer" else role, "content": content, "tool_calls": tool_calls}
        )
    return out


def _tool_calls(calls: Any, role: str, param: str) -> list[dict]:
    """An assistant message's earlier tool calls, each {"type": "function", "function": {name, arguments}}."""
    if calls is None:
        return []
    if role != "assistant":
        raise bad_request(f"{param}.tool_calls is only allowed on assistant messages", f"{param}.tool_calls")
    if not isinstance(calls, list):
        raise bad_request(f"{param}.tool_calls must be an array", f"{param}.tool_calls")
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        ):
            raise bad_request(
                f'{param}.tool_calls[{i}] must be {{"type": "function", "function": '
                f'{{"name": str, "arguments": str}}}}, got {call!r}',
                f"{param}.tool_calls",
            )
    return calls


def _content(content: Any, param: str) -> str:
    """Text content: a string, or an array of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"{param}: only text parts ({{'type': 'text', 'text': ...}}) are supported, got {part!r}", param
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{param} must be a string or an array of text parts, got {content!r}", param)


def completion_prompts(prompt: Any, vocab_size: int) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of token-id lists -> the prompts."""
    form = "a string, an array of strings, an array of token ids or an array of token-id arrays"
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_int(prompt[0])):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise bad_request(f"prompt is required: {form}", "prompt")
    for i, one in enumerate(prompts):
        if isinstance(one, str):
            if not one:
                raise bad_request("prompt must not be empty", "prompt")
        elif not isinstance(one, list) or not one or not all(_is_int(t) for t in one):
            raise bad_request(f"prompt must be {form}; prompt[{i}] is {str(one)[:40]}", "prompt")
        elif not all(0 <= t < vocab_size for t in one):
            bad = [t for t in one if not 0 <= t < vocab_size][:5]
            raise bad_request(
                f"prompt[{i}] holds token ids outside the vocabulary (0 to {vocab_size - 1}): {bad}", "prompt"
            )
    return list(prompts)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
