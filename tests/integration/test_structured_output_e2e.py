"""Structured output through the real server: 16 concurrent requests with different JSON schemas return JSON that
validates (jsonschema); regex and choice constraints hold over 20 seeded samples each; constraints hold under
speculative decoding; schemas and grammars that do not compile get a clear error; no KV block is left behind."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from client import ServerError, generate_grpc, generate_http
from llm_testlib import raise_first_error, run_concurrently

pytestmark = pytest.mark.integration

MODEL = "llm"
MAX_TOKENS = 200


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


def _string(max_length: int, **extra) -> dict:
    return {"type": "string", "maxLength": max_length, **extra}


# (what to ask for, schema): objects, arrays, enums, nesting, numbers with bounds
SCHEMAS = [
    ("a person", _object({"name": _string(20), "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a list of small integers", {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 10},
                                  "minItems": 2, "maxItems": 5}),
    ("a color", _object({"color": {"enum": ["red", "green", "blue"]}})),
    ("a user account", _object({"user": _object({"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                                                 "email": _string(30)})})),
    ("the weather", _object({"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                             "humidity": {"type": "integer", "minimum": 0, "maximum": 100}})),
    ("a review decision", _object({"approved": {"type": "boolean"}, "level": {"enum": ["low", "medium", "high"]}})),
    ("a shopping cart", {"type": "array", "minItems": 1, "maxItems": 3,
                         "items": _object({"sku": _string(8), "qty": {"type": "integer", "minimum": 1, "maximum": 99}})}),
    ("an answer", {"enum": ["yes", "no", "unknown"]}),
    ("a 2x2 matrix of digits", _object({"matrix": {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    }})),
    ("a probability", _object({"score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}})),
    ("a city and its coordinates", _object({"city": _string(20), "location": _object({
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180}})})),
    ("tags for a news article", _object({"tags": {"type": "array", "items": {"enum": ["news", "sports", "tech"]},
                                                  "minItems": 1, "maxItems": 3}})),
    ("a versioned counter", _object({"version": {"const": 2}, "count": {"type": "integer", "minimum": 10, "maximum": 20}})),
    ("a US zip code", _object({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("an identifier", _object({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, _string(10)]}})),
    ("a book", _object({"title": _string(30), "year": {"type": ["integer", "null"], "minimum": 1900, "maximum": 2100}})),
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


def ask_json(server, chat, what: str, schema: dict, model: str = MODEL, **sampling):
    sampling = {"guided_json": schema, "max_tokens": MAX_TOKENS, "temperature": 0, **sampling}
    return generate_grpc(chat(f"Reply in JSON with {what}."), server.grpc_url, model, sampling=sampling)


def check_json(completion, schema: dict, what: str) -> None:
    assert completion.finish_reason == "stop", (what, completion.text)
    jsonschema.validate(json.loads(completion.text), schema)


def test_sixteen_concurrent_requests_with_different_schemas(server, chat):
    server.wait_idle(MODEL)
    results = run_concurrently(lambda what, schema: ask_json(server, chat, what, schema), SCHEMAS)
    raise_first_error(results, "constrained request")
    for (what, schema), completion in zip(SCHEMAS, results):
        check_json(completion, schema, what)
    blocks_back_to_zero(server)


REGEX = r"[A-Z][a-z]{2,9} [0-9]{1,3}(\.[0-9])?"
CHOICES = ["apple", "banana", "cherry", "durian"]


def test_regex_holds_over_twenty_seeded_samples(server, chat):
    def one(seed):
        return generate_grpc(chat("Name a city and a number."), server.grpc_url, MODEL,
                             sampling={"guided_regex": REGEX, "max_tokens": 40, "temperature": 1.0, "seed": seed})

    results = run_concurrently(one, [(seed,) for seed in range(20)])
    raise_first_error(results, "regex request")
    for completion in results:
        assert completion.finish_reason == "stop" and re.fullmatch(REGEX, completion.text), completion.text
    assert len({c.text for c in results}) > 1, "twenty seeds gave one output: sampling did not vary"
    again = one(5)
    assert again.text == results[5].text  # seeded
    blocks_back_to_zero(server)


def test_choice_holds_over_twenty_seeded_samples_and_parallel_samples(server, chat):
    def one(seed):
        return generate_http(chat("Pick a fruit."), server.http_url, MODEL, exclude_input_in_output=True,
                             sampling={"structured_outputs": {"choice": CHOICES}, "max_tokens": 10,
                                       "temperature": 1.5, "seed": seed})

    results = run_concurrently(one, [(seed,) for seed in range(20)])
    raise_first_error(results, "choice request")
    for completion in results:
        assert completion.finish_reason == "stop" and completion.text in CHOICES, completion.text
    parallel = generate_grpc(chat("Pick a fruit."), server.grpc_url, MODEL,
                             sampling={"guided_choice": CHOICES, "n": 4, "temperature": 1.5, "seed": 1})
    assert len(parallel.samples) == 4
    assert all(s.finish_reason == "stop" and s.text in CHOICES for s in parallel.samples.values())
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
    """The README's curl example: guided_json as a string among the generate body's keys."""
    what, schema = SCHEMAS[0]
    completion = generate_http(chat(f"Reply in JSON with {what}."), server.http_url, MODEL,
                               exclude_input_in_output=True, guided_json=json.dumps(schema),
                               max_tokens=MAX_TOKENS, temperature=0)
    check_json(completion, schema, what)


@pytest.mark.parametrize("sampling, message", [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
     "the JSON schema does not compile: Invalid type: nope"),
    ({"guided_json": '{"type": "object", '}, "guided_json must be a JSON schema: Expecting property name"),
    ({"guided_regex": "[0-9"}, "the regular expression does not compile: "),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar is not a valid grammar: "),
    ({"guided_grammar": "start: x y ::="}, "the grammar does not compile: "),
    ({"guided_choice": []}, "guided_choice must be a non-empty list of non-empty strings"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "give at most one output constraint"),
    ({"structured_outputs": {"yaml": "a: 1"}}, "unknown structured_outputs key(s) ['yaml']"),
])
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
