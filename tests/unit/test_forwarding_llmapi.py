"""backend/serving/forwarding_model.py serving TensorRT-LLM's LLM-API contract (`tensorrt_llm`), with the fake
`triton_python_backend_utils` of test_forwarding_model.py: what it asks `llm` for, request parameters, best_of in one
response, stop requests, LoRA adapters loaded on first use, `llm`'s block size (the real server:
tests/integration/test_trtllm_llmapi_e2e.py)."""

from __future__ import annotations

import importlib
import json
import sys

import numpy as np
import pytest

from tests.unit import test_forwarding_model as fake

PROMPT = np.array([b"Hi"], dtype=object)


class Request(fake.Request):
    def __init__(self, sender, request_id="", parameters="", **tensors):
        super().__init__(sender, request_id, **tensors)
        self.params = parameters

    def parameters(self):
        return self.params


@pytest.fixture
def llmapi(monkeypatch, tmp_path):
    """make(decoupled) -> (model, fake pb); `llm`'s config.pbtxt beside it says block_size 32."""
    pb = fake.FakePb()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    module = importlib.reload(importlib.import_module("backend.serving.forwarding_model"))
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.pbtxt").write_text(
        'parameters [ { key: "block_size", value: { string_value: "32" } } ]'
    )

    def make(decoupled: bool = False):
        model = module.TritonPythonModel()
        config = {
            "model_transaction_policy": {"decoupled": decoupled},
            "input": [{"name": name} for name in module.CONTRACTS["llmapi"].INPUTS],
            "parameters": {"llm_model_name": {"string_value": "llm"}, "contract": {"string_value": "llmapi"}},
        }
        model.initialize({"model_config": json.dumps(config), "model_repository": str(tmp_path / "tensorrt_llm")})
        return model, pb

    return make


def run(model, request_id="", parameters="", **tensors) -> fake.Sender:
    sender = fake.Sender()
    model.execute([Request(sender, request_id, parameters, **tensors)])
    assert sender.done.wait(10)
    return sender


def errors(sender: fake.Sender) -> list[str]:
    return [r.error().message() for r, _ in sender.sent if r is not None and r.has_error()]


def test_a_prompt_goes_to_llm_and_comes_back_after_the_prompt(llmapi):
    model, pb = llmapi()
    pb.answer = lambda inputs: [
        {"text_output": np.array([b" there"], dtype=object), "finish_reason": np.array([b"length"], dtype=object)}
    ]
    sender = run(model, text_input=PROMPT, return_finish_reason=np.array([True]))
    (call,) = pb.bls
    assert json.loads(call["inputs"]["sampling_parameters"][0]) == {"max_tokens": 32, "temperature": 0.0}
    assert call["inputs"]["exclude_input_in_output"].tolist() == [True]
    assert call["inputs"]["return_finish_reason"].tolist() == [True]
    assert fake.texts(sender) == [{"text_output": [b"Hi there"], "finish_reason": [b"length"]}]
    assert [flags for _, flags in sender.sent] == [fake.FINAL]


def test_request_parameters_are_sampling_values_and_unknown_ones_are_refused(llmapi):
    model, pb = llmapi()
    run(model, parameters='{"max_tokens": 10}', text_input=PROMPT)
    assert json.loads(pb.bls[0]["inputs"]["sampling_parameters"][0])["max_tokens"] == 10
    refused = run(model, parameters='{"max_tokenz": 10}', text_input=PROMPT)
    (message,) = errors(refused)
    assert "unknown request parameter 'max_tokenz'" in message and len(pb.bls) == 1


def test_best_of_is_one_response_even_without_decoupled(llmapi):
    model, pb = llmapi(decoupled=False)
    pb.answer = lambda inputs: [
        {
            "text_output": np.array([b" a", b" b"], dtype=object),
            "cumulative_logprob": np.array([-2.0, -1.0], np.float32),
            "sample_index": np.array([0, 1], np.int32),
        }
    ]
    sender = run(model, text_input=PROMPT, sampling_param_best_of=np.array([2], np.int32))
    assert json.loads(pb.bls[0]["inputs"]["sampling_parameters"][0])["n"] == 2
    assert fake.texts(sender) == [{"text_output": [b"Hi b"]}]


def test_streaming_needs_a_decoupled_model_and_streams_the_answer_so_far(llmapi):
    model, pb = llmapi(decoupled=False)
    (message,) = errors(run(model, text_input=PROMPT, streaming=np.array([True])))
    assert "needs a decoupled model" in message and not pb.bls
    model, pb = llmapi(decoupled=True)
    pb.answer = lambda inputs: [{"text_output": np.array([t], dtype=object)} for t in (b" a", b" b")]
    sender = run(model, text_input=PROMPT, streaming=np.array([True]))
    assert fake.texts(sender) == [{"text_output": [b"Hi a"]}, {"text_output": [b"Hi a b"]}]
    assert pb.bls[0]["inputs"]["stream"].tolist() == [True]


def test_a_stop_request_answers_tensorrt_llms_cancelled_error(llmapi):
    model, _ = llmapi()
    assert errors(run(model, "r1", text_input=PROMPT, stop=np.array([True]))) == ["Request cancelled by client"]
    (message,) = errors(run(model, text_input=PROMPT, stop=np.array([True])))
    assert "request id" in message


def test_perf_outputs_count_the_prompts_blocks_at_llms_block_size(llmapi):
    model, pb = llmapi()
    perf = dict.fromkeys(("kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks", "acceptance_rate"), 0)
    perf |= dict.fromkeys(("total_accepted_draft_tokens", "total_draft_tokens"), 0)
    perf |= {name: 1 for name in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns")}
    perf |= {"kv_cache_reused_blocks": 1, "last_token_time_ns": 2}
    pb.answer = lambda inputs: [
        {
            "text_output": np.array([b"!"], dtype=object),
            "num_input_tokens": np.array([70], np.uint32),  # 3 blocks of 32
            "perf_metrics": np.array([json.dumps(perf)], dtype=object),
        }
    ]
    (out,) = fake.texts(run(model, text_input=PROMPT, sampling_param_return_perf_metrics=np.array([True])))
    assert out["kv_cache_reused_block"] == [1] and out["kv_cache_missed_block"] == [2]
    assert pb.bls[0]["inputs"]["return_perf_metrics"].tolist() == [True]


def lora_inputs(path) -> dict[str, np.ndarray]:
    return {
        "text_input": PROMPT,
        "lora_id": np.array([1], np.uint64),
        "lora_name": np.array([b"alpha"], dtype=object),
        "lora_path": np.array([str(path).encode()], dtype=object),
    }


def admin_answering(pb, answers: dict[str, dict]):
    """exec answering LoRA admin actions with `answers[action]` and generations as pb.answer does."""
    original = pb.InferenceRequest.exec

    def exec_(self, decoupled):
        if "lora_adapters" in self.call["parameters"]:
            action = json.loads(self.call["parameters"]["lora_adapters"])
            pb.bls.append({"admin": action})
            answer = json.dumps(answers[action["action"]]).encode()
            return iter([fake.Response([fake.Tensor("text_output", np.array([answer], dtype=object))])])
        return original(self, decoupled)

    pb.InferenceRequest.exec = exec_


def test_a_lora_adapter_is_loaded_from_its_path_on_first_use(llmapi, tmp_path):
    model, pb = llmapi()
    admin_answering(pb, {"list": {"enabled": True, "adapters": []}, "load": {"status": 200, "enabled": True}})
    run(model, **lora_inputs(tmp_path))
    admin_answering(pb, {"list": {"enabled": True, "adapters": [{"name": "alpha"}]}})
    run(model, **lora_inputs(tmp_path))
    actions = [c["admin"] for c in pb.bls if "admin" in c]
    load = {"action": "load", "lora_name": "alpha", "lora_path": str(tmp_path)}
    assert actions == [{"action": "list"}, load, {"action": "list"}]  # held the second time: not loaded again
    generations = [json.loads(c["inputs"]["sampling_parameters"][0]) for c in pb.bls if "inputs" in c]
    assert [g["lora_name"] for g in generations] == ["alpha", "alpha"]


def test_an_adapter_llm_cannot_load_is_refused_saying_why(llmapi, tmp_path):
    model, pb = llmapi()
    admin_answering(pb, {"list": {"enabled": False, "adapters": []}, "load": {"status": 403, "enabled": False}})
    (message,) = errors(run(model, **lora_inputs(tmp_path)))
    assert message.startswith("[invalid_request] LoRA adapter 'alpha'") and "LoRA feature is not enabled." in message
    assert not [c for c in pb.bls if "inputs" in c]  # nothing generated
