"""The front door's client of the Triton model: one gRPC bi-directional stream per generation.

Every generation is sent with `stream: true`, so the model answers once per engine step with each sample's
new text, token ids and (when asked) logprobs; a non-streaming OpenAI request is the same deltas gathered.
The model sends its additional outputs as Triton's vLLM backend does (docs/interface.md): only those asked
for (finish reason, token counts, the prompt tokens the prefix cache served, logprobs), the finish reason as
"None" until the sample's last response, `num_output_tokens` counting the response's tokens, logprobs in
vLLM's per-token `{"<id>": {...}}` shape;
backend/protocol/triton_response.py reads a response back (the client reads it with the same decoder).
The Triton request is known to be complete when every one of its `n` samples has sent a finish reason (or an
error arrives). Leaving the iteration early (the HTTP client went away, the handler was cancelled) cancels
the gRPC call, which cancels the Triton request: the model's output sender sees it within 100 ms (it polls
Triton), and the engine drops it at its next step and frees its KV blocks.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from backend.protocol import wire
from backend.protocol.triton_response import decode_response, prompt_token_logprobs, token_logprobs
from backend.protocol.wire import INTERNAL, INVALID_REQUEST, UNAVAILABLE, parse_error

# The launcher's header for Triton's restricted APIs, as Triton expects it over gRPC
ADMIN_HEADER = "triton-grpc-protocol-llm-admin-key"
# tritonclient's own channel options, plus a short reconnect back-off: gRPC's default grows to 120 s while
# tritonserver is down, so after its supervisor restarted it the front door would stay "not ready" (and out of
# its proxy's rotation) for up to two minutes more (loadtest/failover.py measured it).
_KEEPALIVE = grpcclient.KeepAliveOptions()
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.keepalive_time_ms", _KEEPALIVE.keepalive_time_ms),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE.keepalive_timeout_ms),
    ("grpc.keepalive_permit_without_calls", _KEEPALIVE.keepalive_permit_without_calls),
    ("grpc.http2.max_pings_without_data", _KEEPALIVE.http2_max_pings_without_data),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass
class SampleDelta:
    """What one sample produced in one engine step."""

    index: int  # the sample's index among the request's n
    text: str
    token_ids: list[int]
    num_input_tokens: int
    num_output_tokens: int  # so far, this sample (summed here from the model's per-response counts)
    finish_reason: str | None  # "stop", "length" or "abort" on the sample's last delta
    logprobs: list[dict] | None  # per token: {"token_id", "logprob", "top_logprobs": {id: logprob}}
    # the prompt's tokens in the same shape, None first; only in the first delta, when prompt_logprobs was asked
    prompt_logprobs: list[dict | None] | None = None
    num_cached_tokens: int = 0  # of num_input_tokens, those whose KV the engine's prefix cache served


class EngineError(Exception):
    """The model refused or failed the request. `kind` is one of backend/protocol/wire.py's ERROR_KINDS, read off
    the model's error (`[server_busy] server busy: ...`) or given; an error without one is Triton's own about the
    request as sent (invalid_request)."""

    def __init__(self, text: str, kind: str | None = None):
        sent_kind, message = parse_error(text)
        super().__init__(message)
        self.message = message
        self.kind = kind or sent_kind or INVALID_REQUEST


class TritonLLM:
    """A gRPC client of the Triton server, shared by every request of the front door."""

    def __init__(self, url: str):
        self.url = url
        self.client = grpcclient.InferenceServerClient(url, channel_args=CHANNEL_ARGS)
        self._parameters: dict[str, dict[str, str]] = {}

    async def close(self) -> None:
        await self.client.close()

    async def is_model_ready(self, model: str) -> bool:
        try:
            return await self.client.is_model_ready(model)
        except InferenceServerException:
            return False

    async def model_parameters(self, model: str) -> dict[str, str]:
        """The model's config.pbtxt parameters (engine settings such as max_queue_size), as strings; read
        once per model. Raises InferenceServerException when Triton cannot say."""
        if model not in self._parameters:
            # the launch restricts the model-config API to its admin key, which it hands to the front door
            key = os.environ.get("LLM_ADMIN_KEY")
            config = await self.client.get_model_config(
                model, headers={ADMIN_HEADER: key} if key else None, as_json=True
            )
            parameters = config.get("config", config).get("parameters", {})
            self._parameters[model] = {key: value.get("string_value", "") for key, value in parameters.items()}
        return self._parameters[model]

    async def lora_admin(self, model: str, action: dict) -> dict:
        """The model's answer to a LoRA admin action (wire.LORA_ADMIN_PARAMETER): {"status", "message",
        "adapters", ...}. Raises EngineError where the model cannot be asked."""
        text = _tensor("text_input", np.array([b""], dtype=object))
        request = {"model_name": model, "inputs": [text], "parameters": {wire.LORA_ADMIN_PARAMETER: json.dumps(action)}}

        async def requests():
            yield request

        call = self.client.stream_infer(requests())
        try:
            async for result, error in call:
                if error is not None:
                    raise EngineError(error.message())
                return json.loads(result.as_numpy("text_output")[0])
        except grpc.aio.AioRpcError as exc:
            failed = f"the Triton server at {self.url} failed the request: {exc.details()}"
            raise EngineError(failed, UNAVAILABLE) from None
        finally:
            call.cancel()
        raise EngineError(f"model {model} sent no answer to a LoRA request", INTERNAL)

    async def generate(self, model: str, prompt: str | list[int], sampling: dict, n: int) -> AsyncIterator[SampleDelta]:
        """Stream the deltas of one generation of `prompt` (text, or token ids) with `sampling` (the model's
        sampling_parameters)."""
        request = {"model_name": model, "inputs": _inputs(prompt, sampling)}
        top = sampling.get("logprobs")
        prompt_top = sampling.get("prompt_logprobs")
        totals: dict[int, int] = {}  # output tokens so far, per sample

        async def requests():
            yield request

        call = self.client.stream_infer(requests())
        unfinished = set(range(n))
        try:
            async for result, error in call:
                if error is not None:
                    raise EngineError(error.message())
                for delta in _deltas(result, top, prompt_top, totals):
                    if delta.finish_reason is not None:
                        unfinished.discard(delta.index)
                    yield delta
                if not unfinished:
                    return
            raise EngineError("internal error: the model's stream ended before every sample finished", INTERNAL)
        except grpc.aio.AioRpcError as exc:
            kind = UNAVAILABLE if exc.code() == grpc.StatusCode.UNAVAILABLE else INTERNAL
            raise EngineError(f"the Triton server at {self.url} failed the request: {exc.details()}", kind) from None
        finally:
            if unfinished:  # left early: cancel the Triton request so its KV blocks are freed
                call.cancel()


def _inputs(prompt: str | list[int], sampling: dict) -> list:
    wanted = {"logprobs": "return_logprobs", "prompt_logprobs": "return_prompt_logprobs"}
    flags = (
        "stream",
        "exclude_input_in_output",
        "return_finish_reason",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "return_num_cached_tokens",
    ) + tuple(flag for key, flag in wanted.items() if sampling.get(key) is not None)
    if isinstance(prompt, str):
        tensors = [_tensor("text_input", np.array([prompt.encode()], dtype=object))]
    else:
        tensors = [_tensor("input_ids", np.array(prompt, dtype=np.int32))]
    tensors.append(_tensor(wire.SAMPLING_JSON, np.array([json.dumps(sampling).encode()], dtype=object)))
    return tensors + [_tensor(flag, np.array([True])) for flag in flags]


def _tensor(name: str, value: np.ndarray):
    """An input of the model's wire contract (its datatype from there), holding `value`."""
    tensor = grpcclient.InferInput(name, list(value.shape), wire.INPUTS[name][0])
    tensor.set_data_from_numpy(value)
    return tensor


def _deltas(result, top: int | None, prompt_top: int | None, totals: dict[int, int]) -> list[SampleDelta]:
    """The samples of one model response (streaming: one sample per response; see model.py). `top`,
    `prompt_top`: the logprobs alternatives asked for; `totals`: each sample's output tokens so far, updated."""
    outputs = {name: value for name in wire.OUTPUTS if (value := result.as_numpy(name)) is not None}
    response = decode_response(outputs)
    prompt_logprobs = prompt_token_logprobs(response.prompt_logprobs, prompt_top or 0)
    out = []
    for i, sample in enumerate(response.samples):
        count = len(sample.token_ids) if sample.num_output_tokens is None else sample.num_output_tokens
        totals[sample.index] = totals.get(sample.index, 0) + count
        logprobs = None
        if sample.logprobs is not None:
            logprobs = [token_logprobs(t, by_id, top or 0) for t, by_id in zip(sample.token_ids, sample.logprobs)]
        out.append(
            SampleDelta(
                index=sample.index,
                text=sample.text,
                token_ids=sample.token_ids,
                num_input_tokens=response.num_input_tokens or 0,
                num_output_tokens=totals[sample.index],
                finish_reason=sample.finish_reason,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs if i == 0 else None,
                num_cached_tokens=response.num_cached_tokens or 0,
            )
        )
    return out
