"""The inputs of one request to the `llm` model, with the tensor names and datatypes of its wire contract
(backend/protocol/wire.py): text_input, stream, sampling_parameters (JSON) and TensorRT-LLM style flat tensors."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from backend.protocol import wire

DEFAULT_TIMEOUT_S = 600.0

# Flat input tensors (TensorRT-LLM ensemble style): name -> (Triton datatype, numpy dtype), from the model's wire
# contract. Shape [1] except lists (stop strings, stop token ids), which are sent with shape [len].
_NUMPY = {
    wire.INT32: np.int32,
    wire.UINT64: np.uint64,
    wire.FP32: np.float32,
    wire.BOOL: np.bool_,
    wire.BYTES: np.object_,
}
_BOOL, _FP32, _BYTES = ((t, _NUMPY[t]) for t in (wire.BOOL, wire.FP32, wire.BYTES))
FLAT_INPUTS: dict[str, tuple[str, Any]] = {
    name: (datatype, _NUMPY[datatype])
    for name, (datatype, _) in wire.INPUTS.items()
    if name not in wire.PROMPT_INPUTS and name not in (wire.SAMPLING_JSON, "stream")
}

# The model sends its additional outputs only when asked (as Triton's vLLM backend does): this client asks
# for these unless the caller says otherwise (False, or None to send no flag at all).
DEFAULT_OUTPUTS: dict[str, Any] = {
    "return_finish_reason": True,
    "return_num_input_tokens": True,
    "return_num_output_tokens": True,
}


def _flat_spec(name: str, value: Any) -> tuple[str, Any]:
    """Datatype for a flat input: from FLAT_INPUTS, else guessed from the python value (the server judges)."""
    if name in FLAT_INPUTS:
        return FLAT_INPUTS[name]
    if isinstance(value, (bool, np.bool_)):
        return _BOOL
    if isinstance(value, int):
        return ("INT64", np.int64)
    if isinstance(value, float):
        return _FP32
    return _BYTES


def _tensor(value: Any, np_dtype: Any) -> np.ndarray:
    """Value as a 1-D array; strings (or lists of them) are utf-8 encoded for BYTES."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if np_dtype is np.object_:
        items = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in items]
    return np.array(items, dtype=np_dtype)


def sampling_json(sampling: dict | str | None) -> str | None:
    if sampling is None:
        return None
    return sampling if isinstance(sampling, str) else json.dumps(sampling)


def build_inputs(
    prompt: str, stream: bool = True, sampling: dict | str | None = None, protocol: str = "grpc", **flat: Any
) -> list:
    """InferInputs for one request: text_input, stream, sampling_parameters (JSON) and flat tensors.

    `flat` keys become tensors with the contract's dtypes (max_tokens INT32, temperature FP32, seed UINT64,
    stop BYTES [-1], flags BOOL, ...); None values are skipped. `protocol` is "grpc" or "http".
    """
    if protocol == "grpc":
        import tritonclient.grpc as tc
    elif protocol == "http":
        import tritonclient.http as tc
    else:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    tensors: list[tuple[str, str, np.ndarray]] = [
        ("text_input", wire.INPUTS["text_input"][0], _tensor(prompt, np.object_)),
        ("stream", wire.INPUTS["stream"][0], _tensor(bool(stream), np.bool_)),
    ]
    text = sampling_json(sampling)
    if text is not None:
        tensors.append((wire.SAMPLING_JSON, wire.INPUTS[wire.SAMPLING_JSON][0], _tensor(text, np.object_)))
    for name, value in flat.items():
        if value is None:
            continue
        datatype, np_dtype = _flat_spec(name, value)
        tensors.append((name, datatype, _tensor(value, np_dtype)))
    inputs = []
    for name, datatype, array in tensors:
        inp = tc.InferInput(name, list(array.shape), datatype)
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    return inputs
