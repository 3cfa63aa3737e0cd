"""Structured output and tool calling through the real stack. Through the `openai` SDK and the front door: 16
concurrent requests with different JSON schemas return JSON that validates (jsonschema); regex and choice
constraints hold over 20 seeded samples each; forced tool calls carry arguments that fit the function's schema;
bad schemas are 400s. Through Triton's own endpoints: constraints under speculative decoding, a schema as a
generate parameter, clear errors for everything that does not compile. No KV block is left behind."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from client import ServerError, generate_grpc, generate_http
from testkit.concurrency import raise_first_error, run_concurrently

pytestmark = pytest.mark.integration

MODEL = "llm"
MAX_TOKENS = 200


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": required or list(properties),
        "additionalProperties": False,
    }


def _string(max_length: int, **extra) -> dict:
    return {"type": "string", "maxLength": max_length, **extra}


# (what to ask for, schema): objects, arrays, enums, nesting, numbers with bounds
SCHEMAS = [
    ("a person", _object({"name": _string(20), "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    (
        "a list of small integers",
        {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 10}, "minItems": 2, "maxItems": 5},
    ),
    ("a color", _object({"color": {"enum": ["red", "green", "blue"]}})),
    (
        "a user account",
        _object({"user": _object({"id": {"type": "integer", "minimum": 1, "maximum": 99999}, "email": _string(30)})}),
    ),
    (
        "the weather",
        _object(
            {
                "temperature": {"type": "number", "minimum": -50, "maximum": 50},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            }
        ),
    ),
    ("a review decision", _object({"approved": {"type": "boolean"}, "level": {"enum": ["low", "medium", "high"]}})),
    (
        "a shopping cart",
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": _object({"sku": _string(8), "qty": {"type": "integer", "minimum": 1, "maximum": 99}}),
        },
    ),
    ("an answer", {"enum": ["yes", "no", "unknown"]}),
    (
        "a 2x2 matrix of digits",
        _object(
            {
                "matrix": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {
                        "type": "array",
                        "minItems": 2,
                        "maxItems": 2,
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                }
            }
        ),
    ),
    ("a probability", _object({"score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}})),
    (
        "a city and its coordinates",
        _object(
            {
                "city": _string(20),
                "location": _object(
                    {
                        "lat": {"type": "number", "minimum": -90, "maximum": 90},
                        "lon": {"type": "number", "minimum": -180, "maximum": 180},
                    }
                ),
            }
        ),
    ),
    (
        "tags for a news article",
        _object(
            {"tags": {"type": "array", "items": {"enum": ["news", "sports", "tech"]}, "minItems": 1, "maxItems": 3}}
        ),
    ),
    (
        "a versioned counter",
        _object({"version": {"const": 2}, "count": {"type": "integer", "minimum": 10, "maximum": 20}}),
    ),
    ("a US zip code", _object({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("an identifier", _object({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, _string(10)]}})),
    (
        "a book",
        _object({"title": _string(30), "year": {"type": ["integer", "null"], "minimum": 1900, "maximum": 2100}}),
    ),
]


@pytest.fixture(scope="module")
def chat(reference):
    """The prompt as the instruct model expects it (its chat template)."""
    tokenizer = reference.tokenizer

    def prompt(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    return prompt


def blocks_back_to_zero(server, model: str = MODEL) -> None:
    m = server.wait_idle(model)
    assert m.get("llm_kv_cache_blocks_used", model) == 0


@pytest.fixture(scope="module")
def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def ask_json(server, chat, what: str, schema: dict, model: str = MODEL, **sampling):
    sampling = {"guided_json": schema, "max_tokens": MAX_TOKENS, "temperature": 0, **sampling}
    return generate_grpc(chat(f"Reply in JSON with {what}."), server.grpc_url, model, sampling=sampling)


def check_json(completion, schema: dict, what: str) -> None:
    assert completion.finish_reason == "stop", (what, completion.text)
    jsonschema.validate(json.loads(completion.text), schema)


def test_sixteen_concurrent_requests_with_different_schemas(server, sdk):
    def ask(what, schema):
        return sdk.chat.completions.create(
            model=MODEL,
            messages=user(f"Reply in JSON with {what}."),
            temperature=0,
            max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )

    server.wait_idle(MODEL)
    results = run_concurrently(ask, SCHEMAS)
    raise_first_error(results, "constrained request")
    for (what, schema), reply in zip(SCHEMAS, results):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (what, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    any_object = sdk.chat.completions.create(
        model=MODEL,
        messages=user("Give me a JSON object describing a cat with its name and age."),
        temperature=0,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
    )
    choice = any_object.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # an object with unbounded strings may run to max_tokens
        assert choice.message.content.startswith("{") and any_object.usage.completion_tokens == MAX_TOKENS
    blocks_back_to_zero(server)


REGEX = r"[A-Z][a-z]{2,9} [0-9]{1,3}(\.[0-9])?"
CHOICES = ["apple", "banana", "cherry", "durian"]


def test_regex_holds_over_twenty_seeded_samples(server, sdk):
    def one(seed):
        reply = sdk.chat.completions.create(
            model=MODEL,
            messages=user("Name a city and a number."),
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_regex": REGEX},
        )
        return reply.choices[0]

    results = run_concurrently(one, [(seed,) for seed in range(20)])
    raise_first_error(results, "regex request")
    for choice in results:
        assert choice.finish_reason == "stop" and re.fullmatch(REGEX, choice.message.content), choice.message
    assert len({c.message.content for c in results}) > 1, "twenty seeds gave one output: sampling did not vary"
    again = one(5)
    assert again.message.content == results[5].message.content  # seeded
    blocks_back_to_zero(server)


def test_choice_holds_over_twenty_seeded_samples_and_parallel_samples(server, sdk):
    def one(seed):
        reply = sdk.completions.create(
            model=MODEL,
            prompt="My favourite fruit is",
            max_tokens=10,
            temperature=1.5,
            seed=seed,
            extra_body={"structured_outputs": {"choice": CHOICES}},
        )
        return reply.choices[0]

    results = run_concurrently(one, [(seed,) for seed in range(20)])
    raise_first_error(results, "choice request")
    for choice in results:
        assert choice.finish_reason == "stop" and choice.text in CHOICES, choice.text
    parallel = sdk.chat.completions.create(
        model=MODEL, messages=user("Pick a fruit."), n=4, temperature=1.5, seed=1, extra_body={"guided_choice": CHOICES}
    )
    assert len(parallel.choices) == 4
    assert all(c.finish_reason == "stop" and c.message.content in CHOICES for c in parallel.choices)
    blocks_back_to_zero(server)


WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit", "days"],
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The forecast for a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 40}},
                "required": ["zone"],
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = user("What will the weather be in Paris for the next 3 days?")


def streamed_tool_calls(sdk, **kw) -> tuple[list[tuple[str, str]], str]:
    """(name, arguments) of each tool call of a streamed chat answer, and its finish_reason."""
    calls, finish_reason = {}, None
    for chunk in sdk.chat.completions.create(model=MODEL, messages=QUESTION, stream=True, **kw):
        choice = chunk.choices[0]
        for call in choice.delta.tool_calls or []:
            assert call.id.startswith("call_") and call.type == "function"
            calls[call.index] = (call.function.name, call.function.arguments)
        finish_reason = choice.finish_reason or finish_reason
    return [calls[i] for i in sorted(calls)], finish_reason


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_a_forced_tool_call_returns_valid_arguments_for_the_declared_function(server, sdk, tool_choice):
    kw = dict(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, temperature=0, max_tokens=100)
    reply = sdk.chat.completions.create(model=MODEL, messages=QUESTION, **kw)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    [call] = choice.message.tool_calls
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert streamed_tool_calls(sdk, **kw) == ([(call.function.name, call.function.arguments)], "tool_calls")
    blocks_back_to_zero(server)


def test_auto_tool_choice_answers_in_text_or_with_valid_calls(server, sdk):
    reply = sdk.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=100)
    choice = reply.choices[0]
    if choice.message.tool_calls:  # the model chose to call
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name in PARAMETERS and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    blocks_back_to_zero(server)


@pytest.mark.parametrize(
    "request_kw, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "the JSON schema does not compile",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "does not compile",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "not among the tools"),
        ({"extra_body": {"guided_regex": "[0-9"}}, "the regular expression does not compile"),
    ],
)
def test_bad_schemas_and_tools_are_400s_through_the_sdk(server, sdk, request_kw, message):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            reply = sdk.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=8, stream=stream, **request_kw
            )
            list(reply) if stream else None
        assert info.value.status_code == 400 and message in info.value.message
    blocks_back_to_zero(server)


@pytest.mark.parametrize("model", ["llm_spec_draft", "llm_spec_ngram"])
def test_constraints_hold_under_speculative_decoding(server, chat, model):
    server.wait_idle(model)
    cases = SCHEMAS[:6]
    results = run_concurrently(lambda what, schema: ask_json(server, chat, what, schema, model), cases)
    raise_first_error(results, "constrained request")
    for (what, schema), completion in zip(cases, results):
        check_json(completion, schema, what)
    assert server.metrics().get("llm_spec_decode_num_draft_tokens_total", model) > 0
    blocks_back_to_zero(server, model)


def test_generate_endpoint_takes_a_schema_as_a_request_parameter(server, chat):
    """docs/structured_output.md's curl example: guided_json as a string among the generate body's keys."""
    what, schema = SCHEMAS[0]
    completion = generate_http(
        chat(f"Reply in JSON with {what}."),
        server.http_url,
        MODEL,
        exclude_input_in_output=True,
        guided_json=json.dumps(schema),
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    check_json(completion, schema, what)


@pytest.mark.parametrize(
    "sampling, message",
    [
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
            "the JSON schema does not compile: Invalid type: nope",
        ),
        ({"guided_json": '{"type": "object", '}, "guided_json must be a JSON schema: Expecting property name"),
        ({"guided_regex": "[0-9"}, "the regular expression does not compile: "),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar is not a valid grammar: "),
        ({"guided_grammar": "start: x y ::="}, "the grammar does not compile: "),
        ({"guided_choice": []}, "guided_choice must be a non-empty list of non-empty strings"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "give at most one output constraint"),
        ({"structured_outputs": {"yaml": "a: 1"}}, "unknown structured_outputs key(s) ['yaml']"),
    ],
)
def test_bad_constraints_get_a_clear_error_and_the_server_keeps_serving(server, chat, sampling, message):
    with pytest.raises(ServerError) as info:
        generate_grpc("Hello", server.grpc_url, MODEL, sampling={"max_tokens": 8, **sampling})
    assert message in str(info.value)
    with pytest.raises(ServerError) as info:
        generate_http("Hello", server.http_url, MODEL, sampling={"max_tokens": 8, **sampling})
    assert "HTTP 400" in str(info.value) and message in str(info.value)
    what, schema = SCHEMAS[2]
    check_json(ask_json(server, chat, what, schema), schema, what)
    blocks_back_to_zero(server)
