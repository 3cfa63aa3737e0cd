"""backend/protocol/triton_response.py: one response of the model read back, from gRPC's numpy arrays or the HTTP
generate endpoint's JSON values, per sample; logprobs read back from Triton's vLLM backend's shape."""

from __future__ import annotations

import json

import numpy as np

from backend.protocol.triton_response import (
    SampleRow,
    decode_response,
    flat_values,
    prompt_token_logprobs,
    token_logprobs,
)
from backend.protocol.wire import NO_FINISH_REASON


def texts(*values: str) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=object)


def test_flat_values_of_tensors_lists_and_scalars():
    assert flat_values(None) == []
    assert flat_values(np.array([[1, 2], [3, -1]], dtype=np.int32)) == [1, 2, 3, -1]
    assert flat_values(np.float32(-1.5)) == [-1.5]
    assert flat_values(np.array([b"h\xc3\xa9", b"\xff"], dtype=object)) == ["hé", "\ufffd"]
    assert flat_values("abc") == ["abc"] and flat_values(7) == [7] and flat_values([b"x", 2]) == ["x", 2]


def test_a_response_of_several_samples_reads_one_row_each():
    """Not streaming, n > 1: one response carries every sample, output_ids padded with -1."""
    vllm = {"3": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}}
    response = decode_response(
        {
            "text_output": texts("x", "yz"),
            "output_ids": np.array([[3, -1], [4, 5]], dtype=np.int32),
            "sample_index": np.array([0, 1], dtype=np.int32),
            "finish_reason": texts("stop", NO_FINISH_REASON),
            "num_input_tokens": np.array([6], dtype=np.uint32),
            "num_cached_tokens": np.array([4], dtype=np.uint32),
            "num_output_tokens": np.array([1, 2], dtype=np.uint32),
            "cumulative_logprob": np.array([-0.5, -0.75], dtype=np.float32),
            "logprobs": texts(json.dumps([vllm]), "null"),
            "prompt_logprobs": texts("null"),
        }
    )
    assert response.samples == [
        SampleRow(0, "x", [3], "stop", 1, -0.5, [vllm]),
        SampleRow(1, "yz", [4, 5], None, 2, -0.75, None),
    ]
    assert response.num_input_tokens == 6 and response.num_cached_tokens == 4 and response.prompt_logprobs is None
    assert response.raw["output_ids"] == [3, -1, 4, 5] and response.raw["finish_reason"] == ["stop", "None"]


def test_json_values_and_outputs_not_sent():
    """The HTTP generate endpoint's JSON (scalars for one value); what was not asked for reads None."""
    (sample,) = decode_response({"text_output": "abc", "output_ids": 7, "model_name": "llm"}).samples
    assert sample == SampleRow(0, "abc", [7], None, None, None, None)
    response = decode_response({"text_output": "a", "finish_reason": [""], "sample_index": 2, "num_input_tokens": 3})
    assert (response.samples[0].index, response.samples[0].finish_reason, response.num_input_tokens) == (2, None, 3)
    empty = decode_response({})  # the empty final response
    assert (empty.samples, empty.num_input_tokens, empty.prompt_logprobs, empty.raw) == ([], None, None, {})
    assert response.num_cached_tokens is None and empty.num_cached_tokens is None  # not asked for


def test_logprobs_read_back_by_rank():
    by_id = {
        "9": {"logprob": -3.0, "rank": 5, "decoded_token": "a"},
        "6": {"logprob": -0.9, "rank": 2, "decoded_token": "b"},
        "4": {"logprob": -0.5, "rank": 1, "decoded_token": "c"},
    }
    assert token_logprobs(9, by_id, 2) == {"token_id": 9, "logprob": -3.0, "top_logprobs": {4: -0.5, 6: -0.9}}
    assert token_logprobs(9, by_id, 0) == {"token_id": 9, "logprob": -3.0}
    assert prompt_token_logprobs(None, 1) is None
    assert prompt_token_logprobs([None, by_id], 1) == [
        None,
        {"token_id": 9, "logprob": -3.0, "top_logprobs": {4: -0.5}},
    ]
