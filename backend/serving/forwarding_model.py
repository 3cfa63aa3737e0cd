"""Triton glue of the TensorRT-LLM contract's models (`ensemble`, `tensorrt_llm_bls`): each batch item of a request
becomes one request to `llm` through BLS, on a thread of its own, and `llm`'s responses come back translated
(`trtllm_contract.py`). `llm`'s one engine serves them all, in its in-flight batch beside everyone else's requests;
these models hold no weights and load in a second.

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

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.protocol.values import InvalidRequest
from backend.protocol.wire import CANCEL_FORWARDED, FORWARDED_ID, INVALID_REQUEST, UNAVAILABLE, error_text
from backend.serving import trtllm_contract as contract

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_S = 0.1  # as `llm`'s own sweep (backend/engine/output_sender.py)
LLM_OUTPUTS = [
    "text_output",
    "sample_index",
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
        self.input_names = [i["name"] for i in config["input"]]

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                tensors = {}
                for name in self.input_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        tensors[name] = tensor.as_numpy()
                items = [contract.item_request(tensors, b) for b in range(contract.batch_size(tensors))]
                self._check_transaction_policy(items)
            except InvalidRequest as exc:
                sender.send(_error(error_text(str(exc), INVALID_REQUEST)), flags=FINAL)
                continue
            _Forwarding(self, sender, items).start()
        return None

    def _check_transaction_policy(self, items: list[contract.ItemRequest]) -> None:
        if self.decoupled:
            return
        how = "deploy the model decoupled (model_transaction_policy { decoupled: true }) or use tensorrt_llm_bls"
        if any(item.stream for item in items):
            raise InvalidRequest(f"stream: true needs a decoupled model; this one answers once per request: {how}")
        if len(items) > 1 or any(item.sampling.get("n", 1) > 1 for item in items):
            raise InvalidRequest(
                "a batch of prompts or num_return_sequences > 1 gets one response per item, which needs a decoupled "
                f"model; this one answers once per request: {how}"
            )


class _Forwarding:
    """One client request: its batch items forwarded to `llm` in parallel, their responses sent back as they come,
    then the final flag. A client that cancels has each item's `llm` request cancelled too."""

    def __init__(self, model: TritonPythonModel, sender, items: list[contract.ItemRequest]):
        self.model, self.sender, self.items = model, sender, items
        self.lock = threading.Lock()
        self.pending = len(items)
        self.sender_done = False  # a non-decoupled model's one response is sent

    def start(self) -> None:
        for b in range(len(self.items)):
            threading.Thread(target=self._run, args=(b,), daemon=True, name="trtllm-forward").start()

    def _run(self, b: int) -> None:
        item = self.items[b]
        forwarded_id = uuid.uuid4().hex
        try:
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
                for arrays in contract.response_outputs(outputs, item, batch_index):
                    self._send(
                        pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])
                    )
        except Exception as exc:  # noqa: BLE001 - a BLS failure (llm not loaded, stopped): the client hears it
            self._send(_error(error_text(f"{self.model.target} did not answer: {exc}", UNAVAILABLE)))
        finally:
            self._item_done()

    def _llm_request(self, item: contract.ItemRequest, forwarded_id: str):
        tensors = [
            pb_utils.Tensor("text_input", np.array([item.text_input.encode()], dtype=object)),
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

    def _item_done(self) -> None:
        with self.lock:
            self.pending -= 1
            if self.pending == 0 and self.model.decoupled:
                self.sender.send(flags=FINAL)
            elif self.pending == 0 and not self.sender_done:  # cancelled before any response
                self.sender.send(_error(error_text("the request was cancelled", UNAVAILABLE)), flags=FINAL)
                self.sender_done = True


def _error(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
