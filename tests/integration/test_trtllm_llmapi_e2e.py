"""TensorRT-LLM's LLM-API Triton model against the real server: `tensorrt_llm` (text in, text out, no batch
dimension; not decoupled, as its model.yaml ships) forwards to `llm` (fp32, exact), called the way its docs/llmapi.md
and `end_to_end_test.py --test-llmapi` call it: the generate endpoint's curl, HTTP and gRPC `infer` with `[1]`
tensors, gRPC streaming (a decoupled copy, loaded here), `--sampling-params` and `--output-config`. Every declared
output is checked; greedy text equals transformers'."""

from __future__ import annotations

import json
import math
import os
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import launcher
from backend.serving.trtllm_llmapi_contract import INPUTS, OUTPUTS
from tests.integration.test_trtllm_contract_e2e import NUMPY, client_inputs, generate, greedy, grpc_stream

MODEL = "tensorrt_llm"
STREAMING = "tensorrt_llm_streaming"  # the same model, decoupled (loaded by the `models` fixture)
ON_LORA = "tensorrt_llm_lora"  # the same model, forwarding to the LoRA variant
PROMPT = "The future of AI is"
DTYPES = {"BYTES": object, "FP32": np.float32, "INT32": np.int32, "INT64": np.int64}


def inputs(prompt: str = PROMPT, **values) -> dict[str, np.ndarray]:
    """Its clients' inputs: `[prompt]` and `[value]` (a list for the list inputs), in the declared datatypes."""
    out = {"text_input": np.array([prompt.encode()], dtype=object)}
    for name, value in values.items():
        row = value if isinstance(value, list) else [value]
        out[name] = np.array([v.encode() if isinstance(v, str) else v for v in row], dtype=NUMPY[INPUTS[name][0]])
    return out


def infer(server, values: dict[str, np.ndarray], module=grpcclient, model: str = MODEL, request_id: str = "0"):
    url = server.grpc_url if module is grpcclient else f"{server.host}:{server.http_port}"
    return module.InferenceServerClient(url).infer(model, client_inputs(values, module), request_id=request_id)


def text(result) -> str:
    return result.as_numpy("text_output")[0].decode()


@pytest.fixture(scope="module")
def models(server):
    """A decoupled copy (gRPC streaming) and a copy forwarding to the LoRA variant, loaded beside the shipped model
    through Triton's repository API with config overrides (Triton gives a model one transaction policy)."""
    from testkit.server_variants import LORA_MODEL

    client = httpclient.InferenceServerClient(f"{server.host}:{server.http_port}")
    headers = {launcher.ADMIN_HEADER: os.environ["LLM_ADMIN_KEY"]}
    config = client.get_model_config(MODEL, headers=headers)
    files = {"file:1/model.py": (server.repository / MODEL / "1" / "model.py").read_bytes()}
    copies = {STREAMING: (True, "llm"), ON_LORA: (False, LORA_MODEL)}
    for name, (decoupled, target) in copies.items():
        override = {**config, "name": name, "model_transaction_policy": {"decoupled": decoupled}}
        override["parameters"] = {**config["parameters"], "llm_model_name": {"string_value": target}}
        client.load_model(name, headers=headers, config=json.dumps(override), files=files)
    yield
    for name in copies:
        client.unload_model(name, headers=headers)


def test_its_docs_curl_answers_the_prompt_and_transformers_greedy_text(server, reference):
    """docs/llmapi.md's request verbatim: `max_tokens` is a request parameter there (not an input), which counts."""
    status, (answer,) = generate(server, MODEL, {"text_input": PROMPT, "max_tokens": 10})
    assert status == 200, answer
    assert answer["model_name"] == MODEL and answer["text_output"] == PROMPT + greedy(reference, PROMPT, 10)


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_its_end_to_end_test_over_infer(server, reference, module):
    """end_to_end_test.py --test-llmapi: the functionality test's request with --output-config (only the outputs
    asked for are sent), then the performance test's `sampling_param_max_tokens`."""
    config = {"return_finish_reason": True, "return_stop_reason": True}
    result = infer(server, inputs(**config), module)
    assert text(result) == PROMPT + greedy(reference, PROMPT, 32)  # TensorRT-LLM's default max_tokens
    assert result.as_numpy("finish_reason").tolist() == [b"length"]
    assert result.as_numpy("stop_reason").tolist() == [b"None"]
    assert result.as_numpy("cumulative_logprob") is None and result.as_numpy("arrival_time_ns") is None
    result = infer(server, inputs(sampling_param_max_tokens=6), module)
    assert text(result) == PROMPT + greedy(reference, PROMPT, 6) and result.as_numpy("finish_reason") is None


def test_grpc_streaming_sends_the_answer_so_far_in_every_response(server, reference, models):
    """end_to_end_test.py --test-llmapi --streaming: `streaming` [True] over a gRPC stream of the decoupled copy;
    each response carries the whole text so far (TensorRT-LLM's RequestOutput.text), the last one everything."""
    config = {"return_finish_reason": True, "return_stop_reason": True, "return_cumulative_logprob": True}
    values = inputs(streaming=True, sampling_param_max_tokens=12, **config)
    responses = grpc_stream(server, STREAMING, values, outputs=("text_output", *[k[7:] for k in config]))
    texts = [text(r) for r in responses]
    assert len(texts) > 1 and texts[-1] == PROMPT + greedy(reference, PROMPT, 12)
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    reasons = [r.as_numpy("finish_reason")[0] for r in responses]
    assert reasons[-1] == b"length" and set(reasons[:-1]) == {b"None"}
    assert all(r.as_numpy("stop_reason").tolist() == [b"None"] for r in responses)
    logprobs = [float(r.as_numpy("cumulative_logprob")[0]) for r in responses]
    assert logprobs == sorted(logprobs, reverse=True) and logprobs[-1] < 0  # a sum of more and more logprobs
    unary = infer(server, inputs(sampling_param_max_tokens=12, return_cumulative_logprob=True))
    assert unary.as_numpy("cumulative_logprob")[0] == pytest.approx(logprobs[-1], abs=1e-4)
    with pytest.raises(InferenceServerException, match="needs a decoupled model"):
        infer(server, inputs(streaming=True))  # the shipped model answers once per request


def own_answer(server, prompt: str, sampling: dict) -> str:
    """`llm`'s own answer (no prompt) with these vLLM-style sampling parameters."""
    body = {"text_input": prompt, "sampling_parameters": json.dumps(sampling), "exclude_input_in_output": True}
    status, (answer,) = generate(server, "llm", body)
    assert status == 200, answer
    return answer["text_output"]


def test_sampling_params_reach_the_engine(server, reference):
    """end_to_end_test.py --sampling-params: each sampling_param_* input has its effect, the answer `llm` gives
    with the same values."""
    answer = greedy(reference, PROMPT, 16)
    sampled = {"temperature": 0.875, "top_k": 20, "top_p": 0.875, "seed": 7, "max_tokens": 16}
    values = inputs(
        sampling_param_exclude_input_from_output=True, **{f"sampling_param_{k}": v for k, v in sampled.items()}
    )
    runs = [text(infer(server, values)) for _ in "ab"]
    assert runs[0] == runs[1] == own_answer(server, PROMPT, sampled)  # the seed makes a sampled answer repeatable
    excluded = infer(server, inputs(sampling_param_max_tokens=16, sampling_param_exclude_input_from_output=True))
    assert text(excluded) == answer
    stop = answer.split()[2]  # a word the greedy answer holds
    stopped = infer(
        server,
        inputs(
            sampling_param_max_tokens=16,
            sampling_param_stop=["zzz", stop],
            return_stop_reason=True,
            return_finish_reason=True,
        ),
    )
    assert text(stopped) == PROMPT + answer[: answer.index(stop)]
    assert stopped.as_numpy("stop_reason").tolist() == [stop.encode()]
    assert stopped.as_numpy("finish_reason").tolist() == [b"stop"]
    counting = "1, 2, 1, 2, 1, 2, 1, 2,"  # greedy repeats it; penalties steer away
    penalties = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
    values = inputs(counting, sampling_param_max_tokens=12, **{f"sampling_param_{k}": v for k, v in penalties.items()})
    penalised = text(infer(server, values))
    assert penalised == counting + own_answer(server, counting, {**penalties, "temperature": 0, "max_tokens": 12})
    assert penalised != counting + greedy(reference, counting, 12)
    best = infer(
        server,
        inputs(
            sampling_param_best_of=3,
            sampling_param_temperature=1.0,
            sampling_param_seed=3,
            sampling_param_max_tokens=8,
            return_cumulative_logprob=True,
        ),
    )
    assert best.as_numpy("text_output").shape == (1,) and best.as_numpy("cumulative_logprob").shape == (1,)


def test_every_output_in_its_declared_type_with_the_engines_values(server, reference):
    """--output-config and sampling_param_return_perf_metrics together: every output of the config, `[1]` in
    its declared datatype; the second of two requests for one long prompt finds its blocks in the prefix cache."""
    prompt = "Summarise the history of the printing press in Europe, from Gutenberg to the industrial age. " * 3
    values = inputs(
        prompt,
        sampling_param_max_tokens=4,
        sampling_param_return_perf_metrics=True,
        return_finish_reason=True,
        return_stop_reason=True,
        return_cumulative_logprob=True,
    )
    infer(server, values)
    result = infer(server, values, httpclient)
    for name, (dtype, _) in OUTPUTS.items():
        array = result.as_numpy(name)
        assert array is not None and array.shape == (1,) and array.dtype == DTYPES[dtype], name
    value = {name: result.as_numpy(name)[0] for name in OUTPUTS}
    assert value["text_output"].decode() == prompt + greedy(reference, prompt, 4)
    assert (value["finish_reason"], value["stop_reason"]) == (b"length", b"None")
    prompt_blocks = math.ceil(len(reference.prompt_ids(prompt)) / 16)  # `llm`'s block size
    assert 0 < value["kv_cache_reused_block"] < prompt_blocks
    assert value["kv_cache_missed_block"] == prompt_blocks - value["kv_cache_reused_block"]
    assert value["kv_cache_hit_rate"] == pytest.approx(value["kv_cache_reused_block"] / prompt_blocks)
    assert value["kv_cache_alloc_total_blocks"] >= prompt_blocks
    assert value["kv_cache_alloc_new_blocks"] == value["kv_cache_alloc_total_blocks"] - value["kv_cache_reused_block"]
    times = [value[f"{n}_time_ns"] for n in ("arrival", "first_scheduled", "first_token", "last_token")]
    assert times == sorted(times) and times[0] > 1.7e18  # ns since the epoch
    assert (value["acceptance_rate"], value["total_accepted_draft_tokens"], value["total_draft_tokens"]) == (0, 0, 0)
    assert value["cumulative_logprob"] < 0


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, reference):
    refusals = [
        ({**inputs(), "sampling_param_max_tokens": np.array([4], np.int64)}, "data-type is 'INT64', but model"),
        ({"sampling_param_max_tokens": np.array([4], np.int32)}, "text_input is required"),
        (inputs(sampling_param_top_p=1.5), "sampling_param_top_p must be between 0.0 and 1.0"),
        (inputs(sampling_param_max_tokens=0), "sampling_param_max_tokens must be between 1"),
        (inputs(lora_name="alpha"), "lora_id, lora_name, and lora_path must all be provided together"),
        (inputs(image_url=["http://example.com/a.png"]), "image_url is not supported"),
        ({**inputs(), "input_ids": np.array([1, 2], np.int32)}, "unexpected inference input 'input_ids'"),
    ]
    for values, message in refusals:
        with pytest.raises(InferenceServerException, match=message):
            infer(server, values)
    status, (answer,) = generate(server, MODEL, {"text_input": PROMPT, "max_token": 5})
    assert status == 400 and "unknown request parameter 'max_token'" in answer["error"], answer
    status, (answer,) = generate(server, MODEL, {"text_input": PROMPT, "input_ids": 5})
    assert status == 400 and "tensorrt_llm_core model's input_ids" in answer["error"], answer
    status, (answer,) = generate(server, "tensorrt_llm_core", {"text_input": PROMPT, "request_output_len": 4})
    assert status == 400 and "a text prompt: the tensorrt_llm model's text_input" in answer["error"], answer
    assert text(infer(server, inputs(sampling_param_max_tokens=3))) == PROMPT + greedy(reference, PROMPT, 3)


def test_a_stop_request_ends_the_request_of_its_id(server):
    """`stop` [True] with a request's id: that request answers with what it has (finish reason `cancelled`), the
    stop request itself with TensorRT-LLM's error."""
    results = {}
    long = inputs(sampling_param_max_tokens=400, return_finish_reason=True)
    worker = threading.Thread(target=lambda: results.update(done=infer(server, long, request_id="stop-me")))
    worker.start()
    server.wait_for(lambda m: m.get("llm_requests_running") >= 1, what="the long request to run")
    with pytest.raises(InferenceServerException, match="Request cancelled by client"):
        infer(server, inputs(stop=True), request_id="stop-me")
    worker.join(timeout=120)
    assert results["done"].as_numpy("finish_reason").tolist() == [b"cancelled"]
    assert len(text(results["done"])) < len(PROMPT) + 400


def test_a_lora_adapter_by_id_name_and_path_is_the_engines_adapter(server, models):
    """lora_id, lora_name and lora_path together run the adapter `llm` holds by that name; a name it does not hold
    is loaded from lora_path on first use (the variant allows loading at run time)."""
    from testkit.server_variants import LORA_MODEL

    folder = server.variants[LORA_MODEL]["lora_modules"].rsplit("/", 1)[0]

    def own(adapter: str) -> str:  # the variant's own answer with the adapter
        body = {
            "text_input": PROMPT,
            "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0, "lora_name": adapter}),
        }
        status, (answer,) = generate(server, LORA_MODEL, {**body, "exclude_input_in_output": True})
        assert status == 200, answer
        return answer["text_output"]

    def through_llmapi(name: str, path: str) -> str:
        lora = {"lora_id": 1, "lora_name": name, "lora_path": path}
        values = inputs(sampling_param_max_tokens=8, sampling_param_exclude_input_from_output=True, **lora)
        return text(infer(server, values, model=ON_LORA))

    assert through_llmapi("alpha", f"{folder}/alpha") == own("alpha")
    try:
        assert through_llmapi("epsilon", f"{folder}/gamma") == own("gamma")  # loaded from the path
    finally:
        unload = {"text_input": "-", "lora_adapters": json.dumps({"action": "unload", "lora_name": "epsilon"})}
        generate(server, LORA_MODEL, unload)
    with pytest.raises(InferenceServerException, match="lora_path does not exist"):
        through_llmapi("zeta", f"{folder}/missing")
