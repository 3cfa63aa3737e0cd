"""backend/serving/trtllm_contract.py: TensorRT-LLM's tensors (a batch dimension first) into `llm` requests, and
`llm`'s responses into TensorRT-LLM's outputs; the model configs declare the same tensors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from backend.protocol.values import InvalidRequest
from backend.serving import trtllm_contract as contract

REPO = Path(__file__).resolve().parents[2]
NUMPY = {"BYTES": object, "BOOL": bool, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}


def tensors(**values) -> dict[str, np.ndarray]:
    """Inputs as TensorRT-LLM's clients send them: [1, 1] per scalar, [1, N] per list."""
    out = {}
    for name, value in values.items():
        dtype = NUMPY[contract.INPUTS[name][0]]
        rows = value if isinstance(value, list) else [value]
        out[name] = np.array([[v.encode() if isinstance(v, str) else v for v in rows]], dtype=dtype)
    return out


def test_the_readme_request_is_a_plain_request():
    """Its README's first request: empty bad_words and stop_words mean none."""
    request = tensors(text_input="What is machine learning?", max_tokens=20, bad_words="", stop_words="")
    assert contract.batch_size(request) == 1
    item = contract.item_request(request, 0)
    assert item.prompt == "What is machine learning?"
    # greedy, as TensorRT-LLM decodes with neither top_k nor top_p
    assert item.sampling == {"max_tokens": 20, "temperature": 0.0, "bad_words": [], "stop_words": []}
    assert not item.stream and not item.outputs


def test_every_sampling_input_maps_to_its_parameter():
    request = tensors(
        text_input="hi",
        max_tokens=5,
        num_return_sequences=2,
        top_k=3,
        top_p=0.5,
        temperature=0.7,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        min_tokens=1,
        seed=7,
        num_draft_tokens=2,
        end_id=2,
        pad_id=2,
        beam_width=1,
        length_penalty=1.0,
        bad_words=["a b", "c"],
        stop_words=["x"],
        stream=True,
        exclude_input_in_output=True,
        return_log_probs=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
        use_draft_logits=False,
        embedding_bias_words=["good", "bad", "good"],
        embedding_bias_weights=[1.0, -2.0, 0.5],
        guided_decoding_guide_type="regex",
        guided_decoding_guide="[0-9]+",
    )
    item = contract.item_request(request, 0)
    assert item.sampling == {
        "max_tokens": 5,
        "n": 2,
        "top_k": 3,
        "top_p": 0.5,
        "temperature": pytest.approx(0.7),
        "repetition_penalty": pytest.approx(1.1),
        "presence_penalty": pytest.approx(0.2),
        "frequency_penalty": pytest.approx(0.3),
        "min_tokens": 1,
        "seed": 7,
        "num_speculative_tokens": 2,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "bad_words": ["a b", "c"],
        "stop_words": ["x"],
        "word_bias": {"good": 1.5, "bad": -2.0},
        "guided_regex": "[0-9]+",
        "logprobs": 0,
    }
    assert item.stream and item.exclude_input_in_output
    assert item.outputs == {"cum_log_probs", "output_log_probs", "num_input_tokens", "num_output_tokens"}
    assert item.llm_flags() == {
        "stream": True,
        "exclude_input_in_output": True,
        "return_logprobs": True,
        "return_cumulative_logprob": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "return_perf_metrics": False,
        "return_context_logits": False,
        "return_generation_logits": False,
    }


@pytest.mark.parametrize(
    "kind,guide,key",
    [("json", "", "guided_json_object"), ("json_schema", "{}", "guided_json"), ("ebnf_grammar", "g", "guided_grammar")],
)
def test_guide_types(kind, guide, key):
    item = contract.item_request(
        tensors(text_input="hi", max_tokens=1, guided_decoding_guide_type=kind, guided_decoding_guide=guide), 0
    )
    assert item.sampling[key] == (guide or True)


def test_a_batch_of_prompts_gives_one_item_each():
    request = {
        "text_input": np.array([[b"one"], [b"two"], [b"three"]], dtype=object),
        "max_tokens": np.array([[1], [2], [3]], dtype=np.int32),
        "bad_words": np.array([[b"x", b""], [b"", b""], [b"y", b"z"]], dtype=object),
    }
    assert contract.batch_size(request) == 3
    items = [contract.item_request(request, b) for b in range(3)]
    assert [i.prompt for i in items] == ["one", "two", "three"]
    assert [i.sampling["max_tokens"] for i in items] == [1, 2, 3]
    assert [i.sampling["bad_words"] for i in items] == [["x"], [], ["y", "z"]]


@pytest.mark.parametrize(
    "values,message",
    [
        ({"max_tokens": 4}, "text_input is required"),
        ({"text_input": "hi"}, "max_tokens is required"),
        ({"text_input": "hi", "max_tokens": 4, "beam_width": 2}, "beam search is not supported"),
        ({"text_input": "hi", "max_tokens": 4, "lora_config": [0, 1, 8]}, "list the adapter in multi_lora.json"),
        ({"text_input": "hi", "max_tokens": 4, "decoder_text_input": "x"}, "decoder-only"),
        ({"text_input": "hi", "max_tokens": 4, "end_id": -1}, "end_id must be a token id"),
        ({"text_input": "hi", "max_tokens": 4, "pad_id": -1}, "pad_id must be a token id"),
        ({"text_input": "hi", "max_tokens": 4, "embedding_bias_words": ["a"]}, "send both or neither"),
        ({"text_input": "hi", "max_tokens": 4, "guided_decoding_guide_type": "xml"}, "must be one of"),
        ({"text_input": "hi", "max_tokens": 4, "guided_decoding_guide_type": "regex"}, "needs the guide"),
        ({"text_input": "", "max_tokens": 4}, "non-empty string"),
    ],
)
def test_bad_requests_say_what_is_wrong(values, message):
    request = tensors(**values)
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        contract.item_request(request, 0) if contract.batch_size(request) else None


def test_lora_task_id_picks_an_adapter_of_the_models_listing():
    item = contract.item_request(tensors(text_input="hi", max_tokens=4, lora_task_id=2), 0)
    assert item.sampling["lora_task_id"] == 2
    assert (
        "lora_task_id" not in contract.item_request(tensors(text_input="hi", max_tokens=4, lora_task_id=0), 0).sampling
    )


def test_inputs_without_a_batch_dimension_are_refused():
    request = {"text_input": np.array([b"hi"], dtype=object), "max_tokens": np.array(4, dtype=np.int32)}
    with pytest.raises(InvalidRequest, match="same batch dimension"):
        contract.batch_size(request)


def test_embedding_bias_lengths_must_match():
    request = tensors(text_input="hi", max_tokens=1, embedding_bias_words=["a", "b"], embedding_bias_weights=[1.0])
    with pytest.raises(InvalidRequest, match="same length"):
        contract.item_request(request, 0)


def two_samples(**flags) -> contract.ItemRequest:
    """A request for two answers to one prompt with the given return_* flags."""
    return contract.item_request(tensors(text_input="hi", max_tokens=2, num_return_sequences=2, **flags), 0)


def test_responses_carry_the_indexes_and_log_probs():
    item = two_samples(return_log_probs=True, return_num_output_tokens=True, return_num_input_tokens=True)
    logprobs = [
        json.dumps([{"5": {"logprob": -0.5, "rank": 1}}, {"6": {"logprob": -1.0, "rank": 2}}]).encode(),
        json.dumps([{"7": {"logprob": -0.25, "rank": 1}}]).encode(),
    ]
    llm = {
        "text_output": np.array([b"a b", b"c"], dtype=object),
        "sample_index": np.array([0, 1], np.int32),
        "logprobs": np.array(logprobs, dtype=object),
        "cumulative_logprob": np.array([-1.5, -0.25], np.float32),
        "num_input_tokens": np.array([3], np.uint32),
        "num_output_tokens": np.array([2, 1], np.uint32),
    }
    first, second = contract.response_outputs(llm, item, batch_index=4)
    assert first["text_output"].tolist() == [b"a b"] and first["text_output"].shape == (1,)
    assert first["batch_index"].tolist() == [[4]] and first["sequence_index"].tolist() == [[0]]
    assert second["sequence_index"].tolist() == [[1]]
    assert first["output_log_probs"].tolist() == [[[-0.5, -1.0]]] and second["output_log_probs"].tolist() == [[[-0.25]]]
    assert first["cum_log_probs"].tolist() == [[-1.5]]
    assert first["num_input_tokens"].tolist() == [[3]] and first["num_input_tokens"].dtype == np.int32
    assert second["num_output_tokens"].tolist() == [[1]]


def test_perf_metrics_become_tensorrt_llms_ten_outputs():
    item = contract.item_request(tensors(text_input="hi", max_tokens=2, return_perf_metrics=True), 0)
    assert item.llm_flags()["return_perf_metrics"]
    perf = {name: 7 for name in contract.PERF_OUTPUTS} | {"acceptance_rate": 0.5, "arrival_time_ns": 2**62}
    llm = {"text_output": np.array([b"x"], dtype=object), "perf_metrics": np.array([json.dumps(perf).encode()], object)}
    (only,) = contract.response_outputs(llm, item, batch_index=None)
    assert set(only) == {"text_output", *contract.PERF_OUTPUTS}
    for name, dtype in contract.PERF_OUTPUTS.items():
        assert only[name].shape == (1, 1) and only[name].dtype == NUMPY.get(dtype, np.int64)
    assert only["arrival_time_ns"].tolist() == [[2**62]] and only["acceptance_rate"].tolist() == [[0.5]]


def test_logits_come_with_tensorrt_llms_batch_and_beam_dimensions():
    item = two_samples(return_context_logits=True, return_generation_logits=True)
    assert item.llm_flags()["return_context_logits"] and item.llm_flags()["return_generation_logits"]
    context = np.arange(12, dtype=np.float32).reshape(3, 4)  # a 3-token prompt, a 4-token vocabulary
    generation = np.full((2, 2, 4), np.nan, np.float32)  # sample 0 has one token, sample 1 two
    generation[0, 0], generation[1] = 1.0, 2.0
    llm = {
        "text_output": np.array([b"a", b"bc"], dtype=object),
        "sample_index": np.array([0, 1], np.int32),
        "context_logits": context,
        "generation_logits": generation,
    }
    first, second = contract.response_outputs(llm, item, batch_index=None)
    assert first["context_logits"].shape == (1, 3, 4) and first["context_logits"][0, 2].tolist() == [8, 9, 10, 11]
    assert first["generation_logits"].shape == (1, 1, 1, 4) and second["generation_logits"].shape == (1, 1, 2, 4)
    assert (second["generation_logits"] == 2.0).all()
    # a later stream response (no context_logits from llm) carries only its tokens' rows
    later = contract.response_outputs(
        {"text_output": np.array([b"d"], dtype=object), "generation_logits": np.ones((1, 4), np.float32)}, item, None
    )
    assert "context_logits" not in later[0] and later[0]["generation_logits"].shape == (1, 1, 1, 4)


def test_a_single_answer_has_no_indexes():
    item = contract.item_request(tensors(text_input="hi", max_tokens=2), 0)
    (only,) = contract.response_outputs({"text_output": np.array([b"x"], dtype=object)}, item, batch_index=None)
    assert set(only) == {"text_output"}


TYPES = {
    "TYPE_STRING": "BYTES",
    "TYPE_BOOL": "BOOL",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_UINT64": "UINT64",
    "TYPE_FP32": "FP32",
    "TYPE_FP16": "FP16",
    "TYPE_UINT8": "UINT8",
}


def declared_tensors(model: str) -> tuple[dict, dict, str]:
    """(inputs, outputs) a model_repository config.pbtxt declares, name -> (datatype, dims), and its text."""
    text = (REPO / "model_repository" / model / "config.pbtxt").read_text()
    pattern = r'\{ name: "(\w+)", data_type: (\w+), dims: \[ ([-\d, ]+) \]'
    inputs, _, outputs = text.partition("output [")
    tensors = [
        {n: (TYPES[t], [int(d) for d in dims.split(",")]) for n, t, dims in re.findall(pattern, part)}
        for part in (inputs, outputs)
    ]
    return tensors[0], tensors[1], text


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_the_model_configs_declare_the_contracts_tensors(model):
    inputs, outputs, text = declared_tensors(model)
    assert (inputs, outputs) == (contract.INPUTS, contract.OUTPUTS)
    assert "max_batch_size: 64" in text
