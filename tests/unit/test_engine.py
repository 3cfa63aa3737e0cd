"""backend/engine/llm_engine.py end to end on a tiny random Llama (real SmolLM2 tokenizer): greedy outputs equal Hugging
Face `generate` under chunked prefill, batching, preemption and prefix caching; streaming, parallel seeded
samples, stop rules and speculative decoding."""

from __future__ import annotations

import pytest

from backend import SamplingParams
from backend.core.request import FinishReason, Request, Sequence
from tests.unit.engine_runs import PROMPTS, check_pool_empty, final, greedy, run

# ------------------------------------------------------------------------------------------ correctness


def test_greedy_batch_with_chunked_prefill_matches_hf(make_engine, tiny_llama, hf_greedy):
    engine = make_engine(max_num_batched_tokens=16)
    lengths = [12, 5, 20, 9, 15]
    requests = [engine.build_request(f"r{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    assert max(len(r.prompt_token_ids) for r in requests) > 16  # the long prompt is chunked
    steps_before = engine.metrics.total("llm_engine_steps_total")
    results = run(engine, requests)
    for request, n in zip(requests, lengths):
        out = final(results[request.request_id])
        assert out.finished and out.error is None and len(out.samples) == 1
        sample = out.samples[0]
        expected = hf_greedy(tiny_llama, request.prompt_token_ids, n)
        assert sample.token_ids == expected, request.prompt
        assert sample.num_output_tokens == len(expected)
        assert sample.finish_reason == (FinishReason.STOP if expected[-1] == 2 else FinishReason.LENGTH)
        assert sample.text == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert out.num_input_tokens == len(request.prompt_token_ids)
        assert out.key == request.key  # it names its request; it does not carry it across threads
        assert not any(isinstance(value, (Request, Sequence)) for value in vars(out).values())
    assert max(engine.metrics.histograms["llm_step_num_tokens"]) <= 16
    assert engine.metrics.total("llm_engine_steps_total") > steps_before
    check_pool_empty(engine)


def test_requests_joining_a_running_batch(make_engine, tiny_llama, hf_greedy):
    engine = make_engine(max_num_batched_tokens=16)
    first = engine.build_request("first", PROMPTS[2], greedy(10))
    engine.add_request(first)
    outputs = {}
    for _ in range(3):  # first is mid-prefill or decoding when the others arrive
        for out in engine.step():
            outputs[out.request_id] = out
    late = [engine.build_request(f"late{i}", p, greedy(6)) for i, p in enumerate(PROMPTS[:2])]
    for request in late:
        engine.add_request(request)
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] = out
    for request in [first] + late:
        expected = hf_greedy(tiny_llama, request.prompt_token_ids, request.params.max_tokens)
        assert outputs[request.request_id].samples[0].token_ids == expected
    check_pool_empty(engine)


def test_streaming_deltas_concatenate_to_the_full_text(make_engine):
    engine = make_engine()
    plain = [engine.build_request(f"p{i}", p, greedy(14)) for i, p in enumerate(PROMPTS)]
    full = run(engine, plain)
    streamed_requests = [engine.build_request(f"s{i}", p, greedy(14), stream=True) for i, p in enumerate(PROMPTS)]
    streamed = run(engine, streamed_requests)
    for i in range(len(PROMPTS)):
        whole = final(full[f"p{i}"]).samples[0]
        chunks = streamed[f"s{i}"]
        assert len(chunks) > 1
        text = "".join(s.text for o in chunks for s in o.samples)
        ids = [t for o in chunks for s in o.samples for t in s.token_ids]
        assert text == whole.text and ids == whole.token_ids
        reasons = [s.finish_reason for o in chunks for s in o.samples]
        assert reasons[-1] == whole.finish_reason and all(r is None for r in reasons[:-1])
        counts = [s.num_output_tokens for o in chunks for s in o.samples]
        assert counts == sorted(counts) and counts[-1] == len(whole.token_ids)
    check_pool_empty(engine)


def test_parallel_seeded_samples(make_engine):
    engine = make_engine()
    params = SamplingParams(n=3, seed=77, temperature=1.0, max_tokens=10)

    def sample_texts(extra_requests=()):
        request = engine.build_request("n3", PROMPTS[1], params)
        others = [
            engine.build_request(f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=7))
            for i, p in enumerate(extra_requests)
        ]
        out = final(run(engine, [request] + others)["n3"])
        assert [s.sample_index for s in out.samples] == [0, 1, 2]
        return [(tuple(s.token_ids), s.text) for s in out.samples]

    first = sample_texts()
    assert len(first) == 3 and all(len(ids) == 10 for ids, _ in first)
    assert len({ids for ids, _ in first}) == 3  # the samples differ
    assert sample_texts() == first  # reproducible across runs
    assert sample_texts(PROMPTS[2:]) == first  # and whatever shares the batch
    check_pool_empty(engine)


def test_parallel_greedy_samples_agree_and_share_the_prompt(make_engine, tiny_llama, hf_greedy):
    engine = make_engine()
    request = engine.build_request("g3", "A prompt for three greedy samples: " + PROMPTS[2], greedy(6, n=3))
    step_tokens = engine.metrics.histograms["llm_step_num_tokens"]
    before = len(step_tokens)
    out = final(run(engine, [request])["g3"])
    expected = hf_greedy(tiny_llama, request.prompt_token_ids, 6)
    assert [s.token_ids for s in out.samples] == [expected] * 3
    # the prompt's KV was computed once (sample 0), then each sample decoded its own 5 more tokens
    assert sum(step_tokens[before:]) == len(request.prompt_token_ids) + 3 * 5
    check_pool_empty(engine)


def test_unseeded_samples_vary(make_engine):
    engine = make_engine()
    params = SamplingParams(temperature=1.0, max_tokens=8)
    a = final(run(engine, [engine.build_request("u1", PROMPTS[0], params)])["u1"]).samples[0].token_ids
    b = final(run(engine, [engine.build_request("u2", PROMPTS[0], params)])["u2"]).samples[0].token_ids
    assert a != b


def test_preemption_with_a_small_pool_keeps_outputs_exact(make_engine, tiny_llama, hf_greedy):
    # 28 blocks of 4 tokens; 4 requests needing up to ~10 blocks each at the end
    engine = make_engine(kv_cache_blocks=28, max_num_batched_tokens=32)
    before = engine.scheduler.num_preemptions
    requests = [engine.build_request(f"q{i}", p, greedy(24)) for i, p in enumerate(PROMPTS[1:])]
    results = run(engine, requests)
    assert engine.scheduler.num_preemptions > before
    assert engine.metrics.total("llm_requests_preempted_total") > 0
    for request in requests:
        sample = final(results[request.request_id]).samples[0]
        assert sample.token_ids == hf_greedy(tiny_llama, request.prompt_token_ids, 24)
    check_pool_empty(engine)


def test_preemption_of_parallel_samples(make_engine):
    engine = make_engine(kv_cache_blocks=14, max_num_batched_tokens=32)
    params = SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=20, ignore_eos=True)
    before = engine.scheduler.num_preemptions
    small = final(run(engine, [engine.build_request("small", PROMPTS[1], params)])["small"])
    assert engine.scheduler.num_preemptions > before
    roomy = make_engine(kv_cache_blocks=256)
    big = final(run(roomy, [roomy.build_request("big", PROMPTS[1], params)])["big"])
    assert [s.token_ids for s in small.samples] == [s.token_ids for s in big.samples]
    assert all(s.num_output_tokens == 20 for s in small.samples)
    check_pool_empty(engine)


def test_prefix_cache_reuse_gives_the_same_output(make_engine):
    engine = make_engine()
    hits = engine.block_manager.prefix_hits
    first = final(run(engine, [engine.build_request("c1", PROMPTS[2], greedy(8))])["c1"]).samples[0]
    assert engine.block_manager.num_cached_free_blocks > 0
    second = final(run(engine, [engine.build_request("c2", PROMPTS[2], greedy(8))])["c2"]).samples[0]
    assert engine.block_manager.prefix_hits > hits
    assert second.token_ids == first.token_ids
    assert engine.metrics.total("llm_prefix_cache_hits_total") >= engine.block_manager.prefix_hits - hits
    check_pool_empty(engine)


def test_prefix_caching_off_gives_the_same_output(make_engine):
    on = make_engine()
    off = make_engine(enable_prefix_caching=False)
    prompt = PROMPTS[2]
    a = [final(run(on, [on.build_request(f"on{i}", prompt, greedy(8))])[f"on{i}"]) for i in range(2)]
    b = [final(run(off, [off.build_request(f"off{i}", prompt, greedy(8))])[f"off{i}"]) for i in range(2)]
    assert {tuple(o.samples[0].token_ids) for o in a + b} == {tuple(a[0].samples[0].token_ids)}
    assert off.block_manager.prefix_hits == 0


# ------------------------------------------------------------------------------------------ stop rules


def test_stop_string_across_tokens(make_engine):
    engine = make_engine()
    base = final(run(engine, [engine.build_request("base", PROMPTS[1], greedy(16))])["base"]).samples[0]
    pieces = [engine.tokenizer.decode([t]) for t in base.token_ids]
    # a stop string made of the end of one token's text and the start of the next one's
    index = next(
        i
        for i in range(1, len(pieces) - 1)
        if len(pieces[i]) >= 2 and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1]
    )
    stop = pieces[index][-2:] + pieces[index + 1][:1]
    cut = base.text.index(stop)
    for stream in (False, True):
        request = engine.build_request(f"stop{stream}", PROMPTS[1], greedy(16, stop=[stop]), stream=stream)
        outputs = run(engine, [request])[request.request_id]
        deltas = [s.text for o in outputs for s in o.samples]
        text = "".join(deltas)
        assert text == base.text[:cut]
        for i in range(len(deltas)):
            assert stop not in "".join(deltas[: i + 1])
        last = outputs[-1].samples[-1]
        assert last.finish_reason == FinishReason.STOP
        assert last.num_output_tokens <= index + 2
    request = engine.build_request("incl", PROMPTS[1], greedy(16, stop=[stop], include_stop_str_in_output=True))
    text = final(run(engine, [request])["incl"]).samples[0].text
    assert text == base.text[: cut + len(stop)]
    check_pool_empty(engine)


def test_stop_token_ids(make_engine):
    engine = make_engine()
    base = final(run(engine, [engine.build_request("b", PROMPTS[3], greedy(12))])["b"]).samples[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = final(run(engine, [engine.build_request("s", PROMPTS[3], greedy(12, stop_token_ids=[stop_id]))])["s"])
    sample = out.samples[0]
    assert sample.token_ids == base.token_ids[: first + 1]
    assert sample.finish_reason == FinishReason.STOP


def test_max_tokens_one(make_engine, tiny_llama, hf_greedy):
    engine = make_engine()
    request = engine.build_request("one", PROMPTS[0], greedy(1))
    sample = final(run(engine, [request])["one"]).samples[0]
    assert sample.token_ids == hf_greedy(tiny_llama, request.prompt_token_ids, 1)
    assert sample.finish_reason == FinishReason.LENGTH


def test_logprobs(make_engine):
    engine = make_engine()
    request = engine.build_request("lp", PROMPTS[1], greedy(5, logprobs=3))
    sample = final(run(engine, [request])["lp"]).samples[0]
    assert len(sample.logprobs) == 5
    for token_id, entry in zip(sample.token_ids, sample.logprobs):
        assert entry["token_id"] == token_id
        assert len(entry["top_logprobs"]) == 3
        best = max(entry["top_logprobs"].items(), key=lambda kv: kv[1])
        assert best[0] == token_id and best[1] == pytest.approx(entry["logprob"])  # greedy: the top token
        assert entry["rank"] == 1
        assert entry["logprob"] <= 0
    plain = final(run(engine, [engine.build_request("nolp", PROMPTS[1], greedy(5))])["nolp"]).samples[0]
    assert plain.logprobs is None


def test_logprobs_of_a_batch_with_different_counts(make_engine):
    """A step computes the logprobs of its rows together (one op per distinct count): each sequence still gets its
    own token's entries, with its own number of alternatives, as when it runs alone."""
    engine = make_engine()
    counts = [None, 0, 2, 4, 2]
    requests = [
        engine.build_request(f"m{i}", PROMPTS[i % len(PROMPTS)], greedy(4, logprobs=k)) for i, k in enumerate(counts)
    ]
    together = run(engine, requests)
    for i, count in enumerate(counts):
        sample = final(together[f"m{i}"]).samples[0]
        alone = final(
            run(engine, [engine.build_request("alone", PROMPTS[i % len(PROMPTS)], greedy(4, logprobs=count))])["alone"]
        ).samples[0]
        assert sample.token_ids == alone.token_ids
        if count is None:
            assert sample.logprobs is None
            continue
        for entry, solo in zip(sample.logprobs, alone.logprobs, strict=True):
            assert entry["logprob"] == pytest.approx(solo["logprob"], abs=1e-5) and entry["rank"] == solo["rank"]
            assert len(entry.get("top_logprobs", {})) == count
            assert entry.get("top_logprobs", {}).keys() == solo.get("top_logprobs", {}).keys()


def test_min_tokens_and_ignore_eos_reach_max_tokens(make_engine):
    engine = make_engine()
    request = engine.build_request(
        "mt", PROMPTS[0], SamplingParams(temperature=1.0, seed=3, max_tokens=30, min_tokens=30, ignore_eos=True)
    )
    sample = final(run(engine, [request])["mt"]).samples[0]
    assert sample.num_output_tokens == 30 and sample.finish_reason == FinishReason.LENGTH


# ------------------------------------------------------------------------------- speculative decoding


@pytest.mark.parametrize("draft", ["self", "ngram"])
def test_greedy_speculative_decoding_matches_hf(make_engine, tiny_llama, hf_greedy, draft):
    """Speculation must not change greedy outputs, whether drafts are accepted (self) or mostly not (ngram)."""
    engine = make_engine(
        draft_model=draft,
        num_speculative_tokens=3,
        draft_dtype="float32",
        max_num_batched_tokens=32,
        spec_max_batch_size=8,  # every prompt speculates in one batch
    )
    prompts = PROMPTS[1:] + ["a b c a b c a b c a b c a b c a b"]
    requests = [engine.build_request(f"sp{i}", p, greedy(16, n=1)) for i, p in enumerate(prompts)]
    drafted = engine.metrics.total("llm_spec_decode_num_draft_tokens_total")
    accepted = engine.metrics.total("llm_spec_decode_num_accepted_tokens_total")
    results = run(engine, requests)
    for request in requests:
        sample = final(results[request.request_id]).samples[0]
        assert sample.token_ids == hf_greedy(tiny_llama, request.prompt_token_ids, 16), (draft, request.prompt)
    drafted = engine.metrics.total("llm_spec_decode_num_draft_tokens_total") - drafted
    accepted = engine.metrics.total("llm_spec_decode_num_accepted_tokens_total") - accepted
    assert drafted > 0
    if draft == "self":
        assert accepted == drafted  # the draft is the target itself (same dtype): every draft is accepted
    check_pool_empty(engine)


def test_speculation_with_parallel_samples_when_the_last_prompt_chunk_is_one_token(make_engine, tiny_llama, hf_greedy):
    prompt = PROMPTS[1]
    length = len(make_engine().input_tokenizer(prompt).input_ids)
    engine = make_engine(
        draft_model="self", num_speculative_tokens=2, draft_dtype="float32", max_num_batched_tokens=length - 1
    )  # chunks: length - 1 tokens, then 1
    request = engine.build_request("spec-n2", prompt, greedy(6, n=2))
    engine.add_request(request)
    outputs = []
    for _ in range(200):
        if not engine.has_work():
            break
        outputs += engine.step()
    stuck = engine.has_work()
    engine.abort("spec-n2")
    assert not stuck, "the request never finished"
    expected = hf_greedy(tiny_llama, request.prompt_token_ids, 6)
    assert [s.token_ids for s in outputs[-1].samples] == [expected, expected]


def test_every_step_runs_on_the_engines_threads(make_engine, monkeypatch):
    """`num_threads: 0` is every core (backend/model/hardware.py serving_threads) for steps of one sequence and
    larger ones alike, for our kernels' pool and (this model's matmuls are torch's) torch's; each pass puts torch's
    count back where something else in the process changed it."""
    import torch

    from backend.model import kernels
    from backend.model.hardware import serving_threads

    engine = make_engine()
    assert engine.threads == engine.runner.threads == serving_threads() == kernels.threads()
    saved = torch.get_num_threads()
    monkeypatch.setattr(engine.runner, "threads", 3)  # not this machine's core count, so the test sees it applied
    used = []
    model = engine.runner.fused or engine.runner.model
    forward = model.forward
    monkeypatch.setattr(
        model,
        "forward",
        # forward(path, input_ids, ...): the rows of the pass and the threads it runs on
        lambda *args, **kw: used.append((len(args[1]), torch.get_num_threads())) or forward(*args, **kw),
    )
    try:
        torch.set_num_threads(1)
        run(engine, [engine.build_request("one", "Hello there", greedy(3))])
        run(engine, [engine.build_request(f"b{i}", "Hello there", greedy(3)) for i in range(3)])
    finally:
        torch.set_num_threads(saved)
    assert {n for n, _ in used} >= {1, 3} and {threads for _, threads in used} == {3}


def test_request_stats_time_the_request_and_count_its_blocks(make_engine):
    """The perf figures a request reports (TensorRT-LLM's return_perf_metrics): times in order, blocks counted,
    the prefix cache's blocks counted as reused when the same prompt comes again, speculation's tokens counted."""
    engine = make_engine(draft_model="self", draft_dtype="float32", num_speculative_tokens=3)
    prompt = PROMPTS[3] + " a b c a b c a b c a b c"
    first = engine.add_request(engine.build_request("s1", prompt, greedy(8)))  # the engine's state of it
    run(engine, [])
    stats = first.stats
    assert stats.arrival_ns <= stats.first_scheduled_ns <= stats.first_token_ns <= stats.last_token_ns
    blocks = -(-(len(first.prompt_token_ids) + 8) // 4)
    assert stats.blocks_reused == 0 and blocks - 1 <= stats.blocks_total <= blocks + 1
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens
    again = engine.add_request(engine.build_request("s2", prompt, greedy(8)))
    run(engine, [])
    assert again.stats.blocks_reused == len(first.prompt_token_ids) // 4 - (len(first.prompt_token_ids) % 4 == 0)
    perf = again.stats.as_dict()
    assert perf["kv_cache_alloc_new_blocks"] == perf["kv_cache_alloc_total_blocks"] - perf["kv_cache_reused_blocks"]
    assert perf["acceptance_rate"] == again.stats.accepted_tokens / again.stats.draft_tokens
    check_pool_empty(engine)


def weights(runner) -> list[int]:
    """Where each linear layer's weight lives."""
    return [lin.weight.data_ptr() for lin in runner.fused.linear_layers()]


def test_a_self_draft_in_the_targets_dtype_shares_its_weights(make_engine):
    """draft_model self with draft_dtype the target's: the draft runs the target's very weights (the same tensors,
    no second copy) over a KV cache of its own; a draft in another dtype loads its own copy."""
    shared = make_engine(draft_model="self", draft_dtype="float32", num_speculative_tokens=2)
    draft, target = shared.spec.proposer.runner, shared.runner
    assert draft is not target and weights(draft) == weights(target)
    assert draft.fused is target.fused and draft.kv_cache.data_ptr() != target.kv_cache.data_ptr()
    assert draft.kv_cache.shape == target.kv_cache.shape
    prompt = PROMPTS[3] + " a b c a b c a b c"
    request = shared.add_request(shared.build_request("shared", prompt, greedy(8)))
    run(shared, [])
    assert request.stats.accepted_tokens > 0
    check_pool_empty(shared)
    own = make_engine(draft_model="self", draft_dtype="bfloat16", num_speculative_tokens=2).spec.proposer.runner
    assert str(own.dtype) == "torch.bfloat16" and not set(weights(own)) & set(weights(target))
