"""OpenAI request bodies checked and mapped onto the model's inputs (docs/frontend.md has the table).

A chat or completion body becomes a `Generation`: the prompt text(s) to send as `text_input`, or token ids
as `input_ids` (one Triton request per prompt; chat messages go through the model's chat template) and the
JSON for the model's `sampling_parameters`. Every field is type-checked here, and the sampling values are
validated with the engine's own rules (backend/protocol/sampling_params.py) before anything is sent, so a bad value is
a 400 naming the OpenAI parameter. A field this server does not act on is a 400, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backend.protocol.sampling_params import SamplingParams
from backend.protocol.values import InvalidRequest

from .errors import bad_request, model_not_found, unsupported
from .tools import ToolCalling, conversation, parse_tool_calling, tool_constraint

# OpenAI (and vLLM-extra) parameters passed through to sampling_parameters under the same name.
PASSTHROUGH = (
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    # vLLM's structured-output extras (the openai SDK sends them with extra_body)
    "guided_json",
    "guided_json_object",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "logit_bias",
)
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
}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "logprobs", "suffix", "best_of"}
# OpenAI parameters this server knows of and cannot honour: a 400 that says so (not "unknown").
UNSUPPORTED = frozenset(
    {
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "reasoning_effort",
        "web_search_options",
        "store",
        "metadata",
        "service_tier",
    }
)
ROLES = ("system", "developer", "user", "assistant", "tool")

_INT = (int,)
_NUMBER = (int, float)
# JSON types of each field (bool is checked apart: JSON true is not a number here).
TYPES: dict[str, tuple] = {
    "max_tokens": _INT,
    "max_completion_tokens": _INT,
    "n": _INT,
    "seed": _INT,
    "top_k": _INT,
    "min_tokens": _INT,
    "top_logprobs": _INT,
    "best_of": _INT,
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "min_p": _NUMBER,
    "repetition_penalty": _NUMBER,
    "stream": (bool,),
    "echo": (bool,),
    "ignore_eos": (bool,),
    "return_tokens_as_token_ids": (bool,),
    "model": (str,),
    "user": (str,),
    "stop": (str, list),
    "stop_token_ids": (list,),
    "logit_bias": (dict,),
    "stream_options": (dict,),
    "messages": (list,),
    "prompt": (str, list),
    "response_format": (dict,),
    "tools": (list,),
    "tool_choice": (str, dict),
    "parallel_tool_calls": (bool,),
}
_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    str: "a string",
    list: "an array",
    dict: "an object",
}


@dataclass
class Generation:
    """One OpenAI request in the model's terms."""

    model: str
    prompts: list[str | list[int]]  # text or token ids; each is one Triton request; choice = prompt * n + sample
    sampling: dict[str, Any]  # the model's sampling_parameters
    n: int
    stream: bool
    include_usage: bool  # streaming: a last chunk with usage (stream_options.include_usage)
    echo: bool  # completions: the prompt comes before the completion text
    logprobs: int | None  # None: none; k: each token's logprob and its top k alternatives
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    tool_calling: ToolCalling | None = None  # chat: tools the model may call (their calls parsed from its text)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def parse_chat(
    body: Any, served: list[str], default_max_tokens: int, render_chat: Callable[[list[dict]], str]
) -> Generation:
    """A /v1/chat/completions body; `render_chat` applies the model's chat template."""
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
    prompt = render_chat(conversation(chat_messages(body.get("messages")), tool_calling))
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


def check_fields(
    body: Any, allowed: frozenset, refused: frozenset = UNSUPPORTED, field_types: dict[str, tuple] = TYPES
) -> dict:
    """The body's fields without nulls (null means the default), each known and of its JSON type;
    `refused`: the route's known fields this server cannot honour (400 unsupported_parameter)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    for key in sorted(body):
        if key in refused:
            raise unsupported(key)
        if key not in allowed:
            raise bad_request(
                f"unrecognized request argument '{key}'; supported: {sorted(allowed)}", key, "unknown_parameter"
            )
        types = field_types.get(key)
        value = body[key]
        if types is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise bad_request(f"{key} must be {' or '.join(_TYPE_NAMES[t] for t in types)}, got {value!r}", key)
    return body


def served_model(body: dict, served: list[str]) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("model is required", "model")
    if model not in served:
        raise model_not_found(model, served)
    return model


def chat_messages(messages: Any) -> list[dict]:
    if not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object with role and content", param)
        extra = set(message) - {"role", "content", "name", "tool_calls", "tool_call_id"}
        if extra:
            raise unsupported(f"{param}.{sorted(extra)[0]}")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"{param}.role must be one of {list(ROLES)}, got {role!r}", f"{param}.role")
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


def make_generation(
    body: dict,
    model: str,
    prompts: list[str],
    max_tokens: Any,
    logprobs: int | None,
    echo: bool,
    names: dict[str, str],
    constraint: dict[str, Any] | None = None,
) -> Generation:
    stream = body.get("stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        extra = set(options) - {"include_usage"}
        if extra:
            raise unsupported(f"stream_options.{sorted(extra)[0]}")
        if not isinstance(options.get("include_usage", False), bool):
            raise bad_request("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    sampling = {key: body[key] for key in PASSTHROUGH if key in body}
    sampling["max_tokens"] = max_tokens
    sampling.update(constraint or {})
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    _validate(sampling, names)
    return Generation(
        model,
        prompts,
        sampling,
        sampling.get("n", 1),
        stream,
        bool((options or {}).get("include_usage")),
        echo,
        logprobs,
        body.get("return_tokens_as_token_ids", False),
    )


def _validate(sampling: dict, names: dict[str, str]) -> None:
    """The engine's own checks (its per-model limits, such as the largest n, are checked when it is sent);
    `names`: the OpenAI parameter behind an engine key where they differ."""
    try:
        SamplingParams.from_dict(sampling, max_n=1 << 16)
    except InvalidRequest as exc:
        field = str(exc).split(" ", 1)[0]  # e.g. "temperature", "logit_bias[50256]"
        base = field.split("[", 1)[0]
        raise bad_request(str(exc), names.get(base, field if base in sampling else None)) from None
