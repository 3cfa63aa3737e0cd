"""LoRA adapters in the engine: requests name them (lora_name), rows of several adapters and of none share the
busy batch, the prefix cache keeps adapters apart, limits and lifecycles are enforced with clear errors."""

from __future__ import annotations

import json

import pytest

from backend import EngineConfig, LLMEngine
from backend.core.config import ConfigError
from backend.model.lora import AdapterError
from backend.protocol.values import InvalidRequest
from testkit.lora_adapters import greedy as greedy_continuation
from testkit.lora_adapters import make_adapter, reference_model
from tests.unit.engine_runs import PROMPTS, check_pool_empty, final, greedy, run

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def listing(tiny_llama, tmp_path_factory):
    """multi_lora.json (relative folders) of three adapters: ranks 8 and 16, attention or MLP or both."""
    root = tmp_path_factory.mktemp("loras")
    make_adapter(tiny_llama, root / "attn", rank=8, targets=("q_proj", "v_proj"), seed=1)
    make_adapter(tiny_llama, root / "mlp", rank=16, targets=("gate_proj", "down_proj"), seed=2)
    make_adapter(tiny_llama, root / "all", rank=8, targets=("q_proj", "k_proj", "o_proj", "up_proj"), seed=3)
    listing = root / "multi_lora.json"
    listing.write_text(json.dumps({"attn": "attn", "mlp": "mlp", "all": "all"}))
    return listing


@pytest.fixture(scope="module")
def references(tiny_llama, listing):
    return {name: reference_model(tiny_llama, listing.parent / name) for name in ("attn", "mlp", "all")}


def peft_greedy(model, prompt_ids: list[int]) -> list[int]:
    return greedy_continuation(model, prompt_ids, NEW_TOKENS)


def lora_engine(make_engine, listing, **overrides):
    return make_engine(enable_lora=True, lora_modules=str(listing), **overrides)


def test_three_adapters_and_the_base_model_interleaved_in_one_batch(
    make_engine, listing, references, hf_greedy, tiny_llama
):
    engine = lora_engine(make_engine, listing)
    names = ["attn", None, "mlp", "all"]
    requests = []
    for i, prompt in enumerate(PROMPTS[1:4] + PROMPTS[1:4]):
        name = names[i % len(names)]
        requests.append(engine.build_request(f"r{i}", prompt, greedy(NEW_TOKENS, ignore_eos=True), lora_name=name))
    outputs = run(engine, requests)
    outcomes = set()
    for request in requests:
        got = final(outputs[request.request_id]).samples[0].token_ids
        model = references.get(request.lora_name)
        want = (
            peft_greedy(model, request.prompt_token_ids)
            if model
            else hf_greedy(tiny_llama, request.prompt_token_ids, NEW_TOKENS, stop_at_eos=False)
        )
        assert got == want, request.lora_name
        outcomes.add((request.prompt, tuple(got)))
    assert len({o for o in outcomes}) > len(PROMPTS[1:4]), "the adapters must change what the model says"
    check_pool_empty(engine)
    assert all(engine.adapters.in_use(a) == 0 for a in engine.adapters._loaded.values())


def test_the_same_prompt_under_two_adapters_never_shares_cached_blocks(make_engine, listing, references):
    """The prefix cache keys blocks by adapter: the second adapter computes the prompt afresh (and gets its own
    output), the first one asked again reuses its own blocks."""
    engine = lora_engine(make_engine, listing)
    prompt = "Asked only here: " + PROMPTS[2]
    hits = []
    for i, name in enumerate(("attn", "mlp", "attn")):
        before = engine.block_manager.prefix_hits
        request = engine.build_request(f"p{i}", prompt, greedy(NEW_TOKENS, ignore_eos=True), lora_name=name)
        got = final(run(engine, [request])[f"p{i}"]).samples[0].token_ids
        assert got == peft_greedy(references[name], request.prompt_token_ids), name
        hits.append(engine.block_manager.prefix_hits - before)
    assert hits[0] == 0 and hits[1] == 0 and hits[2] > 0, hits
    check_pool_empty(engine)


def test_max_loras_keeps_other_adapters_waiting(make_engine, listing):
    engine = lora_engine(make_engine, listing, max_loras=1)
    requests = [
        engine.build_request(f"r{i}", PROMPTS[1], greedy(6, ignore_eos=True), lora_name=name)
        for i, name in enumerate(["attn", "mlp", "attn", None])
    ]
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
        running = {s.request.lora_name for s in engine.scheduler.running} - {None}
        assert len(running) <= 1
    check_pool_empty(engine)


def test_names_and_lifecycles_get_clear_errors(make_engine, listing, tmp_path):
    engine = lora_engine(make_engine, listing)
    with pytest.raises(
        InvalidRequest, match=r"LoRA nope is not supported, we currently support \['attn', 'mlp', 'all'\]"
    ):
        engine.build_request("x", "Hi", greedy(), lora_name="nope")
    assert engine.build_request("t", "Hi", greedy(), lora_task_id=2).lora_name == "mlp"  # TensorRT-LLM's numbering
    with pytest.raises(InvalidRequest, match=r"lora_task_id 9 names no loaded adapter; loaded: 1 \(attn\), 2 \(mlp\)"):
        engine.build_request("t", "Hi", greedy(), lora_task_id=9)
    request = engine.build_request("busy", "Hi", greedy(4), lora_name="mlp")
    engine.add_request(request)
    with pytest.raises(AdapterError, match="in use by 1 request"):
        engine.adapters.unload("mlp")
    run(engine, [])
    engine.adapters.unload("mlp")
    assert engine.adapters.names() == ["attn", "all"]
    with pytest.raises(AdapterError, match="cannot be found"):
        engine.adapters.unload("mlp")
    with pytest.raises(AdapterError, match="already been loaded"):
        engine.adapters.load("attn", str(listing.parent / "attn"))
    engine.adapters.load("mlp", str(listing.parent / "mlp"))  # back, under a new identity
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.adapters.load("bad", str(tmp_path))
    check_pool_empty(engine)
    plain = make_engine()
    with pytest.raises(InvalidRequest, match="LoRA feature is not enabled."):
        plain.build_request("x", "Hi", greedy(), lora_name="attn")


def test_an_adapter_unloaded_after_the_check_is_refused_at_admission(make_engine, listing):
    engine = lora_engine(make_engine, listing)
    request = engine.build_request("late", "Hi", greedy(4), lora_name="all")
    engine.adapters.unload("all")
    with pytest.raises(InvalidRequest, match="LoRA all is not supported"):
        engine.add_request(request)
    engine.adapters.load("all", str(listing.parent / "all"))


def test_configuration_errors(tiny_llama, listing, tmp_path):
    with pytest.raises(ConfigError, match="enable_lora is false"):
        EngineConfig(model=tiny_llama, lora_modules=str(listing)).validate()
    with pytest.raises(ConfigError, match="between 4 and 4096"):
        EngineConfig(model=tiny_llama, enable_lora=True, max_loras=4, max_cpu_loras=2).validate()
    bad = tmp_path / "multi_lora.json"
    bad.write_text(json.dumps({"x": "missing"}))
    with pytest.raises(ConfigError, match="parameter 'lora_modules': adapter 'x'.* is not a folder"):
        LLMEngine(
            EngineConfig(model=tiny_llama, dtype="float32", kv_cache_blocks=16, enable_lora=True, lora_modules=str(bad))
        )
    with pytest.raises(ConfigError, match="max_rank|above max_lora_rank 8"):
        LLMEngine(
            EngineConfig(
                model=tiny_llama,
                dtype="float32",
                kv_cache_blocks=16,
                enable_lora=True,
                lora_modules=str(listing),
                max_lora_rank=8,
            )
        )
    listed = EngineConfig.from_parameters({"model": tiny_llama, "enable_lora": "true"}, lora_listing=listing)
    assert listed.lora_modules == str(listing)
    assert EngineConfig.from_parameters({"model": tiny_llama}, lora_listing=listing).lora_modules == ""


def test_the_models_admin_requests_list_load_and_unload(make_engine, listing):
    """backend/serving/lora_admin.py: what the front door's routes ask of the Triton model."""
    from backend.protocol.wire import LORA_ADMIN_PARAMETER
    from backend.serving.lora_admin import admin_action, answer

    assert admin_action('{"stream": true}') is None
    action = admin_action(json.dumps({LORA_ADMIN_PARAMETER: json.dumps({"action": "list"})}))
    fixed = lora_engine(make_engine, listing)
    listed = json.loads(answer(fixed, action))
    assert listed["status"] == 200 and [a["name"] for a in listed["adapters"]] == fixed.adapters.names()
    refused = json.loads(answer(fixed, {"action": "unload", "lora_name": "attn"}))
    assert refused["status"] == 403 and "allow_runtime_lora_updating" in refused["message"]
    engine = lora_engine(make_engine, listing, allow_runtime_lora_updating=True)
    folder = str(listing.parent / "attn")
    loaded = json.loads(answer(engine, {"action": "load", "lora_name": "again", "lora_path": folder}))
    assert loaded["status"] == 200 and loaded["message"] == "Success: LoRA adapter 'again' added successfully."
    assert "again" in [a["name"] for a in loaded["adapters"]]
    assert json.loads(answer(engine, {"action": "load", "lora_name": "again", "lora_path": folder}))["status"] == 400
    assert json.loads(answer(engine, {"action": "load", "lora_name": "x"}))["status"] == 400
    assert json.loads(answer(engine, {"action": "unload", "lora_name": "again"}))["status"] == 200
    assert json.loads(answer(engine, {"action": "unload", "lora_name": "again"}))["status"] == 404
    assert json.loads(answer(engine, {"action": "drop"}))["status"] == 400
