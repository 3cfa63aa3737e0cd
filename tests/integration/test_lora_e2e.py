"""Multi-LoRA through Triton: three PEFT adapters made at session start on the default model (ranks 8 and 16,
attention or MLP projections; testkit/server_variants.py) served by `llm_default` beside its base model. Requests
name one by `lora_name` in `sampling_parameters`, as vllm_backend's clients do; requests of every adapter and of
none run interleaved in one busy batch, and each one's greedy output equals transformers + PEFT in float32 up to
counted near-ties (the base weights are the GGUF's blocks on our kernel: the fp32 model up to summation order).
Twice: the second wave meets the first wave's cached prompt blocks, each adapter only its own."""

import functools
import threading

import pytest
import torch

from client import ServerError, generate_grpc, generate_http, stream_grpc
from launcher.paths import MODEL_DIR
from testkit import fidelity
from testkit.concurrency import raise_first_error, run_concurrently
from testkit.hf_reference import HFReference
from testkit.lora_adapters import greedy, reference_model
from testkit.prometheus import samples
from testkit.server_variants import LORA_ADAPTERS, LORA_MODEL
from tests.integration.llm_testlib import post, top_logprobs

pytestmark = pytest.mark.integration

PROMPTS = [("The capital of France is", 16), ("Write a haiku about the sea.", 12)]
NAMES = [*LORA_ADAPTERS, None]  # None: the base model


_PEFT_MODELS: dict = {}


def peft_model(server, name):
    """transformers + PEFT for adapter `name` (loaded once per session)."""
    if name not in _PEFT_MODELS:
        folder = server.variants[LORA_MODEL]["lora_modules"].rsplit("/", 1)[0]
        _PEFT_MODELS[name] = reference_model(MODEL_DIR, f"{folder}/{name}")
    return _PEFT_MODELS[name]


def peft_verdict(model, prompt_ids, got) -> fidelity.Verdict:
    """fidelity.judge against `model` (transformers + PEFT, float32) on `got`, a Completion with logprobs."""
    want = greedy(model, prompt_ids, len(got.token_ids))
    with torch.no_grad():
        position = fidelity.first_difference(got.token_ids, want)
        logits = None
        if position is not None:
            logits = model(input_ids=torch.tensor([prompt_ids + want[:position]])).logits[0, -1]
    top = top_logprobs(got, fidelity.TOP_K)
    return fidelity.judge(got.token_ids, want, top[position] if position is not None else {}, logits)


def test_adapters_and_the_base_model_interleaved_follow_transformers_and_peft(server):
    server.wait_idle(LORA_MODEL)
    base = HFReference(MODEL_DIR, torch.float32)
    cases = [(prompt, tokens, name) for prompt, tokens in PROMPTS for name in NAMES]

    def one(prompt, max_tokens, name):
        sampling = {"logprobs": fidelity.TOP_K, "ignore_eos": True, **({"lora_name": name} if name else {})}
        return stream_grpc(
            prompt,
            server.grpc_url,
            LORA_MODEL,
            max_tokens=max_tokens,
            temperature=0.0,
            sampling=sampling,
            return_logprobs=True,
        ).completion()

    waves = []
    for _ in range(2):
        completions = run_concurrently(one, cases)
        raise_first_error(completions, "gRPC stream")
        waves.append([c.token_ids for c in completions])
        verdicts = []
        for (prompt, tokens, name), got in zip(cases, completions):
            assert len(got.token_ids) == tokens
            prompt_ids = base.prompt_ids(prompt)
            if name is None:
                want = base.greedy(prompt, tokens, stop_at_eos=False)
                verdicts.append(base.judge(prompt, got.token_ids, want, top_logprobs(got, fidelity.TOP_K)))
            else:
                verdicts.append(peft_verdict(peft_model(server, name), prompt_ids, got))
        print(f"\n[{LORA_MODEL} with adapters {list(LORA_ADAPTERS)}] {fidelity.summarize(verdicts)}")
        assert all(v.near_tie for v in verdicts), [v.detail for v in verdicts if not v.near_tie]
    assert waves[0] == waves[1]
    for index in range(len(PROMPTS)):  # each adapter says something of its own
        outputs = [tuple(t) for (p, _, _), t in zip(cases, waves[0]) if p == PROMPTS[index][0]]
        assert len(set(outputs)) == len(NAMES)
    server.wait_idle(LORA_MODEL)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_an_unknown_adapter_gets_vllm_backends_error_and_the_server_keeps_serving(server, transport):
    send = generate_http if transport == "http" else functools.partial(generate_grpc, stream=False)
    url = server.http_url if transport == "http" else server.grpc_url
    with pytest.raises(ServerError) as info:
        send("Hi", url, LORA_MODEL, max_tokens=4, sampling={"lora_name": "nope"})
    assert f"LoRA nope is not supported, we currently support {list(LORA_ADAPTERS)}" in str(info.value)
    with pytest.raises(ServerError, match="LoRA feature is not enabled."):
        send("Hi", url, "llm", max_tokens=4, sampling={"lora_name": "alpha"})
    assert len(send("Hi", url, LORA_MODEL, max_tokens=4, sampling={"lora_name": "beta"}).token_ids) == 4
    server.wait_idle(LORA_MODEL)


def test_the_gateway_reads_which_adapters_run(server):
    """vllm:lora_requests_info, as vLLM exports it: the inference gateway's LoRA-affinity routing reads it."""
    server.wait_idle(LORA_MODEL)
    metrics = server.settled_metrics(LORA_MODEL)
    series = {
        labels: value
        for (name, labels), value in metrics.values.items()
        if name == "vllm:lora_requests_info" and ("model", LORA_MODEL) in labels
    }
    assert series and all(value > 1.7e9 for value in series.values())  # each label set's last time, Unix seconds
    newest = dict(max(series, key=series.get))  # what the gateway reads: the newest series
    assert newest["max_lora"] == "4" and newest["running_lora_adapters"] == newest["waiting_lora_adapters"] == ""
    ours = samples(metrics.values, "llm_lora_requests_info", model=LORA_MODEL, running_lora_adapters="")
    assert max(ours) == max(series.values())


def test_the_front_door_lists_adapters_and_loads_one_under_load_without_a_failed_request(server):
    """vLLM's OpenAI server's way: each adapter is a model (its base as `parent`) that `model` names; an adapter
    added by /v1/load_lora_adapter while streams of other adapters run serves at once, and after
    /v1/unload_lora_adapter its name is unknown again."""
    status, listing = post(server, "/v1/models", None, method="GET")
    assert status == 200
    parents = {card["id"]: card.get("parent") for card in listing["data"]}
    assert all(parents[name] == LORA_MODEL for name in LORA_ADAPTERS) and parents[LORA_MODEL] is None

    def chat(model, max_tokens=12):
        body = {"model": model, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": max_tokens}
        return post(server, "/v1/chat/completions", {**body, "temperature": 0})

    status, beta = chat("beta")
    assert status == 200 and beta["model"] == "beta"
    folder = server.variants[LORA_MODEL]["lora_modules"].rsplit("/", 1)[0]
    background = [("alpha", 24), ("gamma", 24), (LORA_MODEL, 24), ("beta", 24)] * 2

    def busy():
        return run_concurrently(lambda model, tokens: chat(model, tokens), background)

    results = {}
    worker = threading.Thread(target=lambda: results.update(done=busy()))
    worker.start()
    status, text = post(server, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": f"{folder}/beta"})
    assert status == 200 and text == "Success: LoRA adapter 'delta' added successfully.", text
    status, delta = chat("delta")
    worker.join(timeout=300)
    assert all(s == 200 for s, _ in results["done"]), [body for s, body in results["done"] if s != 200][:2]
    assert status == 200 and delta["choices"][0]["message"] == beta["choices"][0]["message"]  # beta's weights
    status, again = post(server, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": f"{folder}/beta"})
    assert status == 400 and "already been loaded" in again["error"]["message"]
    status, text = post(server, "/v1/unload_lora_adapter", {"lora_name": "delta"})
    assert status == 200 and "removed successfully" in text
    status, gone = chat("delta")
    assert status == 404 and gone["error"]["code"] == "model_not_found"
    status, bad = post(server, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": folder})
    assert status == 400 and "no adapter_config.json" in bad["error"]["message"]
    assert chat(LORA_MODEL)[0] == 200  # and it keeps serving
    server.wait_idle(LORA_MODEL)
