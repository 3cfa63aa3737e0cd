"""backend/serving/forwarding_model.py, the Triton glue of TensorRT-LLM's models, with a fake
`triton_python_backend_utils` whose BLS calls answer like `llm`: what it asks `llm` for, what it sends back, and
when the final flag goes out (the real server: tests/integration/test_trtllm_contract_e2e.py)."""

from __future__ import annotations

import importlib
import json
import sys
import threading
import types

import numpy as np
import pytest

FINAL = 1


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, np.asarray(array)

    def as_numpy(self):
        return self.array


class Response:
    def __init__(self, output_tensors=(), error=None):
        self.output_tensors, self.error_value = list(output_tensors), error

    def has_error(self):
        return self.error_value is not None

    def error(self):
        return self.error_value


class Error:
    def __init__(self, message):
        self.text = message

    def message(self):
        return self.text


class FakePb(types.ModuleType):
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    def __init__(self):
        super().__init__("triton_python_backend_utils")
        self.bls: list[dict] = []  # every request made to llm: its inputs and parameters
        self.answer = lambda inputs: [{"text_output": np.array([b"hi"], dtype=object)}]
        pb = self

        class InferenceRequest:
            def __init__(self, model_name, inputs, requested_output_names, parameters):
                self.call = {"model": model_name, "inputs": {t.name: t.array for t in inputs}, "parameters": parameters}

            def exec(self, decoupled):
                assert decoupled
                pb.bls.append(self.call)
                if "cancel_forwarded" in self.call["parameters"]:
                    return iter([Response()])
                return iter([Response([Tensor(k, v) for k, v in r.items()]) for r in pb.answer(self.call["inputs"])])

        self.InferenceRequest = InferenceRequest
        self.InferenceResponse, self.TritonError, self.Tensor = Response, Error, Tensor

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return Tensor(name, request.tensors[name]) if name in request.tensors else None

    @staticmethod
    def get_output_tensor_by_name(response, name):
        return next((t for t in response.output_tensors if t.name == name), None)

    @staticmethod
    def using_decoupled_model_transaction_policy(config):
        return config["model_transaction_policy"]["decoupled"]


class Sender:
    def __init__(self, cancelled=False):
        self.sent, self.done, self.cancelled = [], threading.Event(), cancelled

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))
        if flags == FINAL:
            self.done.set()

    def is_cancelled(self):
        return self.cancelled


class Request:
    def __init__(self, sender, request_id="", **tensors):
        self.sender, self.tensors, self.id = sender, tensors, request_id

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return self.id


@pytest.fixture
def make_model(monkeypatch):
    pb = FakePb()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    module = importlib.reload(importlib.import_module("backend.serving.forwarding_model"))

    def make(decoupled: bool, contract: str = "text"):
        model = module.TritonPythonModel()
        config = {
            "model_transaction_policy": {"decoupled": decoupled},
            "input": [{"name": name} for name in module.CONTRACTS[contract].INPUTS],
            "parameters": {"llm_model_name": {"string_value": "llm"}, "contract": {"string_value": contract}},
        }
        model.initialize({"model_config": json.dumps(config)})
        return model, pb

    return make


def run(model, request_id="", **tensors) -> Sender:
    sender = Sender()
    model.execute([Request(sender, request_id, **tensors)])
    assert sender.done.wait(10)
    return sender


def texts(sender: Sender) -> list:
    return [
        {t.name: t.array.tolist() for t in response.output_tensors}
        for response, _ in sender.sent
        if response is not None and not response.has_error()
    ]


def test_a_batch_goes_to_llm_item_by_item_and_comes_back_tagged(make_model):
    model, pb = make_model(decoupled=True)
    pb.answer = lambda inputs: [{"text_output": np.array([inputs["text_input"][0].upper()], dtype=object)}]
    sender = run(
        model,
        text_input=np.array([[b"one"], [b"two"]], dtype=object),
        max_tokens=np.array([[3], [4]], np.int32),
        stream=np.array([[True], [True]]),
    )
    assert sorted(json.loads(c["inputs"]["sampling_parameters"][0])["max_tokens"] for c in pb.bls) == [3, 4]
    assert all(c["model"] == "llm" and c["inputs"]["stream"].tolist() == [True] for c in pb.bls)
    assert sorted((r["batch_index"], r["text_output"]) for r in texts(sender)) == [([[0]], [b"ONE"]), ([[1]], [b"TWO"])]
    assert [flags for _, flags in sender.sent] == [0, 0, FINAL] and sender.sent[-1][0] is None


def test_a_unary_model_sends_one_final_response(make_model):
    model, pb = make_model(decoupled=False)
    sender = run(model, text_input=np.array([[b"hi"]], dtype=object), max_tokens=np.array([[2]], np.int32))
    assert texts(sender) == [{"text_output": [b"hi"]}] and [flags for _, flags in sender.sent] == [FINAL]


@pytest.mark.parametrize("extra", [{"stream": np.array([[True]])}, {"num_return_sequences": np.array([[2]], np.int32)}])
def test_a_unary_model_refuses_what_needs_several_responses(make_model, extra):
    model, pb = make_model(decoupled=False)
    sender = run(model, text_input=np.array([[b"hi"]], dtype=object), max_tokens=np.array([[2]], np.int32), **extra)
    ((response, flags),) = sender.sent
    assert flags == FINAL and "needs a decoupled model" in response.error().message() and not pb.bls


def test_an_llm_error_reaches_the_client(make_model):
    model, pb = make_model(decoupled=True)
    original = pb.InferenceRequest.exec
    pb.InferenceRequest.exec = lambda self, decoupled: iter([Response(error=Error("[server_busy] full"))])
    sender = run(model, text_input=np.array([[b"hi"]], dtype=object), max_tokens=np.array([[2]], np.int32))
    pb.InferenceRequest.exec = original
    assert sender.sent[0][0].error().message() == "[server_busy] full" and sender.sent[-1][1] == FINAL


def test_a_cancelled_client_cancels_its_llm_request(make_model, monkeypatch):
    model, pb = make_model(decoupled=True)
    monkeypatch.setattr(sys.modules["backend.serving.forwarding_model"], "CANCEL_CHECK_S", 0.0)  # ask at once
    sender = Sender(cancelled=True)
    model.execute([Request(sender, text_input=np.array([[b"hi"]], dtype=object), max_tokens=np.array([[2]], np.int32))])
    assert sender.done.wait(10)
    forwarded, cancel = pb.bls
    assert cancel["parameters"] == {"cancel_forwarded": forwarded["parameters"]["forwarded_id"]}
    assert texts(sender) == []


def test_the_core_model_sends_token_ids_and_answers_output_ids_after_the_prompt(make_model):
    model, pb = make_model(decoupled=False, contract="tokens")
    pb.answer = lambda inputs: [
        {"text_output": np.array([b"xy"], dtype=object), "output_ids": np.array([7, 8], np.int32)}
    ]
    sender = run(
        model,
        input_ids=np.array([[5, 6, 0]], np.int32),  # padded past input_lengths
        input_lengths=np.array([[2]], np.int32),
        request_output_len=np.array([[2]], np.int32),
        runtime_top_k=np.array([[1]], np.int32),
        runtime_top_p=np.array([[0.0]], np.float32),
    )
    (call,) = pb.bls
    assert call["inputs"]["input_ids"].tolist() == [5, 6] and "text_input" not in call["inputs"]
    assert json.loads(call["inputs"]["sampling_parameters"][0]) == {"max_tokens": 2, "top_k": 1, "temperature": 0.0}
    (answer,) = texts(sender)
    assert answer == {"output_ids": [[[5, 6, 7, 8]]], "sequence_length": [[4]]}


def test_a_stop_request_ends_the_request_of_the_same_id_with_what_it_has(make_model):
    model, pb = make_model(decoupled=False, contract="tokens")
    stopped = threading.Event()
    original = pb.InferenceRequest.exec

    def exec_(self, decoupled):
        if "cancel_forwarded" in self.call["parameters"]:
            stopped.set()
            return original(self, decoupled)
        pb.bls.append(self.call)
        assert stopped.wait(10)  # llm answers once cancelled, with the tokens so far
        return iter([Response([Tensor("text_output", np.array([b"a"], object)), Tensor("output_ids", [9])])])

    pb.InferenceRequest.exec = exec_
    first = Sender()
    inputs = {"input_ids": np.array([[5]], np.int32), "input_lengths": np.array([[1]], np.int32)}
    model.execute([Request(first, "r1", request_output_len=np.array([[50]], np.int32), **inputs)])
    while not pb.bls:
        threading.Event().wait(0.01)
    stop = run(
        model,
        "r1",
        stop=np.array([[True]]),
        input_ids=np.empty((1, 1), np.int32),
        input_lengths=np.array([[0]], np.int32),
        request_output_len=np.array([[0]], np.int32),
    )
    assert [(r.output_tensors, flags) for r, flags in stop.sent] == [([], FINAL)]  # answered at once, empty
    assert first.done.wait(10)
    pb.InferenceRequest.exec = original
    assert texts(first) == [{"output_ids": [[[5, 9]]], "sequence_length": [[2]]}]
    assert not model.in_flight  # nothing left to stop


def test_finalize_ends_the_stub_without_the_interpreters_teardown(make_model, monkeypatch):
    model, _ = make_model(decoupled=True)
    exits = []
    monkeypatch.setattr(sys.modules["backend.serving.forwarding_model"], "exit_stub_process", lambda: exits.append(1))
    model.finalize()
    assert exits == [1]
