"""vllm_backend's client requests through the real server, in the shapes of its ci/ tests: the accuracy test's
`structured_outputs` request (JSON text inside `sampling_parameters`, the same dict as request parameters, a gRPC
stream) and the same constraint under the older `guided_decoding` key; the check-health test's requests and
readiness checks; StructuredOutputsParams' options and its structural tag; and the refusals of what the model does
not serve (another kind of model's inputs, malformed objects), each naming what was wrong, with the server serving
on and no KV block left behind. docs/interface.md, "vllm_backend's contract", is the page this holds to."""

from __future__ import annotations

import json
import os
import queue
import re
import urllib.error
import urllib.request
from functools import partial

import jsonschema
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

import launcher
from client import ServerError, generate_grpc, generate_http

pytestmark = pytest.mark.integration

MODEL = "llm"
# accuracy_test.py's structured-output prompt, sampling parameters and constraint
STRUCTURED_PROMPT = "Classify intent of the sentence: Harry Potter is underrated. "
CHOICES = ["Positive", "Negative"]
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def vllm_request(prompt: str, stream: bool, sampling_parameters: dict) -> list:
    """ci/common/test_util.py's create_vllm_request inputs: text_input, stream, sampling_parameters as JSON."""
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([stream], dtype=bool))
    inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
    inputs[-1].set_data_from_numpy(np.array([json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_))
    return inputs


def stream_results(server, prompt: str, stream: bool, sampling_parameters: dict) -> list:
    """Every response (result or error) of one request sent as vllm_backend's tests send it: on a gRPC stream,
    `outputs` [text_output], the sampling parameters also as request parameters."""
    responses: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), responses))
        client.async_stream_infer(
            model_name=MODEL,
            request_id="0",
            inputs=vllm_request(prompt, stream, sampling_parameters),
            outputs=[grpcclient.InferRequestedOutput("text_output")],
            parameters=sampling_parameters,
        )
        client.stop_stream()
    return [responses.get_nowait() for _ in range(responses.qsize())]


def text_of(results: list) -> str:
    for result in results:
        assert not isinstance(result, Exception), str(result)
    return "".join(r.as_numpy("text_output")[0].decode("utf-8") for r in results)


def blocks_back_to_zero(server) -> None:
    assert server.wait_idle(MODEL).get("llm_kv_cache_blocks_used", MODEL) == 0


def test_the_accuracy_tests_structured_outputs_request_answers_a_choice(server):
    """accuracy_test.py's test_structured_outputs request, unchanged: a non-streaming request on a gRPC stream
    answers the prompt then one of the choices; `guided_decoding` (vllm_backend <= 25.10) answers the same."""
    sampling = {"temperature": 0, "top_p": 1, "structured_outputs": json.dumps({"choice": CHOICES})}
    [result] = stream_results(server, STRUCTURED_PROMPT, False, sampling)
    answer = text_of([result])
    assert answer in [STRUCTURED_PROMPT + c for c in CHOICES], answer
    legacy = {"temperature": 0, "top_p": 1, "guided_decoding": json.dumps({"choice": CHOICES, "backend": "outlines"})}
    assert text_of(stream_results(server, STRUCTURED_PROMPT, False, legacy)) == answer
    streamed = text_of(stream_results(server, STRUCTURED_PROMPT, True, sampling))
    assert streamed == answer[len(STRUCTURED_PROMPT) :]  # a stream never repeats the prompt
    blocks_back_to_zero(server)


def test_the_check_health_tests_healthy_path(server):
    """check_health_test.py's test_vllm_is_healthy: three streamed requests each answer a sentence, and the
    model is ready by both of its checks (is_model_ready, the repository index: a restricted API here, asked with
    the admin key) before and after."""
    admin = {f"triton-grpc-protocol-{launcher.ADMIN_HEADER}": os.environ["LLM_ADMIN_KEY"]}  # gRPC's form

    def ready() -> bool:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            states = [m.state for m in client.get_model_repository_index(headers=admin).models if m.name == MODEL]
            assert len(states) == 1, "duplicate model index found"
            return client.is_model_ready(MODEL) and states[0] == "READY"

    sampling = {"temperature": "0", "top_p": "1"}
    for _ in range(3):
        assert ready()
        text = text_of(stream_results(server, "In this example,", True, sampling))
        assert len(text) > 0 and text.count(" ") > 4, text
    assert ready()


@pytest.fixture(scope="module")
def chat(reference):
    tokenizer = reference.tokenizer
    return lambda q: tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
    )


@pytest.mark.parametrize(
    "options, layout",
    [
        ({}, r'\{"x": -?\d+\}'),  # compact: one space after each separator
        ({"disable_any_whitespace": True}, r'\{"x": -?\d+\}'),
        ({"whitespace_pattern": "[ ]?"}, r'\{ ?"x" ?: ?-?\d+ ?\}'),
    ],
)
def test_structured_outputs_options_shape_the_json(server, chat, options, layout):
    constraint = {"json": POINT, "disable_additional_properties": True, **options}
    completion = generate_http(
        chat('Reply in JSON with a point, like {"x": 3}.'),
        server.http_url,
        MODEL,
        exclude_input_in_output=True,
        sampling={"structured_outputs": json.dumps(constraint), "max_tokens": 40, "temperature": 0},
    )
    assert completion.finish_reason == "stop", completion.text
    jsonschema.validate(json.loads(completion.text), {**POINT, "additionalProperties": False})
    assert re.fullmatch(layout, completion.text), completion.text


def test_a_structural_tag_constrains_what_follows_its_trigger(server):
    """A trigger every answer reaches (the first space): free text up to it, then the structure's begin text,
    JSON fitting its schema and its end text, then free text again."""
    tag = {"structures": [{"begin": " point=", "schema": POINT, "end": ";"}], "triggers": [" "]}
    completion = generate_grpc(
        "The capital of France is",
        server.grpc_url,
        MODEL,
        exclude_input_in_output=True,
        sampling={"structured_outputs": {"structural_tag": json.dumps(tag)}, "max_tokens": 24, "temperature": 0},
    )
    head, found, rest = completion.text.partition(" point=")
    assert found and " " not in head, completion.text
    body, end, _ = rest.partition(";")
    assert end, completion.text
    jsonschema.validate(json.loads(body), POINT)
    blocks_back_to_zero(server)


@pytest.mark.parametrize(
    "sampling, message",
    [
        (
            {"structured_outputs": json.dumps({"regex": "a", "choice": ["a"]})},
            "give at most one output constraint, got ['structured_outputs.regex', 'structured_outputs.choice']",
        ),
        ({"structured_outputs": "{}"}, "structured_outputs names no constraint: give one of ['json'"),
        (
            {"guided_decoding": json.dumps({"choice": CHOICES, "backend": "tensorrt"})},
            "guided_decoding.backend must be one of",
        ),
        (
            {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {}})}},
            "the 'format' form of a structural tag (xgrammar's) is not served",
        ),
        (
            {
                "structured_outputs": {
                    "structural_tag": {
                        "structures": [{"begin": "<a>", "schema": {"type": "nope"}, "end": ""}],
                        "triggers": ["<"],
                    }
                }
            },
            "the structural tag does not compile",
        ),
    ],
)
def test_malformed_objects_are_refused_naming_the_problem(server, sampling, message):
    for call, url in ((generate_grpc, server.grpc_url), (generate_http, server.http_url)):
        with pytest.raises(ServerError) as info:
            call("Hello", url, MODEL, sampling={"max_tokens": 8, **sampling})
        assert message in str(info.value) and info.value.kind == "invalid_request", str(info.value)
    [result] = stream_results(
        server, STRUCTURED_PROMPT, False, {"temperature": 0, "structured_outputs": json.dumps({"choice": CHOICES})}
    )
    assert text_of([result]).startswith(STRUCTURED_PROMPT)
    blocks_back_to_zero(server)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"text_input": "Describe it.", "image": "aGVsbG8="}, "image is not accepted: the model takes text only"),
        (
            {"embedding_request": json.dumps({"input": "Hello"})},
            "embedding_request is not accepted: the model generates text",
        ),
    ],
)
def test_another_kind_of_models_inputs_are_refused_by_name(server, body, message):
    """Through the generate endpoint (where a key that is no input becomes a request parameter) the model names
    what it does not serve; as tensors Triton refuses them (the model declares neither)."""
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 400 and message in info.value.read().decode()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("image", [1], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([b"Describe it."], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([b"aGVsbG8="], dtype=np.object_))
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put(error or result))
        client.async_stream_infer(MODEL, inputs)
        client.stop_stream()
        error = responses.get(timeout=60)
    assert "unexpected inference input 'image'" in str(error), str(error)
    blocks_back_to_zero(server)
