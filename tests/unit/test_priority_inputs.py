"""`priority` as a client gives it: in `sampling_parameters`, as the flat INT32 input `priority`, in the OpenAI
front door's bodies (vLLM's extra field); an integer of MIN_PRIORITY .. MAX_PRIORITY, anything else refused
with a message that names `priority` and what is allowed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend.protocol.sampling_params import MAX_PRIORITY, MIN_PRIORITY, SamplingParams
from backend.protocol.values import InvalidRequest
from backend.protocol.wire import INPUTS, INT32, SCALAR
from backend.serving.request_inputs import parse_request
from frontend.errors import APIError
from frontend.openai_protocol import parse_chat, parse_completion
from tests.unit.responses_requests import SERVED, render, responses

BAD = [True, 1.5, 2.0, "3", "high", [1], {"p": 1}, MIN_PRIORITY - 1, MAX_PRIORITY + 1]


def test_the_default_and_the_range():
    assert SamplingParams().priority == 0 and SamplingParams.from_dict({}).priority == 0
    for value in (MIN_PRIORITY, -1, 0, 7, MAX_PRIORITY):
        assert SamplingParams.from_dict({"priority": value}).priority == value
    assert (MIN_PRIORITY, MAX_PRIORITY) == (-1000, 1000)


@pytest.mark.parametrize("value", BAD)
def test_anything_but_an_integer_in_range_is_refused_naming_priority(value):
    with pytest.raises(InvalidRequest, match=r"^priority must be .*-1000 and 1000") as info:
        SamplingParams.from_dict({"priority": value})
    assert "lower is served first" in str(info.value)


def test_the_triton_inputs_sampling_parameters_and_the_flat_tensor():
    assert INPUTS["priority"] == (INT32, SCALAR)
    prompt = np.array([b"x"], dtype=object)
    sampling = np.array([json.dumps({"priority": -3}).encode()], dtype=object)
    assert parse_request({"text_input": prompt, "sampling_parameters": sampling}).params.priority == -3
    flat = {"text_input": prompt, "priority": np.array([[5]], dtype=np.int32), "sampling_parameters": sampling}
    assert parse_request(flat).params.priority == 5  # the tensor wins, as for every input
    assert parse_request({"text_input": prompt}, json.dumps({"priority": 2})).params.priority == 2
    with pytest.raises(InvalidRequest, match="priority must be an integer"):
        parse_request({"text_input": prompt}, json.dumps({"sampling_parameters": json.dumps({"priority": 0.5})}))


def chat(**body):
    return parse_chat({"model": "llm", "messages": [{"role": "user", "content": "Hi"}], **body}, SERVED, 256, render)


def completion(**body):
    return parse_completion({"model": "llm", "prompt": "Once", **body}, SERVED, 256, 49152)


@pytest.mark.parametrize("parse", [chat, completion, responses], ids=["chat", "completions", "responses"])
def test_the_front_door_passes_priority_through(parse):
    parsed = parse(priority=-2)
    generation = getattr(parsed, "generation", parsed)
    assert generation.sampling["priority"] == -2
    assert "priority" not in getattr(parse(), "generation", parse()).sampling  # the model's default: 0


@pytest.mark.parametrize("parse", [chat, completion, responses], ids=["chat", "completions", "responses"])
@pytest.mark.parametrize("value", BAD)
def test_the_front_door_refuses_a_bad_priority_with_a_400_naming_it(parse, value):
    with pytest.raises(APIError) as info:
        parse(priority=value)
    err = info.value
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "priority"), err.message
    assert err.message.startswith("priority must be")
