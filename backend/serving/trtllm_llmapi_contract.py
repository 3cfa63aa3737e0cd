"""TensorRT-LLM's LLM-API Triton model contract (its `triton_backend/all_models/llmapi/tensorrt_llm`: text in, text
out, no batch dimension) in our terms: one request is one prompt, forwarded to `llm` with the sampling parameters
its `sampling_param_*` inputs set, and each `llm` response becomes its outputs (trtllm_llmapi_outputs.py).

Its meanings, as its model.py and helpers.py give them: every sampling input optional, max_tokens 32 when absent,
greedy when none of temperature, top_k and top_p is set (or temperature 0, top_k 1, top_p 0), `best_of` samples of
which the answer is the most likely, the prompt before the answer unless `sampling_param_exclude_input_from_output`,
`stop` a stop request for the request of the same id, and a LoRA adapter named by `lora_id`, `lora_name` and
`lora_path` together. Request parameters (where Triton's `generate` endpoint puts JSON keys that are not inputs)
with the sampling names, prefix or not, count where the input is absent. Pure numpy; docs/interface.md lists what
each input does.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from backend.protocol.values import InvalidRequest, as_bool, as_float, as_int, in_range
from backend.serving import trtllm_contract as shared
from backend.serving.trtllm_contract import BOOL, BYTES, FP32, INT32, UINT64
from backend.serving.trtllm_llmapi_outputs import PERF_OUTPUTS, LlmApiItem, block_size_of, response_outputs

__all__ = ["LlmApiItem", "block_size_of", "response_outputs"]  # the contract's response side, with its inputs

PREFIX = "sampling_param_"
# sampling_param_<name> -> (datatype, the sampling parameter of `llm` it sets, or None where handled below)
SAMPLING = {
    "best_of": (INT32, "n"),
    "temperature": (FP32, "temperature"),
    "top_k": (INT32, "top_k"),
    "top_p": (FP32, "top_p"),
    "frequency_penalty": (FP32, "frequency_penalty"),
    "presence_penalty": (FP32, "presence_penalty"),
    "max_tokens": (INT32, "max_tokens"),
    "stop": (BYTES, "stop"),
    "seed": (UINT64, "seed"),
    "exclude_input_from_output": (BOOL, None),
    "return_perf_metrics": (BOOL, None),
}
OUTPUT_CONFIG = ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob")
LORA = ("lora_id", "lora_name", "lora_path")
LORA_CKPT_SOURCES = ("hf", "nemo")
INPUTS = {
    "text_input": (BYTES, [-1]),
    "image_url": (BYTES, [-1]),
    "streaming": (BOOL, [1]),
    **{PREFIX + name: (dtype, [-1] if name == "stop" else [1]) for name, (dtype, _) in SAMPLING.items()},
    **{name: (BOOL, [1]) for name in OUTPUT_CONFIG},
    "stop": (BOOL, [1]),
    "lora_id": (UINT64, [1]),
    "lora_name": (BYTES, [1]),
    "lora_path": (BYTES, [1]),
    "lora_ckpt_source": (BYTES, [1]),
}
OUTPUTS = {
    "text_output": (BYTES, [-1]),
    "finish_reason": (BYTES, [-1]),
    "stop_reason": (BYTES, [-1]),
    "cumulative_logprob": (FP32, [-1]),
    **PERF_OUTPUTS,
}
DEFAULT_MAX_TOKENS = 32  # TensorRT-LLM's SamplingParams.max_tokens
MAX_BEST_OF = 8  # `llm`'s most samples per request (its max_n)
# The answer to a stop request, as TensorRT-LLM's model gives it (an error, CANCELLED)
STOP_ANSWER = "Request cancelled by client"
_PARSE = {INT32: as_int, UINT64: as_int, FP32: as_float, BOOL: as_bool}
_NUMPY = {INT32: np.int32, UINT64: np.uint64, FP32: np.float32, BOOL: bool, BYTES: object}


def is_stop(tensors: dict[str, np.ndarray]) -> bool:
    """A stop request: `stop` true ends the generations of the request with the same request id."""
    return "stop" in tensors and bool(np.any(tensors["stop"]))


def batch_size(tensors: dict[str, np.ndarray]) -> int:
    """Always 1 (TensorRT-LLM's LLM-API model takes one prompt per request, `max_batch_size: 0`), once
    text_input holds exactly one prompt."""
    if "text_input" not in tensors:
        raise InvalidRequest(
            "text_input is required: the prompt, shape [1] (a prompt of token ids goes to the tensorrt_llm_core "
            "model's input_ids)"
        )
    if tensors["text_input"].size != 1:
        raise InvalidRequest(
            f"text_input must hold one prompt (shape [1]), got shape {list(tensors['text_input'].shape)}: this model "
            "takes one prompt per request"
        )
    return 1


def with_parameters(tensors: dict[str, np.ndarray], parameters_json: str) -> dict[str, np.ndarray]:
    """The request's inputs, with its request parameters (Triton's `generate` endpoint: JSON keys that are not
    inputs, such as `max_tokens`) added as the inputs they name where those are absent; an unknown or
    ill-typed parameter is an error naming what is allowed."""
    try:
        parameters = json.loads(parameters_json) if parameters_json else {}
    except ValueError:
        parameters = {}
    out = dict(tensors)
    for key, value in (parameters if isinstance(parameters, dict) else {}).items():
        name = PREFIX + key if key in SAMPLING else key  # `stop`: the stop strings, as TensorRT-LLM's parameter
        if name not in INPUTS or name == "text_input":
            raise InvalidRequest(
                f"unknown request parameter {key!r}: the parameters are the sampling inputs, with or without their "
                f"{PREFIX} prefix ({', '.join(SAMPLING)}), and this model's other inputs ({', '.join(_others())})"
                + (
                    "; a prompt of token ids goes to the tensorrt_llm_core model's input_ids"
                    if key in ("input_ids", "input_lengths", "request_output_len")
                    else ""
                )
            )
        if name in tensors:
            continue  # the input wins
        dtype = INPUTS[name][0]
        if dtype == BYTES:
            values = value if isinstance(value, list) else [value]
            if not all(isinstance(v, str) for v in values):
                raise InvalidRequest(f"{key} must be a string or a list of strings, got {value!r}")
            out[name] = np.array([v.encode() for v in values], dtype=object)
        else:
            parsed = _PARSE[dtype](key, value)
            if dtype == UINT64:
                in_range(key, parsed, 0, 2**64 - 1)
            out[name] = np.array([parsed], dtype=_NUMPY[dtype])
    return out


def _others() -> list[str]:
    return [name for name in INPUTS if not name.startswith(PREFIX) and name != "text_input"]


def _value(tensors: dict[str, np.ndarray], name: str) -> Any:
    """The one value of scalar input `name`, or None where the request leaves it out."""
    return shared.scalar(name, tensors[name][np.newaxis], 0) if name in tensors else None


def item_request(tensors: dict[str, np.ndarray], b: int = 0) -> LlmApiItem:
    """The request as an `llm` request; raises InvalidRequest naming the input and what it allows."""
    if "image_url" in tensors and tensors["image_url"].size:
        raise InvalidRequest("image_url is not supported: the model takes text only")
    prompt = _value(tensors, "text_input")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("text_input must be a non-empty string")
    values = {name: _value(tensors, PREFIX + name) for name in SAMPLING if name != "stop"}
    values = {name: value for name, value in values.items() if value is not None}
    sampling = _sampling(values)
    stops = shared.words(PREFIX + "stop", tensors[PREFIX + "stop"][np.newaxis], 0) if PREFIX + "stop" in tensors else []
    if stops:
        sampling["stop"] = stops
    streaming = bool(_value(tensors, "streaming"))
    best_of = sampling.get("n", 1)
    if best_of > 1 and streaming:
        raise InvalidRequest(
            f"sampling_param_best_of {best_of} needs a non-streaming request: the best of the samples is known only "
            "once they are all done"
        )
    outputs = {name.removeprefix("return_") for name in OUTPUT_CONFIG if _value(tensors, name)}
    if values.get("return_perf_metrics"):
        outputs |= set(PERF_OUTPUTS)
    item = LlmApiItem(
        prompt,
        sampling,
        streaming,
        bool(values.get("exclude_input_from_output", False)),
        outputs,
        best_of=best_of,
        stops=stops,
        lora=_lora(tensors),
    )
    if item.names_stop:
        sampling["include_stop_str_in_output"] = True
    if item.lora is not None:
        sampling["lora_name"] = item.lora[0]
    return item


def _sampling(values: dict[str, Any]) -> dict[str, Any]:
    """`llm`'s sampling parameters for the sampling_param_* values, checked against what TensorRT-LLM allows."""
    for name, low, high in (("best_of", 1, MAX_BEST_OF), ("max_tokens", 1, 1 << 31), ("top_k", 0, 1 << 31)):
        if name in values:
            in_range(PREFIX + name, values[name], low, high)
    for name, low, high in (("temperature", 0.0, float("inf")), ("top_p", 0.0, 1.0)):
        if name in values:
            if not np.isfinite(values[name]):
                raise InvalidRequest(f"{PREFIX}{name} must be a finite number, got {values[name]}")
            in_range(PREFIX + name, values[name], low, high)
    sampling = {key: values[name] for name, (_, key) in SAMPLING.items() if key and name in values}
    sampling.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    temperature, top_k, top_p = (values.get(name) for name in ("temperature", "top_k", "top_p"))
    if (temperature, top_k, top_p) == (None, None, None) or temperature == 0 or top_k == 1 or top_p == 0:
        sampling["temperature"] = 0.0  # greedy, as TensorRT-LLM decodes then
        sampling.pop("top_p", None)
        sampling.pop("top_k", None)
    return sampling


def _lora(tensors: dict[str, np.ndarray]) -> tuple[str, str] | None:
    """The adapter lora_id, lora_name and lora_path name together (TensorRT-LLM's rule), else None."""
    lora_id, name, path = (_value(tensors, key) for key in LORA)
    if (lora_id, name, path) == (None, None, None):
        if "lora_ckpt_source" in tensors:
            raise InvalidRequest("lora_ckpt_source needs lora_id, lora_name and lora_path")
        return None
    if None in (lora_id, name, path):
        missing = [key for key, value in zip(LORA, (lora_id, name, path)) if value is None]
        raise InvalidRequest(f"lora_id, lora_name, and lora_path must all be provided together (missing: {missing})")
    source = _value(tensors, "lora_ckpt_source") or "hf"
    if source not in LORA_CKPT_SOURCES:
        raise InvalidRequest(f"lora_ckpt_source must be one of {LORA_CKPT_SOURCES}, got {source!r}")
    if source == "nemo":
        raise InvalidRequest("lora_ckpt_source 'nemo' is not supported: only Hugging Face (PEFT) adapters ('hf')")
    if not name:
        raise InvalidRequest("lora_name must be a non-empty string")
    if not os.path.exists(path):
        raise InvalidRequest(f"lora_path does not exist on the Triton server's filesystem: {path}")
    return name, path
