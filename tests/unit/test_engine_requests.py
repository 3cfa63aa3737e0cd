"""backend/engine/llm_engine.py's handling of requests on a tiny random Llama: cancellation and abort, validation
(lengths, pool size, bad parameters, duplicate ids), injected faults, metrics and block accounting."""

from __future__ import annotations

import pytest

from backend import EngineConfig, InvalidRequest, SamplingParams
from backend.core.fault_injection import InjectedFault
from backend.core.request import FinishReason
from tests.unit.engine_runs import PROMPTS, check_pool_empty, final, greedy, run

# ----------------------------------------------------------------------------------- cancel and abort


def test_cancellation_mid_generation(make_engine):
    """A request aborted (the loop's message when the output sender finds its client gone) leaves the batch at the
    next step."""
    engine = make_engine()
    request = engine.build_request(
        "cx", PROMPTS[1], SamplingParams(n=2, seed=1, max_tokens=50, ignore_eos=True), stream=True
    )
    other = engine.build_request("keep", PROMPTS[0], greedy(8))
    seen: dict[str, list] = {}
    engine.add_request(request)
    engine.add_request(other)
    for step in range(200):
        if step == 4:
            engine.abort_requests([request.key])
        for output in engine.step():
            seen.setdefault(output.request_id, []).append(output)
        if not engine.has_work():
            break
    out = final(seen["cx"])
    assert out.finished
    reasons = {s.sample_index: s.finish_reason for o in seen["cx"] for s in o.samples if s.finish_reason}
    assert reasons == {0: FinishReason.ABORT, 1: FinishReason.ABORT}
    produced = sum(len(s.token_ids) for o in seen["cx"] for s in o.samples)
    assert 0 < produced < 100
    assert final(seen["keep"]).samples[0].num_output_tokens == 8  # the other request is unaffected
    check_pool_empty(engine)


def test_cancellation_before_admission(make_engine):
    engine = make_engine()
    request = engine.build_request("early", PROMPTS[2], greedy(8, n=2))
    engine.add_request(request)
    engine.abort_requests([request.key])  # before its first step
    out = final(run(engine, [])["early"])
    assert out.finished and [s.finish_reason for s in out.samples] == [FinishReason.ABORT] * 2
    assert all(s.token_ids == [] for s in out.samples)
    check_pool_empty(engine)


def test_abort(make_engine):
    engine = make_engine()
    request = engine.build_request("ab", PROMPTS[2], greedy(40, n=2))
    engine.add_request(request)
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    out = engine.abort("ab")
    assert out.finished and all(s.finish_reason == FinishReason.ABORT for s in out.samples)
    assert engine.abort("ab") is None and engine.abort("never-seen") is None
    assert not engine.has_work()
    check_pool_empty(engine)
    assert engine.metrics.counters["llm_requests_finished_total"][(("finish_reason", "abort"),)] >= 1


# ----------------------------------------------------------------------------------------- validation


def test_prompt_plus_max_tokens_over_the_model_length(make_engine):
    engine = make_engine()
    prompt_len = len(engine.input_tokenizer(PROMPTS[1]).input_ids)
    with pytest.raises(InvalidRequest, match="max_tokens") as info:
        engine.build_request("long", PROMPTS[1], greedy(512 - prompt_len + 1))
    assert "512" in str(info.value)
    engine.build_request("fits", PROMPTS[1], greedy(512 - prompt_len))  # exactly at the limit is fine


def test_max_model_len_setting(make_engine):
    engine = make_engine(max_model_len=32)
    assert engine.max_model_len == 32
    with pytest.raises(InvalidRequest, match="32"):
        engine.build_request("x", PROMPTS[1], greedy(30))
    capped = make_engine(max_model_len=100_000)
    assert capped.max_model_len == 512  # never above the model's own limit


def test_request_that_can_never_fit_the_pool(make_engine):
    engine = make_engine(kv_cache_blocks=8)  # 32 tokens
    with pytest.raises(InvalidRequest, match="KV cache"):
        engine.build_request("big", PROMPTS[1], greedy(40))


@pytest.mark.parametrize(
    "prompt, params, fragment",
    [
        ("", greedy(), "text_input"),
        ("ok", greedy(stop_token_ids=[49152]), "stop_token_ids"),
        ("ok", greedy(stop_token_ids=[-1]), "stop_token_ids"),
        ("ok", greedy(top_k=10**6), "top_k must be at most the vocabulary size"),
    ],
)
def test_bad_requests(make_engine, prompt, params, fragment):
    engine = make_engine()
    with pytest.raises(InvalidRequest, match=fragment):
        engine.build_request("bad", prompt, params)


def test_prompt_bound_is_checked_before_tokenizing(make_engine, monkeypatch):
    engine = make_engine(max_model_len=64)
    assert engine.max_prompt_bytes == 16 * 64  # the default: 16 bytes per token of max_model_len
    monkeypatch.setattr(engine, "input_tokenizer", None)  # tokenizing would raise AttributeError
    with pytest.raises(InvalidRequest, match="text_input is 1025 bytes of UTF-8; at most 1024 are allowed"):
        engine.build_request("huge", "a" * 1025, greedy())
    with pytest.raises(InvalidRequest, match="text_input is 1026 bytes"):  # bytes, not characters
        engine.build_request("huge", "\u00e9" * 513, greedy())
    assert make_engine(max_prompt_bytes=100).max_prompt_bytes == 100


def test_step_error_fault_fails_only_that_steps_requests(make_engine, tiny_llama, hf_greedy):
    engine = make_engine(fault_injection="step_error:BOOM", max_num_seqs=1)
    bad = engine.build_request("bad", "BOOM " + PROMPTS[0], greedy(4))
    good = engine.build_request("good", PROMPTS[1], greedy(6))
    outputs = run(engine, [bad, good])  # max_num_seqs=1: the bad request's step holds it alone
    assert final(outputs["bad"]).error.startswith("internal error while generating: injected step_error")
    assert final(outputs["good"]).error is None
    assert final(outputs["good"]).samples[0].token_ids == hf_greedy(tiny_llama, good.prompt_token_ids, 6)
    check_pool_empty(engine)


def test_engine_death_fault_escapes_the_step(make_engine):
    engine = make_engine(fault_injection="engine_death:DIE")
    engine.add_request(engine.build_request("die", "DIE now", greedy(4)))
    with pytest.raises(InjectedFault, match="engine_death"):
        engine.step()
    engine.abort("die")


def test_duplicate_request_id(make_engine):
    engine = make_engine()
    engine.add_request(engine.build_request("dup", PROMPTS[0], greedy(3)))
    with pytest.raises(InvalidRequest, match="dup"):
        engine.add_request(engine.build_request("dup", PROMPTS[1], greedy(3)))
    run(engine, [])
    check_pool_empty(engine)


def test_metrics_after_a_run(make_engine):
    engine = make_engine()
    metrics = engine.metrics
    prompt_before = metrics.total("llm_prompt_tokens_total")
    gen_before = metrics.total("llm_generation_tokens_total")
    finished_before = metrics.total("llm_requests_finished_total")
    intervals_before = len(metrics.histograms["llm_inter_token_latency_seconds"])
    requests = [engine.build_request(f"m{i}", p, greedy(6, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
    run(engine, requests)
    assert metrics.total("llm_prompt_tokens_total") - prompt_before == sum(len(r.prompt_token_ids) for r in requests)
    assert metrics.total("llm_generation_tokens_total") - gen_before == 18
    assert metrics.total("llm_requests_finished_total") - finished_before == 3
    assert metrics.gauges["llm_kv_cache_blocks_total"] == 256
    assert metrics.gauges["llm_kv_cache_blocks_used"] == 0
    assert metrics.gauges["llm_requests_running"] == 0 and metrics.gauges["llm_requests_waiting"] == 0
    assert metrics.gauges["llm_kv_cache_blocks_free"] == 256
    assert len(metrics.histograms["llm_time_to_first_token_seconds"]) >= 3
    intervals = metrics.histograms["llm_inter_token_latency_seconds"][intervals_before:]
    assert len(intervals) == 3 * 5 and all(v >= 0 for v in intervals)  # 6 tokens: 5 gaps per request


def test_n_above_max_num_seqs_is_refused_or_served(make_engine, tiny_llama):
    try:
        EngineConfig.from_parameters({"model": tiny_llama, "max_num_seqs": "2", "max_n": "8"})
    except Exception:
        return  # refused at configuration time: fine
    engine = make_engine(max_num_seqs=2)
    try:
        request = engine.build_request("wide", PROMPTS[0], SamplingParams(n=3, max_tokens=2))
    except InvalidRequest:
        return  # refused at admission: fine
    engine.add_request(request)
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
    finished = not engine.has_work()
    engine.abort("wide")
    assert finished, "the request never ran"
