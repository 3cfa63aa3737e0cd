"""backend/serving/trtllm_core_contract.py: TensorRT-LLM's core model (`tensorrt_llm_core`: token ids in and out) in
our terms: its inputs as sampling parameters, its `[2, L]` word lists, its embedding bias vector, output_ids with the
prompt first where TensorRT-LLM puts it, and its stop requests (the real server:
tests/integration/test_trtllm_core_e2e.py)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from backend.protocol.values import InvalidRequest
from backend.serving import trtllm_core_contract as core
from tests.unit.test_trtllm_contract import NUMPY, declared_tensors

REPO = Path(__file__).resolve().parents[2]


def tensors(**values) -> dict[str, np.ndarray]:
    """Inputs as its client sends them: `[[value]]`, `[[ids...]]` for token ids, `[[[ids], [offsets]]]` for a
    word list."""
    out = {}
    for name, value in values.items():
        dtype = NUMPY.get(core.INPUTS[name][0], np.int64)
        out[name] = np.array([value if isinstance(value, list) else [value]], dtype=dtype)
    return out


def request(**extra) -> dict[str, np.ndarray]:
    return tensors(input_ids=[5, 6, 7], input_lengths=3, request_output_len=4, **extra)


def test_its_client_defaults_decode_greedily_and_keep_the_prompt_ids():
    """inflight_batcher_llm_client.py always sends beam_width 1, temperature, streaming, end_id, pad_id,
    runtime_top_k 1 and runtime_top_p 0."""
    item = core.item_request(
        request(beam_width=1, temperature=1.0, streaming=False, end_id=2, pad_id=2, runtime_top_k=1, runtime_top_p=0.0),
        0,
    )
    assert item.prompt == [5, 6, 7] and not item.stream
    assert item.sampling == {"max_tokens": 4, "top_k": 1, "temperature": 0.0, "stop_token_ids": [2], "ignore_eos": True}


def test_word_lists_are_token_sequences_and_empty_ones_are_none():
    words = np.array([[[5, 6, 7, 0], [2, 3, -1, -1]]], np.int32)  # "a b" -> [5, 6], "c" -> [7]
    item = core.item_request({**request(), "bad_words_list": words, "stop_words_list": words}, 0)
    assert item.sampling["bad_word_ids"] == [[5, 6], [7]] and item.sampling["stop_word_ids"] == [[5, 6], [7]]
    empty = core.item_request({**request(), "stop_words_list": np.array([[[0], [-1]]], np.int32)}, 0)
    assert "stop_word_ids" not in empty.sampling
    none = core.item_request({**request(), "bad_words_list": np.empty((1, 2, 0), np.int32)}, 0)
    assert "bad_word_ids" not in none.sampling
    with pytest.raises(InvalidRequest, match=r"end offset 9 does not follow 0 within the 3 ids"):
        core.item_request({**request(), "bad_words_list": np.array([[[1, 2, 3], [9, -1, -1]]], np.int32)}, 0)


def test_the_embedding_bias_vector_biases_its_nonzero_tokens():
    bias = np.zeros((1, 16), np.float32)
    bias[0, 3], bias[0, 9] = 2.5, -1.0
    item = core.item_request({**request(), "embedding_bias": bias}, 0)
    assert item.sampling["logit_bias"] == {3: 2.5, 9: -1.0}


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"input_lengths": 4}, "input_lengths must be from 1 to the 3 ids"),
        ({"beam_width": 2}, "beam search is not supported"),
        ({"draft_input_ids": [1, 2]}, "an external draft is not supported"),
        ({"runtime_top_p_decay": 0.9}, "top-p decay is not supported"),
        ({"encoder_output_lengths": 3}, "decoder-only"),
        ({"lookahead_window_size": 4}, "lookahead decoding is not supported"),
    ],
)
def test_bad_requests_say_what_is_wrong(extra, message):
    values = {"input_ids": [5, 6, 7], "input_lengths": 3, "request_output_len": 4, **extra}
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        core.item_request(tensors(**values), 0)


def test_required_inputs_are_named():
    with pytest.raises(InvalidRequest, match="request_output_len is required"):
        core.batch_size(tensors(input_ids=[1], input_lengths=1))


def test_a_decoder_only_model_takes_the_pad_decoder_input_its_preprocessing_sends():
    item = core.item_request(request(decoder_input_ids=[0], decoder_input_lengths=1), 0)
    assert item.prompt == [5, 6, 7]


def test_output_ids_carry_the_prompt_unless_streamed_or_excluded():
    llm = {"text_output": np.array([b"x", b"yz"], object), "output_ids": np.array([[8, -1], [9, 10]], np.int32)}
    llm["sample_index"] = np.array([0, 1], np.int32)
    item = core.item_request(request(num_return_sequences=2), 0)
    first, second = core.response_outputs(llm, item, batch_index=None)
    assert first["output_ids"].tolist() == [[[5, 6, 7, 8]]] and first["sequence_length"].tolist() == [[4]]
    assert second["output_ids"].tolist() == [[[5, 6, 7, 9, 10]]] and second["sequence_index"].tolist() == [[1]]
    for flags in ({"streaming": True}, {"exclude_input_in_output": True}):
        item = core.item_request(request(**flags), 0)
        (only,) = core.response_outputs({"text_output": llm["text_output"][:1], "output_ids": np.array([8])}, item, 0)
        assert only["output_ids"].tolist() == [[[8]]] and only["batch_index"].tolist() == [[0]]
        assert "text_output" not in only


def test_a_stop_request_is_recognised_before_its_other_inputs_are_read():
    assert core.is_stop({"stop": np.array([[True]]), "input_ids": np.empty((1, 1), np.int32)})
    assert not core.is_stop(request(stop=False)) and not core.is_stop(request())


def test_the_model_config_declares_the_contracts_tensors():
    inputs, outputs, text = declared_tensors("tensorrt_llm_core")
    assert (inputs, outputs) == (core.INPUTS, core.OUTPUTS)
    assert 'key: "contract", value: { string_value: "tokens" }' in text and "max_batch_size: 64" in text
