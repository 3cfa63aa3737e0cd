"""Bad input gets a clear error (asserted on the message), over HTTP generate and gRPC, and the server still
answers a good request afterwards."""

from __future__ import annotations

import http.client
import json
import queue

import numpy as np
import pytest

from client import ServerError, generate_grpc, generate_http

pytestmark = pytest.mark.integration

MODEL = "llm"
MAX_MODEL_LEN = 4096  # the `llm` variant's max_model_len (config.pbtxt default)
LONG_TEXT = "The history of the bicycle begins in the early nineteenth century. " * 9  # ~100 tokens
TOO_LONG_PROMPT = "hello " * 5000  # > 4096 tokens on its own


def post_generate(server, body: dict | bytes) -> tuple[int, dict]:
    """POST /v2/models/llm/generate with an arbitrary body; (status, JSON answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", f"/v2/models/{MODEL}/generate", body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read().decode("utf-8", "replace"))
    finally:
        conn.close()


def raw_grpc(server, inputs: list) -> str | None:
    """Send hand-made InferInputs over a gRPC stream; the error message of the first response, or None."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        _, error = answers.get(timeout=60)
        return error.message() if error is not None else None
    finally:
        # Not cancel_requests=True: the request is answered already, and with Triton 2.51 cancelling a stream
        # whose request Triton itself rejected (wrong dtype / shape) leaks a reference to the model, which
        # then never unloads at shutdown ("Exit timeout expired", exit code 1).
        client.stop_stream(cancel_requests=False)
        client.close()


def tensor(name: str, values, datatype: str, np_dtype):
    import tritonclient.grpc as grpcclient

    array = np.array(values, dtype=np_dtype)
    inp = grpcclient.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array)
    return inp


def good_request_works(server, transport: str) -> None:
    if transport == "http":
        got = generate_http("The capital of France is", server.http_url, MODEL, max_tokens=3, temperature=0.0)
    else:
        got = generate_grpc("The capital of France is", server.grpc_url, MODEL, max_tokens=3, temperature=0.0)
    assert len(got.token_ids) == 3 and got.finish_reason == "length"


# (id, prompt, keyword arguments of generate_http / generate_grpc, substrings the error message must hold)
# Flat keys become model inputs (HTTP: JSON keys Triton maps to inputs or to request parameters; gRPC:
# tensors with the contract's dtypes); `sampling` is the sampling_parameters JSON (a dict or a raw string).
CASES = [
    ("empty_prompt", "", {"max_tokens": 4}, ["text_input", "non-empty"]),
    (
        "prompt_plus_max_tokens_over_model_len",
        LONG_TEXT,
        {"max_tokens": MAX_MODEL_LEN - 10},
        ["exceed the model's limit of 4096 tokens", f"max_tokens is {MAX_MODEL_LEN - 10}"],
    ),
    (
        "prompt_alone_over_model_len",
        TOO_LONG_PROMPT,
        {"max_tokens": 1},
        ["prompt has 5001 tokens", "limit of 4096 tokens"],
    ),
    ("negative_max_tokens", "Hi", {"max_tokens": -3}, ["max_tokens must be between 1 and 4096, got -3"]),
    ("zero_max_tokens", "Hi", {"max_tokens": 0}, ["max_tokens must be between 1 and 4096, got 0"]),
    ("huge_max_tokens", "Hi", {"max_tokens": 10**9}, ["max_tokens must be between 1 and 4096, got 1000000000"]),
    ("negative_temperature", "Hi", {"temperature": -0.5}, ["temperature must be between", "got -0.5"]),
    ("top_p_zero", "Hi", {"top_p": 0.0}, ["top_p must be in (0, 1]", "got 0"]),
    ("top_p_above_one", "Hi", {"top_p": 1.5}, ["top_p must be in (0, 1]", "got 1.5"]),
    ("negative_top_k", "Hi", {"top_k": -5}, ["top_k must be", "got -5"]),
    ("n_above_max_n", "Hi", {"n": 9}, ["n must be between 1 and 8, got 9"]),
    ("repetition_penalty_zero", "Hi", {"repetition_penalty": 0.0}, ["repetition_penalty must be in (0, 10]"]),
    (
        "min_tokens_above_max_tokens",
        "Hi",
        {"max_tokens": 4, "min_tokens": 10},
        ["min_tokens must be between 0 and 4", "got 10"],
    ),
    ("malformed_sampling_json", "Hi", {"sampling": '{"max_tokens": 4,'}, ["sampling_parameters must be a JSON object"]),
    (
        "sampling_parameters_not_object",
        "Hi",
        {"sampling": "[1, 2]"},
        ["sampling_parameters must be a JSON object, got list"],
    ),
    ("unknown_sampling_key", "Hi", {"sampling": {"max_tokenz": 4}}, ["unknown sampling parameter", "max_tokenz"]),
    ("stop_not_a_list", "Hi", {"sampling": {"stop": 5}}, ["stop must be a string or a list of strings, got 5"]),
    ("empty_stop_string", "Hi", {"sampling": {"stop": [""]}}, ["stop strings must not be empty"]),
    ("negative_seed", "Hi", {"sampling": {"seed": -1}}, ["seed must be between 0 and", "got -1"]),
    (
        "temperature_not_a_number",
        "Hi",
        {"sampling": {"temperature": "hot"}},
        ["temperature must be a number, got 'hot'"],
    ),
    ("ignore_eos_not_bool", "Hi", {"sampling": {"ignore_eos": "maybe"}}, ["ignore_eos must be true or false"]),
    ("logprobs_too_many", "Hi", {"sampling": {"logprobs": 50}}, ["logprobs must be between 0 and 20, got 50"]),
    (
        "stop_token_id_outside_vocab",
        "Hi",
        {"sampling": {"stop_token_ids": [10**7]}},
        ["stop_token_ids must be token ids below"],
    ),
    ("n_above_max_n_in_sampling", "Hi", {"sampling": {"n": "99"}}, ["n must be between 1 and 8, got 99"]),
    # upper bounds on every input (docs/security.md, "Input bounds")
    (
        "prompt_over_max_prompt_bytes",
        "a" * 70000,
        {"max_tokens": 1},
        ["text_input is 70000 bytes of UTF-8; at most 65536 are allowed (max_prompt_bytes"],
    ),
    (
        "stop_string_too_long",
        "Hi",
        {"sampling": {"stop": ["x" * 300]}},
        ["stop strings must be at most 256 characters each, got one of 300"],
    ),
    (
        "too_many_stop_strings",
        "Hi",
        {"sampling": {"stop": [f"s{i}" for i in range(17)]}},
        ["stop takes at most 16 strings, got 17"],
    ),
    (
        "too_many_stop_token_ids",
        "Hi",
        {"sampling": {"stop_token_ids": list(range(100))}},
        ["stop_token_ids takes at most 64 ids, got 100"],
    ),
    ("top_k_above_vocabulary", "Hi", {"top_k": 10**6}, ["top_k must be at most the vocabulary size 49152"]),
    (
        "sampling_parameters_too_large",
        "Hi",
        {"sampling": '{"stop": "' + "y" * 70000 + '"}'},
        ["sampling_parameters is 70012 bytes of JSON; at most 65536 are allowed"],
    ),
]


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("prompt,kwargs,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_clear_error(server, transport, prompt, kwargs, expected):
    kwargs = dict(kwargs)
    with pytest.raises(ServerError) as info:
        if transport == "http":
            generate_http(prompt, server.http_url, MODEL, **kwargs)
        else:
            generate_grpc(prompt, server.grpc_url, MODEL, stream=False, **kwargs)
    message = str(info.value)
    for piece in expected:
        assert piece in message, f"error message {message!r} lacks {piece!r}"
    if transport == "http":
        assert message.startswith("HTTP 400"), message
    good_request_works(server, transport)


def test_unknown_key_in_generate_body(server):
    status, answer = post_generate(server, {"text_input": "Hi", "max_tokens": 4, "bogus_option": 1})
    assert status == 400
    assert "unknown sampling parameter" in answer["error"] and "bogus_option" in answer["error"], answer
    good_request_works(server, "http")


def test_missing_text_input_http(server):
    status, answer = post_generate(server, {"max_tokens": 4})
    assert status == 400
    assert "text_input is required" in answer["error"], answer
    good_request_works(server, "http")


def test_missing_text_input_grpc(server):
    message = raw_grpc(server, [tensor("max_tokens", [4], "INT32", np.int32)])
    assert message is not None and "text_input" in message, message
    good_request_works(server, "grpc")


def test_invalid_utf8_prompt_grpc(server):
    with pytest.raises(ServerError, match="text_input must be valid UTF-8"):
        generate_grpc(b"\xff\xfe not utf-8", server.grpc_url, MODEL, max_tokens=4)
    good_request_works(server, "grpc")


def test_invalid_utf8_stop_string_grpc(server):
    with pytest.raises(ServerError, match="stop must be valid UTF-8"):
        generate_grpc("Hi", server.grpc_url, MODEL, max_tokens=4, stop=[b"\xc3\x28"])
    good_request_works(server, "grpc")


def test_wrong_dtype_rejected_by_triton(server):
    """max_tokens as FP32 instead of INT32: Triton itself refuses it before the model sees it."""
    message = raw_grpc(
        server,
        [
            tensor("text_input", [b"Hi"], "BYTES", np.object_),
            tensor("max_tokens", [4.0], "FP32", np.float32),
        ],
    )
    assert message is not None and "max_tokens" in message and "INT32" in message and "FP32" in message, message
    good_request_works(server, "grpc")


def test_wrong_shape_rejected_by_triton(server):
    message = raw_grpc(server, [tensor("text_input", [b"a", b"b"], "BYTES", np.object_)])
    assert message is not None and "text_input" in message and "shape" in message, message
    good_request_works(server, "grpc")


def test_two_values_for_a_scalar_input(server):
    message = raw_grpc(
        server,
        [
            tensor("text_input", [b"Hi"], "BYTES", np.object_),
            tensor("stop", [b"a", b"b"], "BYTES", np.object_),
            tensor("max_tokens", [4], "INT32", np.int32),
        ],
    )
    assert message is None  # stop is a list: fine
    message = raw_grpc(
        server,
        [
            tensor("text_input", [b"Hi"], "BYTES", np.object_),
            tensor("temperature", [[0.5]], "FP32", np.float32),
        ],
    )
    assert message is not None and "temperature" in message, message
    good_request_works(server, "grpc")


def test_malformed_body_json(server):
    status, answer = post_generate(server, b'{"text_input": "Hi", ')
    # Triton's own JSON parser answers this one (with 500, not 400: Triton's choice, not the model's).
    assert status in (400, 500) and "failed to parse the request JSON" in answer.get("error", ""), answer
    good_request_works(server, "http")
