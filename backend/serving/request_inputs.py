"""Client inputs of one request, as the Triton model receives them, turned into engine terms.

Inputs arrive three ways (interface.md): vLLM-style JSON in `sampling_parameters`, TensorRT-LLM-style flat
tensors, and request parameters (the `generate` endpoint puts JSON keys that name no input there). A key
given more than once takes the tensor's value. This module sees plain numpy arrays and dicts, so it is
tested without Triton.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from backend.protocol.sampling_params import SamplingParams, resolve_aliases
from backend.protocol.values import InvalidRequest, as_bool
from backend.protocol.wire import (
    FLAG_NAMES,
    LIST_INPUTS,
    OPTIONAL_OUTPUTS,
    SAMPLING_JSON,
)

# The JSON of `sampling_parameters` and of the request parameters is refused past this size before parsing.
MAX_PARAMETERS_JSON_BYTES = 64 * 1024
# vllm_backend's inputs for models of other kinds, refused by name (as tensors Triton refuses them: the model
# declares neither; the generate endpoint turns them into request parameters, which land here).
NOT_SERVED = {
    "image": "the model takes text only: vllm_backend's `image` input (base64 images) is for multimodal models",
    "embedding_request": "the model generates text: vllm_backend's `embedding_request` input is for embedding "
    "(pooling) models",
}


@dataclass
class ParsedRequest:
    prompt: str | list[int]  # text_input, or the token ids of input_ids
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    outputs: frozenset[str] = frozenset()  # the OPTIONAL_OUTPUTS asked for
    lora_name: str | None = None  # the LoRA adapter asked for (vllm_backend's `lora_name`)
    lora_task_id: int = 0  # or by its task id (TensorRT-LLM's `lora_task_id`: the N-th adapter listed; 0: none)


def _text(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"{name} must be valid UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if isinstance(value, str):
        return value
    raise InvalidRequest(f"{name} must be a string, got {value!r}")


def _scalar(name: str, array: np.ndarray) -> Any:
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if isinstance(value, (bytes, str)):
        return _text(name, value)
    return value.item() if hasattr(value, "item") else value


def _list(name: str, array: np.ndarray) -> list:
    return [_text(name, v) if isinstance(v, (bytes, str)) else v.item() for v in array.reshape(-1)]


def _json_object(name: str, text: str) -> dict:
    if len(text) > MAX_PARAMETERS_JSON_BYTES or len(text.encode("utf-8")) > MAX_PARAMETERS_JSON_BYTES:
        raise InvalidRequest(
            f"{name} is {len(text.encode('utf-8'))} bytes of JSON; at most {MAX_PARAMETERS_JSON_BYTES} are allowed"
        )
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{name} must be a JSON object: {exc.msg} at position {exc.pos}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def _prompt(merged: dict[str, Any]) -> str | list[int]:
    """The prompt: text_input (a string) or input_ids (token ids, checked against the vocabulary later)."""
    if "text_input" not in merged and "input_ids" not in merged:
        raise InvalidRequest("text_input is required: the prompt as a string (or input_ids: its token ids)")
    if "text_input" in merged and "input_ids" in merged:
        raise InvalidRequest("give the prompt as text_input or as input_ids, not both")
    if "input_ids" in merged:
        ids = merged.pop("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest(f"input_ids must be a non-empty list of token ids, got {str(ids)[:80]}")
        return ids
    prompt = _text("text_input", merged.pop("text_input"))
    if not prompt:
        raise InvalidRequest("text_input must be a non-empty string")
    return prompt


def parse_request(
    tensors: dict[str, np.ndarray], parameters_json: str = "", max_n: int = 8, max_tokens_limit: int = 1 << 20
) -> ParsedRequest:
    """Merge request parameters < sampling_parameters < flat tensors, then validate."""
    merged: dict[str, Any] = {}
    request_parameters = _json_object("request parameters", parameters_json)
    embedded = request_parameters.pop("sampling_parameters", None)  # a generate body may carry it as a parameter
    merged.update(resolve_aliases(request_parameters))
    if embedded is not None:
        merged.update(resolve_aliases(_json_object("sampling_parameters", _text("sampling_parameters", embedded))))
    if SAMPLING_JSON in tensors:
        text = _scalar(SAMPLING_JSON, tensors[SAMPLING_JSON])
        merged.update(resolve_aliases(_json_object("sampling_parameters", text)))
    flat = {}
    for name, array in tensors.items():
        if name in LIST_INPUTS:
            flat[name] = _list(name, array)
        elif name != SAMPLING_JSON:
            flat[name] = _scalar(name, array)
    merged.update(resolve_aliases(flat))
    for name, why in NOT_SERVED.items():
        if name in merged:
            raise InvalidRequest(f"{name} is not accepted: {why}")
    prompt = _prompt(merged)
    flags = {name: as_bool(name, merged.pop(name)) for name in FLAG_NAMES if name in merged}
    lora_name = merged.pop("lora_name", None)
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise InvalidRequest(f"lora_name must be a non-empty string (a loaded adapter's name), got {lora_name!r}")
    lora_task_id = merged.pop("lora_task_id", 0)
    if isinstance(lora_task_id, bool) or not isinstance(lora_task_id, int) or lora_task_id < 0:
        raise InvalidRequest(f"lora_task_id must be a non-negative integer (0: no adapter), got {lora_task_id!r}")
    # return_logprobs only chooses whether `logprobs` is sent: without `logprobs` in the sampling
    # parameters it is sent as JSON null (vLLM's backend does the same).
    params = SamplingParams.from_dict(merged, max_n=max_n, max_tokens_limit=max_tokens_limit)
    outputs = frozenset(name for name in OPTIONAL_OUTPUTS if flags.get(f"return_{name}"))
    params.context_logits, params.generation_logits = "context_logits" in outputs, "generation_logits" in outputs
    return ParsedRequest(
        prompt,
        params,
        flags.get("stream", False),
        flags.get("exclude_input_in_output", False),
        outputs,
        lora_name,
        lora_task_id,
    )
