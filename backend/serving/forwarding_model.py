"""Triton glue of the TensorRT-LLM contract's models (`ensemble`, `tensorrt_llm_bls`, the LLM-API `tensorrt_llm` and
the core `tensorrt_llm_core`): each batch item of a request becomes one request to `llm` through BLS, on a thread of
its own, and `llm`'s responses come back translated (`trtllm_contract.py`, `trtllm_core_contract.py`,
`trtllm_llmapi_contract.py`, chosen by the `contract` parameter).
`llm`'s one engine serves them all, in its in-flight batch beside everyone else's requests; these models hold no
weights and load in a second.

A model's transaction policy decides what its clients can do (Triton 2.51): decoupled, it streams (`stream: true`,
`generate_stream`, gRPC streams) and answers unary calls only through `generate`; not decoupled, it answers HTTP
`infer` and gRPC `ModelInfer` as well, one response per request. `execute` returns at once in both (since Triton
24.06 a non-decoupled model may answer through its response sender), so concurrent unary calls still meet in
`llm`'s batches instead of waiting for each other.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.core.config import EngineConfig
from backend.protocol.values import InvalidRequest
from backend.protocol.wire import (
    CANCEL_FORWARDED,
    FORWARDED_ID,
    INVALID_REQUEST,
    LORA_ADMIN_PARAMETER,
    UNAVAILABLE,
    error_text,
)
from backend.serving import trtllm_contract, trtllm_core_contract, trtllm_llmapi_contract
from backend.serving.stub_process import exit_stub_process
from backend.serving.trtllm_contract import ItemRequest

# config.pbtxt parameter `contract`: which TensorRT-LLM model this one stands in for
CONTRACTS = {"text": trtllm_contract, "tokens": trtllm_core_contract, "llmapi": trtllm_llmapi_contract}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_S = 0.1  # as `llm`'s own sweep (backend/engine/output_sender.py)
LLM_OUTPUTS = [
    "text_output",
    "output_ids",
    "sample_index",
    "finish_reason",
    "logprobs",
    "cumulative_logprob",
    "num_input_tokens",
    "num_output_tokens",
    "perf_metrics",
    "context_logits",
    "generation_logits",
]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.target = parameters.get("llm_model_name", "llm")
        self.contract = CONTRACTS[parameters.get("contract", "text")]
        self.input_names = [i["name"] for i in config["input"]]
        self.block_size = _block_size(args.get("model_repository"), self.target)
        self.in_flight: dict[str, set[_Forwarding]] = {}  # by the client's request id, for stop requests
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                tensors = {}
                for name in self.input_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        tensors[name] = tensor.as_numpy()
                if hasattr(self.contract, "with_parameters"):  # request parameters standing for inputs
                    tensors = self.contract.with_parameters(tensors, request.parameters())
                if self.contract.is_stop(tensors):
                    self._stop(request.request_id())
                    sender.send(_stop_answer(getattr(self.contract, "STOP_ANSWER", None)), flags=FINAL)
                    continue
                items = [self.contract.item_request(tensors, b) for b in range(self.contract.batch_size(tensors))]
                for item in items:
                    if hasattr(item, "block_size"):
                        item.block_size = self.block_size
                self._check_transaction_policy(items)
            except InvalidRequest as exc:
                sender.send(_error(error_text(str(exc), INVALID_REQUEST)), flags=FINAL)
                continue
            _Forwarding(self, sender, items, request.request_id()).start()
        return None

    def finalize(self):
        exit_stub_process()

    def _stop(self, request_id: str) -> None:
        """TensorRT-LLM's stop request: the generations of the request with this id end now, each answering
        with what it has."""
        if not request_id:
            raise InvalidRequest("a stop request must carry the request id of the request to stop")
        with self.lock:
            forwardings = list(self.in_flight.get(request_id, ()))
        for forwarding in forwardings:
            threading.Thread(target=forwarding.stop, daemon=True, name="trtllm-stop").start()

    def _check_transaction_policy(self, items: list[ItemRequest]) -> None:
        if self.decoupled:
            return
        how = "deploy the model decoupled (model_transaction_policy { decoupled: true }) or use tensorrt_llm_bls"
        if any(item.stream for item in items):
            raise InvalidRequest(f"stream: true needs a decoupled model; this one answers once per request: {how}")
        if len(items) > 1 or any(item.sampling.get("n", 1) > 1 and not item.ONE_RESPONSE for item in items):
            raise InvalidRequest(
                "a batch of prompts or num_return_sequences > 1 gets one response per item, which needs a decoupled "
                f"model; this one answers once per request: {how}"
            )


class _Forwarding:
    """One client request: its batch items forwarded to `llm` in parallel, their responses sent back as they come,
    then the final flag. A client that cancels has each item's `llm` request cancelled too."""

    def __init__(self, model: TritonPythonModel, sender, items: list[ItemRequest], request_id: str = ""):
        self.model, self.sender, self.items, self.request_id = model, sender, items, request_id
        self.lock = threading.Lock()
        self.pending = len(items)
        self.sender_done = False  # a non-decoupled model's one response is sent
        self.forwarded_ids: set[str] = set()  # its requests to `llm` in flight

    def start(self) -> None:
        if self.request_id:
            with self.model.lock:
                self.model.in_flight.setdefault(self.request_id, set()).add(self)
        for b in range(len(self.items)):
            threading.Thread(target=self._run, args=(b,), daemon=True, name="trtllm-forward").start()

    def _run(self, b: int) -> None:
        item = self.items[b]
        forwarded_id = uuid.uuid4().hex
        with self.lock:
            self.forwarded_ids.add(forwarded_id)
        try:
            lora = getattr(item, "lora", None)
            if lora is not None and not self._has_adapter(*lora):
                return
            responses = self._llm_request(item, forwarded_id).exec(decoupled=True)
            checked = time.monotonic()
            for response in responses:
                # is_cancelled() is a round trip to the server: asked every CANCEL_CHECK_S, not per token
                if time.monotonic() - checked >= CANCEL_CHECK_S:
                    checked = time.monotonic()
                    if self.sender.is_cancelled():
                        self._cancel(forwarded_id)
                        break
                if response.has_error():
                    self._send(_error(response.error().message()))
                    break
                outputs = {}
                for name in LLM_OUTPUTS:
                    tensor = pb_utils.get_output_tensor_by_name(response, name)
                    if tensor is not None:
                        outputs[name] = tensor.as_numpy()
                if "text_output" not in outputs:
                    continue  # the flags-only final response
                batch_index = b if len(self.items) > 1 else None
                for arrays in self.model.contract.response_outputs(outputs, item, batch_index):
                    self._send(
                        pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])
                    )
        except Exception as exc:  # noqa: BLE001 - a BLS failure (llm not loaded, stopped): the client hears it
            self._send(_error(error_text(f"{self.model.target} did not answer: {exc}", UNAVAILABLE)))
        finally:
            self._item_done(forwarded_id)

    def _has_adapter(self, name: str, path: str) -> bool:
        """Whether `llm` holds LoRA adapter `name`, loading it from `path` on first use (TensorRT-LLM's LLM-API
        rule; `llm` must allow loading at run time); where not, the client hears why. Asked each time (a round trip
        to `llm`): an adapter may be unloaded while serving."""
        listing = _admin(self.model.target, {"action": "list"})
        if listing.get("enabled") and name in {a["name"] for a in listing.get("adapters", [])}:
            return True
        answer = _admin(self.model.target, {"action": "load", "lora_name": name, "lora_path": path})
        if answer.get("status") == 200 or "already been loaded" in answer.get("message", ""):
            return True  # loaded now, or by a request beside this one
        why = "LoRA feature is not enabled." if not answer.get("enabled") else answer.get("message", answer)
        self._send(_error(error_text(f"LoRA adapter {name!r} from {path}: {why}", INVALID_REQUEST)))
        return False

    def _llm_request(self, item: ItemRequest, forwarded_id: str):
        tensors = [
            _prompt_tensor(item.prompt),
            pb_utils.Tensor("sampling_parameters", np.array([json.dumps(item.sampling).encode()], dtype=object)),
        ]
        tensors += [pb_utils.Tensor(name, np.array([value])) for name, value in item.llm_flags().items()]
        return pb_utils.InferenceRequest(
            model_name=self.model.target,
            inputs=tensors,
            requested_output_names=LLM_OUTPUTS,
            parameters={FORWARDED_ID: forwarded_id},
        )

    def _cancel(self, forwarded_id: str) -> None:
        request = pb_utils.InferenceRequest(
            model_name=self.model.target,
            inputs=[pb_utils.Tensor("text_input", np.array([b"-"], dtype=object))],
            requested_output_names=["text_output"],
            parameters={CANCEL_FORWARDED: forwarded_id},
        )
        for _ in request.exec(decoupled=True):
            pass

    def _send(self, response) -> None:
        """One response; a non-decoupled model's only response carries the final flag."""
        with self.lock:
            if self.model.decoupled:
                self.sender.send(response)
            elif not self.sender_done:
                self.sender.send(response, flags=FINAL)
                self.sender_done = True

    def stop(self) -> None:
        """End its generations now: `llm` answers each with the tokens it has, which go to the client."""
        with self.lock:
            forwarded = list(self.forwarded_ids)
        for forwarded_id in forwarded:
            self._cancel(forwarded_id)

    def _item_done(self, forwarded_id: str) -> None:
        with self.lock:
            self.forwarded_ids.discard(forwarded_id)
            self.pending -= 1
            if self.pending == 0 and self.request_id:
                with self.model.lock:
                    self.model.in_flight.get(self.request_id, set()).discard(self)
                    if not self.model.in_flight.get(self.request_id):
                        self.model.in_flight.pop(self.request_id, None)
            if self.pending == 0 and self.model.decoupled:
                self.sender.send(flags=FINAL)
            elif self.pending == 0 and not self.sender_done:  # cancelled before any response
                self.sender.send(_error(error_text("the request was cancelled", UNAVAILABLE)), flags=FINAL)
                self.sender_done = True


def _admin(target: str, action: dict) -> dict:
    """`llm`'s answer (JSON) to a LoRA admin action (backend/serving/lora_admin.py)."""
    request = pb_utils.InferenceRequest(
        model_name=target,
        inputs=[pb_utils.Tensor("text_input", np.array([b"-"], dtype=object))],
        requested_output_names=["text_output"],
        parameters={LORA_ADMIN_PARAMETER: json.dumps(action)},
    )
    for response in request.exec(decoupled=True):
        tensor = None if response.has_error() else pb_utils.get_output_tensor_by_name(response, "text_output")
        if tensor is not None:
            return json.loads(tensor.as_numpy().reshape(-1)[0])
    return {}


def _block_size(folder: str | None, target: str) -> int:
    """The KV block size of the model forwarded to (its config.pbtxt beside this model's folder), else the
    default."""
    default = EngineConfig.__dataclass_fields__["block_size"].default
    try:
        text = (Path(folder).parent / target / "config.pbtxt").read_text() if folder else ""
    except OSError:
        text = ""
    return trtllm_llmapi_contract.block_size_of(text, default)


def _stop_answer(error: str | None):
    """A stop request's one response: empty (the core model's), or the error TensorRT-LLM's LLM-API model sends."""
    if error is None:
        return pb_utils.InferenceResponse(output_tensors=[])
    code = getattr(pb_utils.TritonError, "CANCELLED", None)
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(error) if code is None else pb_utils.TritonError(error, code)
    )


def _prompt_tensor(prompt: str | list[int]):
    if isinstance(prompt, str):
        return pb_utils.Tensor("text_input", np.array([prompt.encode()], dtype=object))
    return pb_utils.Tensor("input_ids", np.array(prompt, dtype=np.int32))


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
