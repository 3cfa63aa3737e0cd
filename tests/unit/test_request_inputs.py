"""backend/serving/request_inputs.py: Triton inputs (numpy tensors + request parameters JSON) become a ParsedRequest;
merge order: request parameters < sampling_parameters < flat tensors."""

import json

import numpy as np
import pytest

from backend.protocol.values import InvalidRequest
from backend.protocol.wire import INPUT_NAMES, OPTIONAL_OUTPUTS
from backend.serving.request_inputs import parse_request


def text(value, shape=(1,)):
    """A Triton BYTES tensor as the python backend hands it over: an object array of bytes."""
    return np.array([value.encode() if isinstance(value, str) else value], dtype=object).reshape(shape)


def prompt_and(**tensors):
    """The prompt "x" plus the given tensors."""
    return {"text_input": text("x"), **tensors}


def test_minimal_prompt():
    parsed = parse_request({"text_input": text("Hello")})
    assert parsed.prompt == "Hello"
    assert parsed.stream is False and parsed.exclude_input_in_output is False
    assert parsed.params.max_tokens == 16


def test_prompt_shapes_and_str_objects():
    assert parse_request({"text_input": text("Hi", (1, 1))}).prompt == "Hi"
    assert parse_request({"text_input": np.array(["héllo 日本"], dtype=object)}).prompt == "héllo 日本"


def test_token_id_prompts():
    parsed = parse_request({"input_ids": np.array([5, 6, 7], dtype=np.int32)}, json.dumps({"prompt_logprobs": 2}))
    assert parsed.prompt == [5, 6, 7] and parsed.params.prompt_logprobs == 2
    assert parse_request({}, json.dumps({"input_ids": [1, 2], "max_tokens": 0, "prompt_logprobs": 0})).prompt == [1, 2]
    with pytest.raises(InvalidRequest, match="not both"):
        parse_request({"text_input": text("x"), "input_ids": np.array([1], dtype=np.int32)})
    with pytest.raises(InvalidRequest, match="input_ids must be a non-empty list of token ids"):
        parse_request({}, json.dumps({"input_ids": ["a"]}))


def test_flat_tensors_of_numeric_types():
    parsed = parse_request(
        {
            "text_input": text("x"),
            "max_tokens": np.array([[7]], dtype=np.int32),
            "temperature": np.array([0.5], dtype=np.float32),
            "top_k": np.array([3], dtype=np.int64),
            "ignore_eos": np.array([True]),
            "seed": np.array([42], dtype=np.uint64),
            "n": np.array([2], dtype=np.int32),
            "stream": np.array([True]),
        }
    )
    params = parsed.params
    assert params.max_tokens == 7 and params.temperature == 0.5 and params.top_k == 3
    assert params.ignore_eos is True and params.seed == 42 and params.n == 2
    assert parsed.stream is True


def test_list_tensors():
    parsed = parse_request(
        {
            "text_input": text("x"),
            "stop_words": np.array([b"END", b"STOP"], dtype=object),
            "stop_token_ids": np.array([5, 6], dtype=np.int32),
        }
    )
    assert parsed.params.stop == ["END", "STOP"]
    assert parsed.params.stop_token_ids == [5, 6]


def test_string_values_accepted_everywhere():
    parsed = parse_request(
        {"text_input": text("x"), "temperature": text("0.7"), "stream": text("true")},
        json.dumps({"max_tokens": "5", "exclude_input_in_output": "true", "ignore_eos": "true"}),
    )
    assert parsed.params.temperature == pytest.approx(0.7)
    assert parsed.params.max_tokens == 5 and parsed.params.ignore_eos is True
    assert parsed.stream is True and parsed.exclude_input_in_output is True


def test_precedence_tensor_over_sampling_parameters_over_request_parameters():
    parameters = json.dumps({"temperature": 0.1, "top_p": 0.5, "top_k": 2, "max_tokens": 3})
    sampling = text(json.dumps({"temperature": 0.2, "top_p": 0.6, "max_tokens": 4}))
    tensors = {"text_input": text("x"), "sampling_parameters": sampling, "max_tokens": np.array([9])}
    params = parse_request(tensors, parameters).params
    assert params.max_tokens == 9  # the tensor beats both
    assert params.temperature == 0.2 and params.top_p == 0.6  # sampling_parameters beats request parameters
    assert params.top_k == 2  # only in request parameters


def test_sampling_parameters_inside_request_parameters():
    parameters = json.dumps({"sampling_parameters": json.dumps({"temperature": 0.3}), "top_k": 4})
    params = parse_request({"text_input": text("x")}, parameters).params
    assert params.temperature == 0.3 and params.top_k == 4
    # and the tensor still wins over it
    params = parse_request(
        {"text_input": text("x"), "sampling_parameters": text(json.dumps({"temperature": 0.9}))}, parameters
    ).params
    assert params.temperature == 0.9


def test_prompt_from_request_parameters():
    assert parse_request({}, json.dumps({"text_input": "from params"})).prompt == "from params"
    assert parse_request({"text_input": text("tensor")}, json.dumps({"text_input": "params"})).prompt == "tensor"


def test_return_logprobs_only_chooses_whether_logprobs_are_sent():
    """As vLLM's backend: return_logprobs without `logprobs` sends JSON null; it never turns logprobs on."""
    parsed = parse_request({"text_input": text("x"), "return_logprobs": np.array([True])})
    assert parsed.params.logprobs is None and parsed.outputs == {"logprobs"}
    parsed = parse_request({"text_input": text("x"), "return_logprobs": np.array([True])}, json.dumps({"logprobs": 3}))
    assert parsed.params.logprobs == 3 and parsed.outputs == {"logprobs"}
    parsed = parse_request({"text_input": text("x"), "return_logprobs": np.array([False])}, json.dumps({"logprobs": 2}))
    assert parsed.params.logprobs == 2 and parsed.outputs == frozenset()


def test_additional_outputs_only_when_their_flag_is_true():
    assert parse_request({"text_input": text("x")}).outputs == frozenset()
    every = {f"return_{name}": np.array([True]) for name in OPTIONAL_OUTPUTS}
    assert parse_request({"text_input": text("x"), **every}).outputs == set(OPTIONAL_OUTPUTS)
    parsed = parse_request(
        {"text_input": text("x"), "return_cumulative_logprob": np.array([True])},
        json.dumps({"return_num_input_tokens": "true", "return_finish_reason": False}),
    )
    assert parsed.outputs == {"cumulative_logprob", "num_input_tokens"}
    assert "return_cumulative_logprob" in INPUT_NAMES


def test_return_flags_are_checked_and_not_passed_on():
    parsed = parse_request(
        {
            "text_input": text("x"),
            "return_finish_reason": np.array([True]),
            "return_num_input_tokens": np.array([False]),
            "return_num_output_tokens": np.array([True]),
        }
    )
    assert parsed.prompt == "x"
    with pytest.raises(InvalidRequest, match="return_finish_reason must be true or false"):
        parse_request({"text_input": text("x")}, json.dumps({"return_finish_reason": "sometimes"}))


@pytest.mark.parametrize(
    "tensors, parameters, fragment",
    [
        ({}, "", "text_input is required"),
        ({"text_input": text("")}, "", "text_input must be a non-empty string"),
        ({"text_input": text(b"\xff\xfeabc")}, "", "text_input must be valid UTF-8"),
        ({"text_input": text(b"ok \xe6\x97")}, "", "text_input must be valid UTF-8"),
        ({"text_input": np.array([b"a", b"b"], dtype=object)}, "", "text_input must hold exactly one value"),
        ({"text_input": text("x")}, "[1, 2]", "request parameters must be a JSON object"),
        ({"text_input": text("x")}, "{not json", "request parameters must be a JSON object"),
        (prompt_and(sampling_parameters=text("{bad")), "", "sampling_parameters must be a JSON object"),
        (prompt_and(sampling_parameters=text('"str"')), "", "sampling_parameters must be a JSON object"),
        (prompt_and(sampling_parameters=text(b"\xc3\x28")), "", "sampling_parameters must be valid UTF-8"),
        (prompt_and(), json.dumps({"sampling_parameters": {"a": 1}}), "sampling_parameters must be a string"),
        ({"text_input": text("x")}, json.dumps({"temprature": 0.1}), "temprature"),
        ({}, json.dumps({"text_input": 5}), "text_input must be a string"),
        (prompt_and(max_tokens=np.array([1, 2])), "", "max_tokens must hold exactly one value"),
        (prompt_and(max_tokens=np.array([0])), "", "max_tokens must be between"),
        (prompt_and(temperature=text("warm")), "", "temperature must be a number"),
        (prompt_and(stream=np.array([2], dtype=np.int32)), "", "stream must be true or false"),
        (prompt_and(stop_words=np.array([b"\xff"], dtype=object)), "", "stop_words must be valid UTF-8"),
        (prompt_and(n=np.array([9])), "", "n must be between 1 and 8"),
        (
            prompt_and(sampling_parameters=text('{"stop": "' + "x" * 70000 + '"}')),
            "",
            "sampling_parameters is 70012 bytes of JSON; at most 65536 are allowed",
        ),
        ({"text_input": text("x")}, json.dumps({"pad": "y" * 70000}), "request parameters is 70011 bytes of JSON"),
    ],
)
def test_bad_inputs_name_the_field(tensors, parameters, fragment):
    with pytest.raises(InvalidRequest) as info:
        parse_request(tensors, parameters)
    assert fragment in str(info.value)


def test_invalid_utf8_message_says_where():
    with pytest.raises(InvalidRequest, match="at byte 3"):
        parse_request({"text_input": text(b"abc\xff")})


def test_limits_passed_through():
    with pytest.raises(InvalidRequest, match="n must be between 1 and 2"):
        parse_request(prompt_and(n=np.array([3])), max_n=2)
    with pytest.raises(InvalidRequest, match="max_tokens must be between 1 and 50"):
        parse_request(prompt_and(max_tokens=np.array([51])), max_tokens_limit=50)


def test_input_names_cover_the_flat_tensors():
    for name in (
        "text_input",
        "sampling_parameters",
        "max_tokens",
        "temperature",
        "stop_words",
        "stream",
        "exclude_input_in_output",
        "return_logprobs",
        "n",
        "seed",
    ):
        assert name in INPUT_NAMES
    assert len(set(INPUT_NAMES)) == len(INPUT_NAMES)


def test_stop_words_tensor_beats_stop_in_sampling_parameters():
    parsed = parse_request(
        {
            "text_input": text("x"),
            "sampling_parameters": text(json.dumps({"stop": ["json"]})),
            "stop_words": np.array([b"tensor"], dtype=object),
        }
    )
    assert parsed.params.stop == ["tensor"]


@pytest.mark.parametrize(
    "parameters, fragment",
    [
        (
            {"text_input": "Describe it.", "image": ["aGVsbG8="]},
            "image is not accepted: the model takes text only: vllm_backend's `image` input",
        ),
        (
            {"embedding_request": json.dumps({"input": "Hello"})},
            "embedding_request is not accepted: the model generates text",
        ),
    ],
)
def test_vllm_backends_inputs_for_other_kinds_of_model_are_refused_by_name(parameters, fragment):
    """As request parameters (where the generate endpoint puts them); as tensors Triton refuses them itself."""
    with pytest.raises(InvalidRequest) as info:
        parse_request({}, json.dumps(parameters))
    assert fragment in str(info.value)


def test_vllm_backends_structured_outputs_request_shape():
    """vllm_backend's accuracy test: `structured_outputs` as JSON text inside `sampling_parameters`, the same dict
    also as request parameters, temperature and top_p as integers."""
    sampling = {"temperature": 0, "top_p": 1, "structured_outputs": json.dumps({"choice": ["Positive", "Negative"]})}
    parsed = parse_request(
        {"text_input": text("Classify"), "sampling_parameters": text(json.dumps(sampling))}, json.dumps(sampling)
    )
    guided = parsed.params.guided_decoding
    assert (guided.kind, guided.spec, parsed.params.temperature) == ("choice", '["Positive", "Negative"]', 0.0)
