"""Per-request prefix-cache accounting (`RequestOutput.num_cached_tokens`, the front door's `cached_tokens`): the
prompt tokens whose KV came from the prefix cache at the request's first admission, its full cached blocks x the
block size, on every output of the request; what the engine's llm_prefix_cache_hits_total adds for it."""

from __future__ import annotations

from backend import SamplingParams
from tests.unit.engine_runs import check_pool_empty, greedy, run

BLOCK = 4  # make_engine's block size


def prompt(start: int, length: int) -> list[int]:
    """Token ids no other test sends (the engines are shared between tests, and so are their caches)."""
    return list(range(start, start + length))


def cached_tokens(
    engine, request_id: str, token_ids: list[int], params: SamplingParams, stream: bool = False
) -> tuple[set[int], int]:
    """The num_cached_tokens the request's outputs report (a set: every output says the same) and what the
    prefix-hit metric counted for it."""
    engine.update_gauges()
    before = engine.metrics.total("llm_prefix_cache_hits_total")
    outputs = run(engine, [engine.build_request(request_id, token_ids, params, stream=stream)])[request_id]
    engine.update_gauges()
    return {o.num_cached_tokens for o in outputs}, engine.metrics.total("llm_prefix_cache_hits_total") - before


def test_a_shared_prefix_of_full_blocks_is_reported_cached(make_engine):
    engine = make_engine()
    shared = prompt(1000, 5 * BLOCK + 2)  # five full blocks, then two tokens of a sixth
    first, hits = cached_tokens(engine, "a1", shared + [7, 8, 9], greedy(4))
    assert (first, hits) == ({0}, 0)
    second, hits = cached_tokens(engine, "a2", shared + [11, 12], greedy(4, n=2, seed=3))
    assert (second, hits) == ({5 * BLOCK}, 5 * BLOCK)  # the full blocks shared, counted once for n = 2
    again, hits = cached_tokens(engine, "a3", shared + [7, 8, 9], greedy(3), stream=True)
    assert (again, hits) == ({6 * BLOCK}, 6 * BLOCK)  # a1's prompt up to the block of its last token
    check_pool_empty(engine)


def test_a_prompt_that_fits_in_its_last_block_leaves_one_token_uncached(make_engine):
    engine = make_engine()
    exact = prompt(2000, 3 * BLOCK)
    assert cached_tokens(engine, "b1", exact, greedy(2))[0] == {0}
    assert cached_tokens(engine, "b2", exact, greedy(2)) == ({2 * BLOCK}, 2 * BLOCK)  # one position computes logits


def test_prefix_caching_off_reports_nothing_cached(make_engine):
    engine = make_engine(enable_prefix_caching=False)
    shared = prompt(3000, 6 * BLOCK)
    for i in range(2):
        assert cached_tokens(engine, f"off{i}", shared + [i], greedy(3)) == ({0}, 0)


def test_a_prompt_scored_in_prefill_bypasses_the_cache_and_reports_none(make_engine):
    engine = make_engine()
    shared = prompt(4000, 4 * BLOCK + 1)
    cached_tokens(engine, "c1", shared, greedy(2))
    assert cached_tokens(engine, "c2", shared, greedy(2, prompt_logprobs=0)) == ({0}, 0)


def test_preemption_keeps_what_the_first_admission_reused(make_engine):
    """A preempted sequence is readmitted and may find its own freed blocks (prompt and output) in the cache:
    the metric counts them again, the request's cached tokens stay those of its first admission."""
    engine = make_engine(kv_cache_blocks=22, max_num_batched_tokens=32)
    shared = prompt(5000, 3 * BLOCK)
    warm, _ = cached_tokens(engine, "w", shared + [1], greedy(1))
    assert warm == {0}
    engine.update_gauges()
    before, preempted = engine.metrics.total("llm_prefix_cache_hits_total"), engine.scheduler.num_preemptions
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = [engine.build_request(f"p{i}", shared + prompt(6000 + 100 * i, 9), params) for i in range(4)]
    results = run(engine, requests)
    engine.update_gauges()
    assert engine.scheduler.num_preemptions > preempted
    reported = {request_id: {o.num_cached_tokens for o in outputs} for request_id, outputs in results.items()}
    assert reported == {f"p{i}": {3 * BLOCK} for i in range(4)}
    assert engine.metrics.total("llm_prefix_cache_hits_total") - before > 4 * 3 * BLOCK  # readmissions counted
    check_pool_empty(engine)
