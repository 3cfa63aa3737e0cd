"""The metrics under vLLM's and TensorRT-LLM's names (metric_names' default): after N requests, every counter and
histogram count has moved by exactly what those requests produced, read at once after the last response (no wait
for the 100 ms publishing thread)."""

from __future__ import annotations

import http.client
import json
import time

MODEL = "llm"


def generate(server, model: str, body: dict) -> dict:
    conn = http.client.HTTPConnection(server.host, server.http_port, timeout=120)
    conn.request("POST", f"/v2/models/{model}/generate", body=json.dumps(body))
    response = conn.getresponse()
    answer = json.loads(response.read().decode())
    assert response.status == 200, answer
    return answer


def test_counters_and_histograms_count_each_request_by_its_last_response(server):
    server.wait_idle(MODEL)
    before = server.metrics()
    requests = [("The capital of France is", 3, 1), ("Once upon a time", 5, 2), ("1, 2, 3,", 4, 1)]
    prompt_tokens = generated = samples = 0
    for prompt, max_tokens, n in requests:
        answer = generate(
            server,
            MODEL,
            {
                "text_input": prompt,
                "sampling_parameters": json.dumps(
                    {"max_tokens": max_tokens, "n": n, "temperature": 0, "ignore_eos": True}
                ),
                "return_num_input_tokens": True,
            },
        )
        prompt_tokens += answer["num_input_tokens"]
        generated += max_tokens * n
        samples += n
    # One request through TensorRT-LLM's model: counted on `llm`, which served it.
    answer = generate(
        server,
        "tensorrt_llm_bls",
        {"text_input": "Hello", "max_tokens": 2, "end_id": 0, "return_num_input_tokens": True},
    )
    prompt_tokens += answer["num_input_tokens"]
    generated, samples, count = generated + 2, samples + 1, len(requests) + 1
    after = server.metrics()  # at once: no settling

    def moved(name: str, **labels) -> float:
        return after.get(name, MODEL, **labels) - before.get(name, MODEL, **labels)

    assert moved("vllm:prompt_tokens_total") == prompt_tokens
    assert moved("vllm:generation_tokens_total") == generated
    assert moved("vllm:request_success_total", finished_reason="length") == count
    assert moved("vllm:request_prompt_tokens_count") == count
    assert moved("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert moved("vllm:request_generation_tokens_count") == count
    assert moved("vllm:request_generation_tokens_sum") == generated
    assert moved("vllm:request_params_n_count") == count
    assert moved("vllm:request_params_n_sum") == samples
    assert moved("vllm:e2e_request_latency_seconds_count") == count
    assert moved("vllm:time_to_first_token_seconds_count") == samples
    assert moved("vllm:time_per_output_token_seconds_count") == generated - samples  # one per token after the first
    assert moved("nv_llm_input_token_len_count", response_metric_type="total_input_tokens") == count
    assert moved("nv_llm_output_token_len_sum", response_metric_type="total_output_tokens") == generated
    # the same numbers as ours
    assert moved("llm_generation_tokens_total") == generated
    assert after.get("vllm:num_requests_running", MODEL) == after.get("llm_requests_running", MODEL)
    assert after.get("vllm:kv_cache_usage_perc", MODEL) == after.get("llm_kv_cache_usage_ratio", MODEL)
    blocks = after.get("nv_trt_llm_kv_cache_block_metrics", MODEL, kv_cache_block_type="max")
    assert blocks == after.get("llm_kv_cache_blocks_total", MODEL) > 0
    assert after.get("nv_trt_llm_request_metrics", MODEL, request_type="max") == 32
    # TensorRT-LLM's per-iteration gauges, once the last step's updates are published
    settled = server.settled_metrics(MODEL)
    steps = settled.get("nv_trt_llm_general_metrics", MODEL, general_type="iteration_counter")
    assert steps == settled.get("llm_engine_steps_total", MODEL) > 0
    assert abs(settled.get("nv_trt_llm_general_metrics", MODEL, general_type="timestamp") - time.time()) < 600
    # the last step (the BLS request's second token) generated for one sequence and prefilled nothing
    batcher = {
        kind: settled.get("nv_trt_llm_inflight_batcher_metrics", MODEL, inflight_batcher_specific_metric=kind)
        for kind in ("generation_requests", "total_context_tokens")
    }
    assert batcher == {"generation_requests": 1, "total_context_tokens": 0}
