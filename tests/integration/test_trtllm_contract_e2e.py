"""TensorRT-LLM's client contract against the real server (its README, its ensemble and tensorrt_llm_bls configs):
`ensemble` (decoupled, as shipped) and `tensorrt_llm_bls` (not decoupled) forward to `llm` (fp32, exact), called
the way TensorRT-LLM's clients call them: every tensor with a batch dimension, `[1, 1]` for one value."""

from __future__ import annotations

import http.client
import json
import queue
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from backend.serving.trtllm_contract import INPUTS

PROMPT = "What is machine learning?"
STREAMING, UNARY = "ensemble", "tensorrt_llm_bls"
NUMPY = {"BYTES": object, "BOOL": bool, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}


def arrays(**values) -> dict[str, np.ndarray]:
    """Inputs as TensorRT-LLM's clients build them: `[[value]]`, or `[[v1, v2, ...]]` for a word list."""
    out = {}
    for name, value in values.items():
        row = value if isinstance(value, list) else [value]
        out[name] = np.array([[v.encode() if isinstance(v, str) else v for v in row]], dtype=NUMPY[INPUTS[name][0]])
    return out


def client_inputs(values: dict[str, np.ndarray], module=grpcclient) -> list:
    """`values` as tritonclient inputs of `module` (grpcclient or httpclient)."""
    inputs = []
    for name, array in values.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def grpc_stream(server, model: str, values: dict[str, np.ndarray], outputs=("text_output",)) -> list:
    """Every response of one request over a gRPC stream (the API TensorRT-LLM's end-to-end client always uses)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer(
        model, client_inputs(values), outputs=[grpcclient.InferRequestedOutput(n) for n in outputs], request_id="1"
    )
    client.stop_stream()  # waits for the final response
    client.close()
    responses = []
    while not results.empty():
        responses.append(results.get())
    errors = [r.message() for r in responses if isinstance(r, InferenceServerException)]
    assert not errors, errors
    return [r for r in responses if r.as_numpy("text_output") is not None]


def text_of(responses) -> str:
    return "".join(r.as_numpy("text_output")[0].decode() for r in responses)


def generate(server, model: str, body: dict, stream: bool = False) -> tuple[int, list[dict]]:
    """(status, JSON bodies) of Triton's generate / generate_stream endpoint."""
    conn = http.client.HTTPConnection(server.host, server.http_port, timeout=120)
    conn.request("POST", f"/v2/models/{model}/generate{'_stream' if stream else ''}", body=json.dumps(body))
    response = conn.getresponse()
    text = response.read().decode()
    if stream:
        return response.status, [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    return response.status, [json.loads(text)]


def greedy(reference, prompt: str, max_tokens: int) -> str:
    return reference.get(prompt, max_tokens).text


@pytest.mark.parametrize("model", [STREAMING, UNARY])
def test_the_readme_requests_verbatim(server, reference, model):
    """Its README's request, and its Llama page's (with pad_id / end_id), both decoding greedily, as
    TensorRT-LLM does with neither top_k nor top_p: the text is the prompt and transformers' greedy output."""
    body = {"text_input": PROMPT, "max_tokens": 20, "bad_words": "", "stop_words": ""}
    status, (answer,) = generate(server, model, body)
    assert status == 200, answer
    assert answer["model_name"] == model
    assert answer["text_output"] == PROMPT + greedy(reference, PROMPT, 20)
    eos = reference.tokenizer.eos_token_id
    status, (answer,) = generate(server, model, {**body, "pad_id": eos, "end_id": eos})
    assert status == 200 and answer["text_output"] == PROMPT + greedy(reference, PROMPT, 20)


def test_every_input_alone_and_all_together(server, reference):
    """Each input of the ensemble in `[1, 1]` shapes (word lists `[1, N]`; the embedding bias words and weights as
    the pair they must be), then all of them in one request."""
    each = {
        "num_return_sequences": 1,
        "bad_words": ["banana"],
        "stop_words": ["\n\n"],
        "exclude_input_in_output": True,
        "end_id": reference.tokenizer.eos_token_id,
        "pad_id": 0,
        "top_k": 2,
        "top_p": 0.9,
        "temperature": 0.5,
        "length_penalty": 1.0,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.1,
        "seed": 3,
        "return_log_probs": True,
        "return_context_logits": True,
        "return_generation_logits": True,
        "return_perf_metrics": False,
        "beam_width": 1,
        "stream": True,
        "lora_task_id": 0,
        "num_draft_tokens": 0,
        "use_draft_logits": False,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }
    base = {"text_input": PROMPT, "max_tokens": 4}
    bias = {"embedding_bias_words": ["learning"], "embedding_bias_weights": [-1.0]}
    for values in [{name: value} for name, value in each.items()] + [bias]:
        responses = grpc_stream(server, STREAMING, arrays(**base, **values))
        assert text_of(responses), values
    each.update(bias)
    responses = grpc_stream(server, STREAMING, arrays(**base, **each), outputs=("text_output", "output_log_probs"))
    assert 2 <= len(responses) <= 4  # streamed: one response per token; min_tokens 2, a stop word may end it
    assert all(r.as_numpy("output_log_probs").shape == (1, 1, 1) for r in responses)


def test_num_return_sequences_answers_each_with_its_sequence_index(server):
    values = arrays(text_input=PROMPT, max_tokens=6, num_return_sequences=2, top_k=50, temperature=1.0, seed=5)
    responses = grpc_stream(server, STREAMING, values, outputs=("text_output", "sequence_index"))
    assert sorted(int(r.as_numpy("sequence_index")[0][0]) for r in responses) == [0, 1]
    assert all(r.as_numpy("sequence_index").shape == (1, 1) for r in responses)


def test_a_batch_of_prompts_answers_each_with_its_batch_index(server, reference):
    prompts = ["The cat is", "I want you to", PROMPT]
    values = {
        "text_input": np.array([[p.encode()] for p in prompts], dtype=object),
        "max_tokens": np.array([[5]] * 3, np.int32),
        "exclude_input_in_output": np.array([[True]] * 3, bool),
    }
    responses = grpc_stream(server, STREAMING, values, outputs=("text_output", "batch_index"))
    by_index = {int(r.as_numpy("batch_index")[0][0]): r.as_numpy("text_output")[0].decode() for r in responses}
    assert by_index == {i: greedy(reference, p, 5) for i, p in enumerate(prompts)}


def test_log_probs_are_the_llm_models_logprobs(server):
    """output_log_probs and cum_log_probs equal what `llm` reports for the same greedy request."""
    values = arrays(text_input=PROMPT, max_tokens=6, return_log_probs=True, exclude_input_in_output=True)
    (response,) = grpc_stream(server, STREAMING, values, outputs=("text_output", "output_log_probs", "cum_log_probs"))
    status, (ours,) = generate(
        server,
        "llm",
        {
            "text_input": PROMPT,
            "sampling_parameters": json.dumps({"max_tokens": 6, "temperature": 0, "logprobs": 0}),
            "return_logprobs": True,
            "return_cumulative_logprob": True,
        },
    )
    assert status == 200
    expected = [next(iter(token.values()))["logprob"] for token in json.loads(ours["logprobs"])]
    assert response.as_numpy("output_log_probs").shape == (1, 1, 6)
    np.testing.assert_allclose(response.as_numpy("output_log_probs")[0][0], expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(response.as_numpy("cum_log_probs")[0], [ours["cumulative_logprob"]], atol=1e-5)


def test_bad_words_are_never_generated(server, reference):
    """The greedy answer's second word, banned: it does not appear, and the answer changes where it was."""
    plain = greedy(reference, PROMPT, 12)
    word = plain.split()[1]
    for model in (STREAMING, UNARY):
        status, (answer,) = generate(
            server,
            model,
            {"text_input": PROMPT, "max_tokens": 12, "bad_words": [word], "exclude_input_in_output": True},
        )
        assert status == 200, answer
        assert word not in answer["text_output"].split() and answer["text_output"] != plain


@pytest.mark.parametrize("model", [STREAMING, UNARY])
def test_unary_and_streaming_over_http_and_grpc(server, reference, model):
    """What each transaction policy serves: the decoupled `ensemble` streams over HTTP and gRPC and answers unary
    calls through generate; `tensorrt_llm_bls` (not decoupled) answers HTTP infer, generate and gRPC ModelInfer,
    and says why it refuses `stream: true`."""
    want = greedy(reference, PROMPT, 8)
    values = arrays(text_input=PROMPT, max_tokens=8, exclude_input_in_output=True)
    streamed = {**values, "stream": np.array([[True]])}
    assert text_of(grpc_stream(server, model, values)) == want
    status, (answer,) = generate(
        server, model, {"text_input": PROMPT, "max_tokens": 8, "exclude_input_in_output": True}
    )
    assert status == 200 and answer["text_output"] == want
    if model == STREAMING:
        chunks = grpc_stream(server, model, streamed)
        assert len(chunks) == 8 and text_of(chunks) == want
        status, events = generate(server, model, {"text_input": PROMPT, "max_tokens": 8, "stream": True}, stream=True)
        assert status == 200 and "".join(e["text_output"] for e in events) == want
        with pytest.raises(InferenceServerException, match="decoupled"):
            grpcclient.InferenceServerClient(server.grpc_url).infer(model, client_inputs(values))
        return
    result = grpcclient.InferenceServerClient(server.grpc_url).infer(model, client_inputs(values))
    assert result.as_numpy("text_output")[0].decode() == want
    http_client = httpclient.InferenceServerClient(f"{server.host}:{server.http_port}")
    assert http_client.infer(model, client_inputs(values, httpclient)).as_numpy("text_output")[0].decode() == want
    with pytest.raises(InferenceServerException, match="stream: true needs a decoupled model"):
        grpcclient.InferenceServerClient(server.grpc_url).infer(model, client_inputs(streamed))


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server):
    for body, message in (
        ({"text_input": PROMPT, "max_tokens": 4, "beam_width": 2}, "beam search is not supported"),
        ({"text_input": PROMPT}, "max_tokens is required"),
        ({"text_input": PROMPT, "max_tokens": 1500, "return_generation_logits": True}, "(max_logits_mb)"),
        ({"text_input": PROMPT, "max_tokens": 4, "lora_task_id": 5}, "lora_task_id 5: LoRA feature is not enabled."),
        ({"text_input": PROMPT, "max_tokens": 4, "embedding_bias_words": ["a"]}, "send both or neither"),
        ({"text_input": PROMPT, "max_tokens": 0}, "max_tokens must be between 1"),
    ):
        for model in (STREAMING, UNARY):
            status, (answer,) = generate(server, model, body)
            assert status == 400 and message in answer["error"], (model, body, answer)
    status, (answer,) = generate(server, UNARY, {"text_input": PROMPT, "max_tokens": 2})
    assert status == 200


def test_concurrent_unary_calls_share_the_engines_batches(server):
    """32 unary calls at once to the non-decoupled model: `llm` runs them in the same steps (its step-size
    histogram gains steps of more than 16 sequences), not one after another."""
    before = server.settled_metrics().get("llm_step_num_sequences_bucket", le="16")
    steps_before = server.settled_metrics().get("llm_step_num_sequences_count")
    client = httpclient.InferenceServerClient(f"{server.host}:{server.http_port}", concurrency=32)
    pending = []
    for i in range(32):
        values = arrays(text_input=f"Count from {i} to {i + 20}:", max_tokens=16, exclude_input_in_output=True)
        pending.append(client.async_infer(UNARY, client_inputs(values, httpclient)))
    texts = [p.get_result().as_numpy("text_output")[0] for p in pending]
    assert len(texts) == 32 and all(texts)
    m = server.settled_metrics()
    big_steps = (m.get("llm_step_num_sequences_count") - steps_before) - (
        m.get("llm_step_num_sequences_bucket", le="16") - before
    )
    assert big_steps >= 5, f"{big_steps:.0f} steps ran more than 16 of the 32 unary calls together"


def test_a_cancelled_stream_cancels_its_llm_request(server):
    """A client that cancels its stream mid-way: the forwarded `llm` request stops too (no KV block stays held)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got_one = threading.Event()
    client.start_stream(callback=lambda result, error: got_one.set())
    values = arrays(text_input=PROMPT, max_tokens=400, stream=True, min_tokens=400)
    client.async_stream_infer(STREAMING, client_inputs(values), request_id="c")
    assert got_one.wait(60)
    client.stop_stream(cancel_requests=True)
    client.close()
    server.wait_idle("llm", timeout_s=30)


@pytest.mark.parametrize("model", [STREAMING, UNARY])
def test_perf_metrics_time_the_request_and_count_reused_blocks(server, model):
    """The ten perf outputs, read off generate's JSON as TensorRT-LLM's CI reads them: times in order, and a second
    request with the same long prompt reuses its cached KV blocks."""
    prompt = f"{model}: " + " ".join(f"word{i}" for i in range(40))
    body = {"text_input": prompt, "max_tokens": 4, "return_perf_metrics": True}
    (first,), (second,) = generate(server, model, body)[1], generate(server, model, body)[1]
    for answer in (first, second):
        assert answer["arrival_time_ns"] <= answer["first_scheduled_time_ns"] <= answer["first_token_time_ns"]
        assert answer["first_token_time_ns"] <= answer["last_token_time_ns"]
        total, reused = answer["kv_cache_alloc_total_blocks"], answer["kv_cache_reused_blocks"]
        assert answer["kv_cache_alloc_new_blocks"] == total - reused and total > 0
        assert answer["acceptance_rate"] == 0.0 and answer["total_draft_tokens"] == 0  # `llm` does not speculate
    assert first["kv_cache_reused_blocks"] == 0 and second["kv_cache_reused_blocks"] >= 3
    if model == STREAMING:
        values = arrays(text_input=prompt, max_tokens=3, stream=True, return_perf_metrics=True)
        responses = grpc_stream(server, model, values, outputs=("text_output", "last_token_time_ns"))
        times = [int(r.as_numpy("last_token_time_ns")[0][0]) for r in responses]
        assert (
            len(times) == 3
            and times == sorted(times)
            and all(r.as_numpy("last_token_time_ns").shape == (1, 1) for r in responses)
        )


@pytest.mark.parametrize("model", [STREAMING, UNARY])
def test_context_and_generation_logits_are_the_models(server, reference, model):
    """return_context_logits / return_generation_logits: the logits of every prompt position and of each generated
    token, as transformers computes them in fp32, in TensorRT-LLM's shapes ([1, prompt, V] and [1, 1, tokens, V]);
    streamed, the context logits come once and each response carries its token's row."""
    values = arrays(text_input=PROMPT, max_tokens=3, return_context_logits=True, return_generation_logits=True)
    outputs = ("text_output", "context_logits", "generation_logits")
    if model == STREAMING:
        responses = grpc_stream(server, model, {**values, **arrays(stream=True)}, outputs=outputs)
        contexts = [r.as_numpy("context_logits") for r in responses if r.as_numpy("context_logits") is not None]
        assert len(contexts) == 1 and len(responses) == 3
        context, generation = contexts[0], np.concatenate([r.as_numpy("generation_logits") for r in responses], 2)
    else:
        requested = [grpcclient.InferRequestedOutput(n) for n in outputs]
        result = grpcclient.InferenceServerClient(server.grpc_url).infer(
            model, client_inputs(values), outputs=requested
        )
        context, generation = result.as_numpy("context_logits"), result.as_numpy("generation_logits")
    tokens = reference.get(PROMPT, 3).token_ids
    expected = reference.position_logits(PROMPT, tokens).numpy()
    num_prompt = len(reference.prompt_ids(PROMPT))
    assert context.shape == (1, num_prompt, expected.shape[1]) and context.dtype == np.float32
    assert generation.shape == (1, 1, 3, expected.shape[1])
    np.testing.assert_allclose(context[0], expected[:num_prompt], atol=2e-3, rtol=1e-4)
    np.testing.assert_allclose(generation[0, 0], expected[num_prompt - 1 : -1], atol=2e-3, rtol=1e-4)
    assert generation[0, 0].argmax(-1).tolist() == tokens
