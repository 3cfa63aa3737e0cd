"""The structured-output constraints in the engine, on the tiny random Llama: every kind holds under chunked
prefill, n > 1, prefix caching, preemption and speculative decoding (a draft that breaks the grammar never gets
through), a seeded constrained request reproduces in a busy batch, and a grammar that does not compile fails only
its request."""

from __future__ import annotations

import json
import re

import pytest

from backend import SamplingParams
from backend.core.request import FinishReason
from backend.core.scheduler_output import Draft
from backend.protocol.guided_decoding import pop_guided_decoding
from backend.spec.proposers import Proposer
from tests.unit.engine_runs import check_pool_empty, run

SCHEMA = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["age", "kind", "tags"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": ({"guided_json": SCHEMA}, lambda text: _fits_schema(json.loads(text))),
    "json_object": ({"guided_json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    "regex": ({"guided_regex": "[0-9]{2,3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{2,3}-[a-z]{2}", text)),
    "choice": ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    "grammar": ({"guided_grammar": 'root ::= "(" [a-c]{1,3} ")"'}, lambda text: re.fullmatch(r"\([a-c]{1,3}\)", text)),
}


def _fits_schema(value) -> bool:
    import jsonschema

    jsonschema.validate(value, SCHEMA)
    return True


def constrained(kind: str, **params) -> SamplingParams:
    return SamplingParams.from_dict({"max_tokens": 60, **CONSTRAINTS[kind][0], **params})


def check(engine, kind: str, sample) -> None:
    """Every emitted token was allowed; the text is complete and valid (any JSON object: a random model's
    strings may run to max_tokens, so only where it stopped)."""
    matcher = engine.structured.compile(pop_guided_decoding(dict(CONSTRAINTS[kind][0]))).result().deep_copy()
    assert all(matcher.consume_token(t) for t in sample.token_ids), (kind, sample.text)
    if kind != "json_object" or sample.finish_reason != FinishReason.LENGTH:
        assert sample.finish_reason == FinishReason.STOP, (kind, sample.text)
        assert CONSTRAINTS[kind][1](sample.text), (kind, sample.text)


def run_all(engine, specs, prompt="Answer:"):
    """[(id, kind, params)] -> {id: final samples}"""
    requests = [engine.build_request(rid, f"{prompt} {rid}", constrained(kind, **p)) for rid, kind, p in specs]
    return {rid: outs[-1].samples for rid, outs in run(engine, requests).items()}


def test_every_kind_holds_greedy_and_sampled_with_parallel_samples(make_engine):
    engine = make_engine(max_num_batched_tokens=8)  # prompts are chunked
    specs = [
        (f"{kind}-{mode}", kind, p)
        for kind in CONSTRAINTS
        for mode, p in (("greedy", {"temperature": 0}), ("sampled", {"n": 3, "seed": 7}))
    ]
    results = run_all(engine, specs)
    for rid, kind, p in specs:
        assert len(results[rid]) == p.get("n", 1)
        for sample in results[rid]:
            check(engine, kind, sample)
    check_pool_empty(engine)


def test_prefix_caching_and_preemption_keep_the_constraint_and_the_output(make_engine):
    specs = [(f"{kind}-{i}", kind, {"seed": i, "n": 2}) for kind in CONSTRAINTS for i in range(2)]
    reference = run_all(make_engine(), specs)
    cached = run_all(make_engine(), specs)  # the same prompts again: served from the prefix cache
    tight = make_engine(kv_cache_blocks=24, max_num_seqs=8)  # 4-token blocks: preemption certain
    preempted_before = tight.scheduler.num_preemptions
    squeezed = run_all(tight, specs)
    assert tight.scheduler.num_preemptions > preempted_before
    for rid, kind, _ in specs:
        texts = [s.text for s in reference[rid]]
        assert [s.text for s in cached[rid]] == texts and [s.text for s in squeezed[rid]] == texts, rid
        for sample in squeezed[rid]:
            check(tight, kind, sample)
    check_pool_empty(tight)


class GrammarBreakingDraft(Proposer):
    """Proposes the next token of a known output (where one is given), then copies of a token that no
    constraint here allows (deterministic: one-hot q)."""

    def __init__(self, bad_token: int, known: dict[str, list[int]]):
        self.bad_token, self.known = bad_token, known

    def propose(self, requests):
        drafts = []
        for seq, k in requests:
            known = self.known.get(seq.request.request_id, [])[seq.num_output_tokens :][:1]
            drafts.append(Draft((known + [self.bad_token] * k)[:k]))
        return drafts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_that_break_the_grammar_are_rejected(make_engine, temperature):
    """Greedy: each step's first draft is the right token, the rest break the grammar: the right ones are
    accepted, the matcher follows the accepted prefix, the output is unchanged. Sampled: every draft breaks it."""
    specs = [(f"bad-{kind}", kind, {"temperature": temperature, "seed": 3}) for kind in CONSTRAINTS]
    known = {}
    if temperature == 0.0:
        known = {rid: samples[0].token_ids for rid, samples in run_all(make_engine(), specs).items()}
    engine = make_engine(draft_model="ngram", num_speculative_tokens=3)
    bad = engine.input_tokenizer(" Bonjour").input_ids[0]
    engine.spec.proposer = GrammarBreakingDraft(bad, known)
    drafted = engine.metrics.total("llm_spec_decode_num_draft_tokens_total")
    accepted = engine.metrics.total("llm_spec_decode_num_accepted_tokens_total")
    results = run_all(engine, specs)
    drafted = engine.metrics.total("llm_spec_decode_num_draft_tokens_total") - drafted
    accepted = engine.metrics.total("llm_spec_decode_num_accepted_tokens_total") - accepted
    assert drafted > 0
    if known:
        assert 0 < accepted < drafted
    else:
        assert accepted == 0  # none got through
    for rid, kind, _ in specs:
        check(engine, kind, results[rid][0])
        assert bad not in results[rid][0].token_ids
        if known:
            assert results[rid][0].token_ids == known[rid]
    check_pool_empty(engine)


def test_greedy_constrained_output_is_unchanged_by_speculation(make_engine):
    specs = [(f"spec-{kind}", kind, {"temperature": 0}) for kind in CONSTRAINTS]
    plain = run_all(make_engine(), specs)
    engine = make_engine(draft_model="self", num_speculative_tokens=3, draft_dtype="float32")
    drafted = engine.metrics.total("llm_spec_decode_num_draft_tokens_total")
    accepted = engine.metrics.total("llm_spec_decode_num_accepted_tokens_total")
    speculated = run_all(engine, specs)
    drafted = engine.metrics.total("llm_spec_decode_num_draft_tokens_total") - drafted
    accepted = engine.metrics.total("llm_spec_decode_num_accepted_tokens_total") - accepted
    assert 0 < accepted < drafted  # the unconstrained draft is often right, sometimes forbidden
    for rid, _kind, _ in specs:
        assert [s.token_ids for s in speculated[rid]] == [s.token_ids for s in plain[rid]], rid
    check_pool_empty(engine)


def test_seeded_constrained_request_is_the_same_alone_and_in_a_busy_batch(make_engine):
    engine = make_engine(max_num_batched_tokens=16)
    alone = run_all(engine, [("seeded", "json", {"seed": 11, "temperature": 0.9})])["seeded"][0]
    busy = [(f"other-{kind}-{i}", kind, {"seed": 100 + i, "n": 2}) for kind in CONSTRAINTS for i in range(2)]
    prompts = [
        engine.build_request(f"free-{i}", "Tell me a story", SamplingParams(max_tokens=30, seed=i)) for i in range(3)
    ]
    requests = prompts + [engine.build_request(rid, f"Answer: {rid}", constrained(kind, **p)) for rid, kind, p in busy]
    requests.insert(4, engine.build_request("seeded", "Answer: seeded", constrained("json", seed=11, temperature=0.9)))
    results = run(engine, requests)
    assert results["seeded"][-1].samples[0].token_ids == alone.token_ids
    check(engine, "json", alone)
    check_pool_empty(engine)


def test_a_grammar_that_does_not_compile_fails_only_its_request(make_engine):
    engine = make_engine()
    bad = SamplingParams.from_dict({"max_tokens": 8, "guided_json": {"properties": {"a": {"type": "nope"}}}})
    requests = [engine.build_request("bad", "Hello", bad), engine.build_request("good", "Hello", constrained("choice"))]
    results = run(engine, requests)
    assert "the JSON schema does not compile" in results["bad"][-1].error and "nope" in results["bad"][-1].error
    assert results["good"][-1].error is None
    check(engine, "choice", results["good"][-1].samples[0])
    check_pool_empty(engine)
