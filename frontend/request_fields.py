"""A request body's fields checked before anything else: each one known to its route and of its JSON type
(a known field this server cannot honour is a 400 that says so), and the served model it names."""

from __future__ import annotations

from typing import Any

from .errors import bad_request, model_not_found, unsupported

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
    "priority": _INT,
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
    "chat_template_kwargs": (dict,),
}
_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    str: "a string",
    list: "an array",
    dict: "an object",
}


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
