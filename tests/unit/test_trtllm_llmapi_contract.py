"""backend/serving/trtllm_llmapi_contract.py and trtllm_llmapi_outputs.py: TensorRT-LLM's LLM-API Triton model in our
terms: its sampling_param_* inputs and their defaults, request parameters, LoRA, the refusals, and its outputs made
from `llm`'s responses (the real server: tests/integration/test_trtllm_llmapi_e2e.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend.protocol.values import InvalidRequest
from backend.serving import trtllm_llmapi_contract as api
from tests.unit.test_trtllm_contract import NUMPY, declared_tensors

# TensorRT-LLM's llmapi/tensorrt_llm/config.pbtxt: name -> (datatype, dims); text_input is required there
THEIRS_INPUTS = {
    "text_input": ("BYTES", [-1]),
    "image_url": ("BYTES", [-1]),
    "streaming": ("BOOL", [1]),
    **{
        f"sampling_param_{name}": (dtype, [1])
        for name, dtype in (
            ("best_of", "INT32"),
            ("temperature", "FP32"),
            ("top_k", "INT32"),
            ("top_p", "FP32"),
            ("frequency_penalty", "FP32"),
            ("presence_penalty", "FP32"),
            ("max_tokens", "INT32"),
        )
    },
    "sampling_param_stop": ("BYTES", [-1]),
    "sampling_param_seed": ("UINT64", [1]),
    "sampling_param_exclude_input_from_output": ("BOOL", [1]),
    "sampling_param_return_perf_metrics": ("BOOL", [1]),
    "return_finish_reason": ("BOOL", [1]),
    "return_stop_reason": ("BOOL", [1]),
    "return_cumulative_logprob": ("BOOL", [1]),
    "stop": ("BOOL", [1]),
    "lora_id": ("UINT64", [1]),
    "lora_name": ("BYTES", [1]),
    "lora_path": ("BYTES", [1]),
    "lora_ckpt_source": ("BYTES", [1]),
}
THEIRS_OUTPUTS = {
    "text_output": ("BYTES", [-1]),
    "finish_reason": ("BYTES", [-1]),
    "stop_reason": ("BYTES", [-1]),
    "cumulative_logprob": ("FP32", [-1]),
    **{f"kv_cache_{n}": ("INT32", [-1]) for n in ("reused_block", "missed_block", "alloc_new_blocks")},
    "kv_cache_alloc_total_blocks": ("INT32", [-1]),
    "kv_cache_hit_rate": ("FP32", [-1]),
    **{f"{n}_time_ns": ("INT64", [1]) for n in ("arrival", "first_scheduled", "first_token", "last_token")},
    "acceptance_rate": ("FP32", [1]),
    "total_accepted_draft_tokens": ("INT32", [1]),
    "total_draft_tokens": ("INT32", [1]),
}


def tensors(**values) -> dict[str, np.ndarray]:
    """Inputs as its clients send them: shape [1] (a list for the list inputs), no batch dimension."""
    return {
        name: np.array(value if isinstance(value, list) else [value], dtype=NUMPY[api.INPUTS[name][0]])
        for name, value in values.items()
    }


def item(parameters: str = "", **values) -> api.LlmApiItem:
    given = tensors(**{"text_input": "Hello", **values})
    given = api.with_parameters(given, parameters)
    assert api.batch_size(given) == 1
    return api.item_request(given)


def llm(text: str | list[str], finish: str | list[str] = "None", **extra) -> dict[str, np.ndarray]:
    """One `llm` response: its text_output and finish_reason (one entry per sample), and `extra`."""
    texts, reasons = ([v] if isinstance(v, str) else v for v in (text, finish))
    out = {
        "text_output": np.array([t.encode() for t in texts], dtype=object),
        "finish_reason": np.array([r.encode() for r in reasons], dtype=object),
    }
    return {**out, **extra}


def test_the_model_config_declares_tensorrt_llms_tensors_without_a_batch_dimension():
    inputs, outputs, text = declared_tensors("tensorrt_llm")
    assert (inputs, outputs) == (api.INPUTS, api.OUTPUTS) == (THEIRS_INPUTS, THEIRS_OUTPUTS)
    assert "max_batch_size: 0" in text and 'string_value: "llmapi"' in text


def test_its_defaults_are_tensorrt_llms_32_greedy_tokens_after_the_prompt():
    it = item()
    assert it.sampling == {"max_tokens": 32, "temperature": 0.0}
    assert not it.stream and not it.exclude_input_in_output and it.outputs == set()
    assert it.llm_flags() == {
        "stream": False,
        "exclude_input_in_output": True,  # the prompt is put back here
        "return_finish_reason": True,
        "return_cumulative_logprob": False,
        "return_num_input_tokens": False,
        "return_perf_metrics": False,
    }
    (out,) = api.response_outputs(llm(" world", "length"), it)
    assert out == {"text_output": np.array([b"Hello world"], dtype=object)}


@pytest.mark.parametrize(
    "values, expected",
    [
        ({"sampling_param_temperature": 0.75}, {"temperature": 0.75}),  # temperature alone samples the vocabulary
        ({"sampling_param_top_k": 5}, {"top_k": 5}),
        ({"sampling_param_top_p": 0.875, "sampling_param_temperature": 0.5}, {"top_p": 0.875, "temperature": 0.5}),
        ({"sampling_param_top_k": 1, "sampling_param_temperature": 0.7}, {"temperature": 0.0}),
        ({"sampling_param_top_p": 0.0}, {"temperature": 0.0}),
        ({"sampling_param_temperature": 0.0, "sampling_param_top_k": 50}, {"temperature": 0.0}),
    ],
)
def test_greedy_when_tensorrt_llm_decodes_greedily(values, expected):
    assert item(**values).sampling == {"max_tokens": 32, **expected}


def test_every_sampling_input_reaches_llm():
    it = item(
        sampling_param_max_tokens=7,
        sampling_param_temperature=0.8,
        sampling_param_top_k=40,
        sampling_param_top_p=0.95,
        sampling_param_frequency_penalty=0.5,
        sampling_param_presence_penalty=0.25,
        sampling_param_seed=11,
        sampling_param_best_of=3,
        sampling_param_stop=["\n", "", "END"],
    )
    assert it.sampling == {
        "max_tokens": 7,
        "temperature": pytest.approx(0.8),
        "top_k": 40,
        "top_p": pytest.approx(0.95),
        "frequency_penalty": 0.5,
        "presence_penalty": 0.25,
        "seed": 11,
        "n": 3,
        "stop": ["\n", "END"],  # an empty string is no stop string
    }
    assert it.best_of == 3 and it.ONE_RESPONSE and it.llm_flags()["return_cumulative_logprob"]


def test_request_parameters_stand_for_absent_inputs_and_the_input_wins():
    it = item('{"max_tokens": 10, "temperature": 0.5, "stop": "x"}', sampling_param_max_tokens=4)
    assert it.sampling["max_tokens"] == 4 and it.sampling["temperature"] == 0.5 and it.stops == ["x"]
    assert item('{"sampling_param_top_k": 3, "return_finish_reason": true}').outputs == {"finish_reason"}


@pytest.mark.parametrize(
    "parameters, message",
    [
        ('{"max_token": 10}', "unknown request parameter 'max_token'"),
        ('{"input_ids": "1"}', "input_ids"),
        ('{"max_tokens": "ten"}', "max_tokens must be an integer"),
        ('{"temperature": true}', "temperature must be a number"),
        ('{"seed": -1}', "seed must be between 0"),
        ('{"stop": 3}', "stop must be a string or a list of strings"),
        ('{"streaming": "maybe"}', "streaming must be true or false"),
    ],
)
def test_bad_request_parameters_are_refused_naming_what_is_allowed(parameters, message):
    with pytest.raises(InvalidRequest, match=message) as refused:
        item(parameters)
    if "unknown" in message:
        assert "max_tokens" in str(refused.value) and "temperature" in str(refused.value)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"sampling_param_max_tokens": 0}, "sampling_param_max_tokens must be between 1"),
        ({"sampling_param_top_p": 1.5}, r"sampling_param_top_p must be between 0.0 and 1.0"),
        ({"sampling_param_temperature": -1.0}, "sampling_param_temperature must be between 0.0"),
        ({"sampling_param_temperature": float("nan")}, "sampling_param_temperature must be a finite number"),
        ({"sampling_param_top_k": -2}, "sampling_param_top_k must be between 0"),
        ({"sampling_param_best_of": 9}, "sampling_param_best_of must be between 1 and 8"),
        ({"sampling_param_best_of": 2, "streaming": True}, "best_of 2 needs a non-streaming request"),
        ({"text_input": ""}, "text_input must be a non-empty string"),
        ({"image_url": ["http://x/y.png"]}, "image_url is not supported: the model takes text only"),
        ({"lora_name": "a"}, r"lora_id, lora_name, and lora_path must all be provided together"),
        ({"lora_ckpt_source": "hf"}, "lora_ckpt_source needs lora_id, lora_name and lora_path"),
    ],
)
def test_bad_inputs_are_refused_naming_the_input(values, message):
    with pytest.raises(InvalidRequest, match=message):
        item(**values)


def test_one_prompt_is_required():
    with pytest.raises(InvalidRequest, match="text_input is required.*tensorrt_llm_core model's input_ids"):
        api.batch_size({})
    with pytest.raises(InvalidRequest, match=r"text_input must hold one prompt \(shape \[1\]\), got shape \[2\]"):
        api.batch_size(tensors(text_input=["a", "b"]))


def test_lora_names_an_adapter_on_the_servers_disk(tmp_path):
    lora = {"lora_id": 3, "lora_name": "alpha", "lora_path": str(tmp_path)}
    it = item(**lora)
    assert it.lora == ("alpha", str(tmp_path)) and it.sampling["lora_name"] == "alpha"
    with pytest.raises(InvalidRequest, match="lora_path does not exist on the Triton server's filesystem"):
        item(**{**lora, "lora_path": str(tmp_path / "missing")})
    with pytest.raises(InvalidRequest, match="'nemo' is not supported"):
        item(**lora, lora_ckpt_source="nemo")
    with pytest.raises(InvalidRequest, match=r"lora_ckpt_source must be one of \('hf', 'nemo'\)"):
        item(**lora, lora_ckpt_source="zip")


def test_a_stop_request_is_stop_true():
    assert api.is_stop(tensors(stop=True)) and not api.is_stop(tensors(stop=False)) and not api.is_stop({})
    assert api.STOP_ANSWER == "Request cancelled by client"


def test_output_config_sends_finish_reason_stop_reason_and_cumulative_logprob():
    it = item(return_finish_reason=True, return_stop_reason=True, return_cumulative_logprob=True)
    assert it.llm_flags()["return_cumulative_logprob"]
    (out,) = api.response_outputs(llm(" a", "length", cumulative_logprob=np.array([-1.5], np.float32)), it)
    assert out["finish_reason"].tolist() == [b"length"] and out["stop_reason"].tolist() == [b"None"]
    assert out["cumulative_logprob"].dtype == np.float32 and out["cumulative_logprob"].tolist() == [-1.5]
    (cancelled,) = api.response_outputs(llm(" a", "abort"), it)
    assert cancelled["finish_reason"].tolist() == [b"cancelled"]  # TensorRT-LLM's word for it


def test_stop_reason_names_the_stop_string_which_is_cut_from_the_text():
    it = item(return_stop_reason=True, sampling_param_stop=["!", "END"], sampling_param_exclude_input_from_output=True)
    assert it.sampling["include_stop_str_in_output"]  # `llm` keeps it, so that it can be named here
    (out,) = api.response_outputs(llm(" fooEND", "stop"), it)
    assert out["text_output"].tolist() == [b" foo"] and out["stop_reason"].tolist() == [b"END"]
    (eos,) = api.response_outputs(llm(" foo", "stop"), it)  # the end token: no stop string
    assert eos["text_output"].tolist() == [b" foo"] and eos["stop_reason"].tolist() == [b"None"]
    plain = item(sampling_param_stop=["END"])  # without return_stop_reason, `llm` cuts it itself
    assert "include_stop_str_in_output" not in plain.sampling


def test_a_stream_sends_the_answer_so_far_in_every_response():
    it = item(streaming=True, return_finish_reason=True, return_stop_reason=True, sampling_param_stop=["."])
    texts, reasons, stops = [], [], []
    for delta, finish in ((" one", "None"), (" two", "None"), (" three.", "stop")):
        (out,) = api.response_outputs(llm(delta, finish, sample_index=np.array([0], np.int32)), it)
        texts.append(out["text_output"][0].decode())
        reasons.append(out["finish_reason"][0].decode())
        stops.append(out["stop_reason"][0].decode())
    assert texts == ["Hello one", "Hello one two", "Hello one two three"]
    assert reasons == ["None", "None", "stop"] and stops == ["None", "None", "."]
    excluded = item(streaming=True, sampling_param_exclude_input_from_output=True)
    outs = [api.response_outputs(llm(d), excluded)[0]["text_output"][0] for d in (" a", " b")]
    assert outs == [b" a", b" a b"]


def test_best_of_answers_with_the_most_likely_sample():
    it = item(sampling_param_best_of=3, return_cumulative_logprob=True, return_finish_reason=True)
    response = llm(
        [" x", " y", " z"],
        ["length", "stop", "length"],
        cumulative_logprob=np.array([-3.0, -1.0, -2.0], np.float32),
        sample_index=np.arange(3, dtype=np.int32),
    )
    (out,) = api.response_outputs(response, it)
    assert out["text_output"].tolist() == [b"Hello y"] and out["cumulative_logprob"].tolist() == [-1.0]
    assert out["finish_reason"].tolist() == [b"stop"]


def test_perf_outputs_come_from_llms_perf_metrics_with_the_prompts_blocks():
    it = item(sampling_param_return_perf_metrics=True)
    it.block_size = 16
    assert it.llm_flags()["return_perf_metrics"] and it.llm_flags()["return_num_input_tokens"]
    perf = {
        "kv_cache_alloc_new_blocks": 2,
        "kv_cache_reused_blocks": 2,
        "kv_cache_alloc_total_blocks": 4,
        "arrival_time_ns": 10,
        "first_scheduled_time_ns": 11,
        "first_token_time_ns": 12,
        "last_token_time_ns": 13,
        "acceptance_rate": 0.5,
        "total_accepted_draft_tokens": 3,
        "total_draft_tokens": 6,
    }
    response = llm(" a", perf_metrics=np.array([json.dumps(perf)], dtype=object), num_input_tokens=np.array([40]))
    (out,) = api.response_outputs(response, it)
    # 40 prompt tokens are 3 blocks of 16: 2 found in the prefix cache, 1 missed
    expected = {**perf, "kv_cache_reused_block": 2, "kv_cache_missed_block": 1}
    expected["kv_cache_hit_rate"] = pytest.approx(2 / 3)
    for name, (dtype, _) in api.PERF_OUTPUTS.items():
        assert out[name].shape == (1,) and out[name].dtype == {"INT32": np.int32, "INT64": np.int64}.get(
            dtype, np.float32
        )
        assert out[name][0] == expected[name], name


def test_the_block_size_is_read_from_the_forwarded_models_config():
    text = 'parameters [\n  { key: "block_size", value: { string_value: "32" } },\n]'
    assert api.block_size_of(text, 16) == 32 and api.block_size_of("parameters []", 16) == 16
