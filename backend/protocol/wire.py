"""The Triton wire contract of the `llm` model: its input and output tensors (names, Triton datatypes, shapes), the
groups they fall in, and how an error says what kind it is.

model_repository/llm/config.pbtxt declares the same tensors (tests/unit/protocol/test_wire.py checks that they
agree); the model glue, the request parser, the client, the front door and the batch view all read them here.

Errors: Triton carries a decoupled model's error as a message only, so the message starts with its kind in
brackets, `[server_busy] server busy: 4 requests are already waiting ...`. `ErrorText` is the engine's error
string with its kind attached; `error_text` writes the wire form and `parse_error` reads it back.
"""

from __future__ import annotations

import re

# Triton datatypes as tritonclient names them (config.pbtxt's TYPE_STRING is BYTES).
BYTES, BOOL, INT32, UINT32, UINT64, FP32 = "BYTES", "BOOL", "INT32", "UINT32", "UINT64", "FP32"
SCALAR, VECTOR = (1,), (-1,)

# ---------------------------------------------------------------------------------------------------- inputs
PROMPT_INPUTS = {"text_input": (BYTES, SCALAR), "input_ids": (INT32, VECTOR)}
SAMPLING_JSON = "sampling_parameters"  # vLLM-style JSON of every sampling parameter
# TensorRT-LLM-style flat tensors, one per sampling parameter
SAMPLING_INPUTS = {
    "max_tokens": (INT32, SCALAR),
    "min_tokens": (INT32, SCALAR),
    "temperature": (FP32, SCALAR),
    "top_p": (FP32, SCALAR),
    "top_k": (INT32, SCALAR),
    "min_p": (FP32, SCALAR),
    "repetition_penalty": (FP32, SCALAR),
    "presence_penalty": (FP32, SCALAR),
    "frequency_penalty": (FP32, SCALAR),
    "seed": (UINT64, SCALAR),
    "n": (INT32, SCALAR),
    "num_speculative_tokens": (INT32, SCALAR),
    "stop": (BYTES, VECTOR),
    "stop_words": (BYTES, VECTOR),
    "bad_words": (BYTES, VECTOR),
    "stop_token_ids": (INT32, VECTOR),
    "ignore_eos": (BOOL, SCALAR),
    "priority": (INT32, SCALAR),  # the scheduler's order, lower first (not a sampling knob; vLLM's `priority`)
}
# Additional outputs, each sent only when its return_* flag is true (as Triton's vLLM backend does).
OPTIONAL_OUTPUTS = (
    "finish_reason",
    "cumulative_logprob",
    "logprobs",
    "num_input_tokens",
    "num_output_tokens",
    "num_cached_tokens",
    "prompt_logprobs",
    "perf_metrics",
    "context_logits",
    "generation_logits",
)
FLAG_NAMES = ("stream", "exclude_input_in_output") + tuple(f"return_{name}" for name in OPTIONAL_OUTPUTS)
INPUTS = {
    **PROMPT_INPUTS,
    SAMPLING_JSON: (BYTES, SCALAR),
    **SAMPLING_INPUTS,
    **{flag: (BOOL, SCALAR) for flag in FLAG_NAMES},
}
INPUT_NAMES = tuple(INPUTS)
LIST_INPUTS = tuple(name for name, (_, shape) in INPUTS.items() if shape == VECTOR)

# --------------------------------------------------------------------------------------------------- outputs
OUTPUTS = {
    "text_output": (BYTES, VECTOR),
    "output_ids": (INT32, VECTOR),
    "finish_reason": (BYTES, VECTOR),
    "num_input_tokens": (UINT32, SCALAR),
    "num_output_tokens": (UINT32, VECTOR),
    "num_cached_tokens": (UINT32, SCALAR),  # prompt tokens whose KV the prefix cache served (ours)
    "sample_index": (INT32, VECTOR),
    "cumulative_logprob": (FP32, VECTOR),
    "logprobs": (BYTES, VECTOR),
    "prompt_logprobs": (BYTES, SCALAR),
    "perf_metrics": (BYTES, SCALAR),
    # [prompt tokens, vocabulary]; [tokens, vocabulary] per sample ([samples, tokens, vocabulary] for several)
    "context_logits": (FP32, (-1, -1)),
    "generation_logits": (FP32, (-1, -1)),
}
NO_FINISH_REASON = "None"  # finish_reason of a sample's responses before its last (vLLM's backend's spelling)
# A request parameter that makes a request a batch-view watch: the step records stream back in text_output.
WATCH_PARAMETER = "batch_view"
# A request parameter (JSON) that lists, loads or unloads the model's LoRA adapters instead of generating:
# {"action": "list"}, {"action": "load", "lora_name": ..., "lora_path": ...}, {"action": "unload", "lora_name": ...};
# the answer is JSON in text_output: {"status": HTTP-like code, "message": ..., "adapters": [...], "max_loras": ...}.
LORA_ADMIN_PARAMETER = "lora_adapters"
# Request parameters between our own models (backend/serving/forwarding_model.py): the id a forwarding model gives
# its request to `llm`, and a request that cancels the forwarded request of that id.
FORWARDED_ID, CANCEL_FORWARDED = "forwarded_id", "cancel_forwarded"

# ---------------------------------------------------------------------------------------------------- errors
INVALID_REQUEST = "invalid_request"  # the request was refused as sent; the message names the field
SERVER_BUSY = "server_busy"  # the queue is full (max_queue_size): retry later
UNAVAILABLE = "unavailable"  # the model is shutting down, or its engine stopped: another replica may serve
INTERNAL = "internal"  # the engine failed this request
ERROR_KINDS = (INVALID_REQUEST, SERVER_BUSY, UNAVAILABLE, INTERNAL)
_TAGGED = re.compile(rf"\[({'|'.join(ERROR_KINDS)})\] (.*)", re.DOTALL)


class ErrorText(str):
    """An error message (a str, compared and printed as one) that knows its kind."""

    kind: str

    def __new__(cls, message: str, kind: str) -> ErrorText:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown error kind {kind!r}; kinds: {ERROR_KINDS}")
        text = super().__new__(cls, message)
        text.kind = kind
        return text


def error_text(message: str, kind: str | None = None) -> str:
    """The wire form of an error: `[kind] message`; the kind is `message.kind` when not given, else internal."""
    kind = kind or getattr(message, "kind", INTERNAL)
    return f"[{kind}] {message}"


def parse_error(text: str) -> tuple[str | None, str]:
    """(kind, message) of an error read off the wire; kind None when the text carries none (Triton's own
    errors, which are about the request as sent)."""
    match = _TAGGED.fullmatch(text)
    return (match.group(1), match.group(2)) if match else (None, text)
