"""Speculative decoding inside the engine: exactness against plain decoding, acceptance, stop rules, and
an exact target distribution for sampled requests (chi-square)."""

import pytest
import torch

from backend import EngineConfig, LLMEngine, SamplingParams
from backend.core.scheduler_output import Draft
from backend.spec.proposers import Proposer
from launcher.paths import MODEL_DIR as SMOL_DIR

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Hello",
    "A long prompt that spans several blocks of the cache " * 6,
]


def _run(engine: LLMEngine, prompts, **params) -> dict[str, tuple[list[int], str, str]]:
    """Run every prompt at once to completion; returns id -> (token ids, text, finish reason)."""
    for i, prompt in enumerate(prompts):
        sp = SamplingParams.from_dict(params)
        engine.add_request(engine.build_request(str(i), prompt, sp, stream=True))
    tokens, texts, reasons = {}, {}, {}
    while engine.has_work():
        for out in engine.step():
            for sample in out.samples:
                tokens.setdefault(out.request_id, []).extend(sample.token_ids)
                texts[out.request_id] = texts.get(out.request_id, "") + sample.text
                if sample.finish_reason:
                    reasons[out.request_id] = sample.finish_reason.value
    assert engine.block_manager.num_used_blocks == 0
    return {rid: (tokens.get(rid, []), texts.get(rid, ""), reasons[rid]) for rid in reasons}


def _engine(model: str, **overrides) -> LLMEngine:
    settings = dict(
        model=model,
        dtype="float32",
        kv_cache_blocks=256,
        block_size=4,
        max_num_batched_tokens=48,
        max_num_seqs=8,
        spec_max_batch_size=8,  # these tests speculate for a whole batch of prompts at once
    )
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


@pytest.fixture(scope="module")
def plain_greedy(tiny_llama):
    return _run(_engine(tiny_llama), PROMPTS, temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "draft, dtype, k",
    [
        ("self", "float32", 4),
        ("self", "bfloat16", 3),
        ("ngram", "float32", 3),
        ("suffix", "float32", 4),
        ("self", "float32", 1),
    ],
)
def test_greedy_speculation_equals_plain_decoding(tiny_llama, plain_greedy, draft, dtype, k):
    engine = _engine(tiny_llama, draft_model=draft, draft_dtype=dtype, num_speculative_tokens=k)
    assert _run(engine, PROMPTS, temperature=0, max_tokens=24, ignore_eos=True) == plain_greedy
    assert engine.metrics.total("llm_spec_decode_num_drafts_total") > 0


@pytest.mark.parametrize("draft", ["ngram", "suffix", "self"])
def test_greedy_adaptive_speculation_equals_plain_decoding(tiny_llama, plain_greedy, draft):
    engine = _engine(
        tiny_llama,
        draft_model=draft,
        draft_dtype="float32",
        num_speculative_tokens=4,
        spec_adaptive=True,
        spec_probe_interval=2,
    )
    assert _run(engine, PROMPTS, temperature=0, max_tokens=24, ignore_eos=True) == plain_greedy
    assert engine.metrics.total("llm_spec_decode_num_drafts_total") > 0


def test_adaptive_identical_draft_grows_k_to_the_max(tiny_llama):
    k = 4
    engine = _engine(
        tiny_llama, draft_model="self", draft_dtype="float32", num_speculative_tokens=k, spec_adaptive=True
    )
    _run(engine, PROMPTS[:1], temperature=0, max_tokens=24, ignore_eos=True)
    per_pos = {
        dict(key)["position"]: v
        for key, v in engine.metrics.counters["llm_spec_decode_num_accepted_tokens_per_pos_total"].items()
    }
    assert per_pos.get(k - 1, 0) >= 2  # full-length drafts, after starting shorter
    assert per_pos[0] > per_pos[k - 1]


class OracleProposer(Proposer):
    """Drafts from the known greedy output: wrong tokens before output position `right_from`, right ones after
    (output that starts copying its input halfway). Counts the wrong draft tokens it was asked for."""

    def __init__(self, outputs: dict[str, list[int]], right_from: int):
        self.outputs, self.right_from = outputs, right_from
        self.wrong_drafted = 0

    def propose(self, requests):
        drafts = []
        for seq, k in requests:
            future = self.outputs[seq.request.request_id][seq.num_output_tokens :][:k]
            if seq.num_output_tokens < self.right_from:
                future = [(t + 1) % 49152 for t in future]
                self.wrong_drafted += len(future)
            drafts.append(Draft(future))
        return drafts


def test_adaptive_stops_on_rejected_drafts_and_resumes_when_they_are_accepted(tiny_llama):
    k, right_from, max_tokens = 4, 20, 42
    prompts = PROMPTS[:3]
    expected = _run(_engine(tiny_llama), prompts, temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(**adaptive):
        engine = _engine(tiny_llama, draft_model="ngram", num_speculative_tokens=k, **adaptive)
        oracle = engine.spec.proposer = OracleProposer({rid: out[0] for rid, out in expected.items()}, right_from)
        assert _run(engine, prompts, temperature=0, max_tokens=max_tokens, ignore_eos=True) == expected
        per_pos = engine.metrics.counters["llm_spec_decode_num_accepted_tokens_per_pos_total"]
        return oracle.wrong_drafted, {dict(key)["position"]: v for key, v in per_pos.items()}

    fixed_wrong, _ = run()
    wrong, accepted_at = run(spec_adaptive=True, spec_probe_interval=4)
    assert wrong < fixed_wrong / 5  # it stopped drafting while drafts were rejected, probing now and then
    assert accepted_at.get(k - 1, 0) >= len(prompts)  # a probe found the copying and k grew back to the max


def test_identical_draft_accepts_everything_and_emits_k_plus_one(tiny_llama):
    k = 4
    engine = _engine(tiny_llama, draft_model="self", draft_dtype="float32", num_speculative_tokens=k)
    _run(engine, PROMPTS[:2], temperature=0, max_tokens=1 + 5 * (k + 1), ignore_eos=True)
    m = engine.metrics
    drafts = m.total("llm_spec_decode_num_drafts_total")
    assert m.total("llm_spec_decode_num_accepted_tokens_total") == m.total("llm_spec_decode_num_draft_tokens_total")
    assert m.total("llm_spec_decode_num_draft_tokens_total") == drafts * k  # every step verified k, emitted k+1
    assert drafts == 2 * 5
    per_pos = m.counters["llm_spec_decode_num_accepted_tokens_per_pos_total"]
    assert {dict(key)["position"]: v for key, v in per_pos.items()} == {p: drafts for p in range(k)}


def test_stop_rules_cut_where_plain_decoding_cuts(tiny_llama):
    plain = _run(_engine(tiny_llama), PROMPTS, temperature=0, max_tokens=13, stop=["e", "\n"])
    spec = _engine(tiny_llama, draft_model="self", draft_dtype="float32", num_speculative_tokens=4)
    assert _run(spec, PROMPTS, temperature=0, max_tokens=13, stop=["e", "\n"]) == plain


def test_per_request_zero_turns_speculation_off(tiny_llama):
    engine = _engine(tiny_llama, draft_model="ngram", num_speculative_tokens=3)
    _run(engine, PROMPTS, temperature=0, max_tokens=8, num_speculative_tokens=0)
    assert engine.metrics.total("llm_spec_decode_num_drafts_total") == 0


def test_large_batch_turns_speculation_off(tiny_llama):
    engine = _engine(tiny_llama, draft_model="self", num_speculative_tokens=2, spec_max_batch_size=2)
    _run(engine, PROMPTS, temperature=0, max_tokens=6, ignore_eos=True)
    drafts = engine.metrics.total("llm_spec_decode_num_drafts_total")
    solo = _engine(tiny_llama, draft_model="self", num_speculative_tokens=2, spec_max_batch_size=2)
    _run(solo, PROMPTS[:1], temperature=0, max_tokens=6, ignore_eos=True)
    assert drafts < 5 * solo.metrics.total("llm_spec_decode_num_drafts_total")


def test_large_batch_turns_adaptive_speculation_off(tiny_llama):
    engine = _engine(
        tiny_llama, draft_model="self", num_speculative_tokens=2, spec_max_batch_size=2, spec_adaptive=True
    )
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(
            engine.build_request(
                str(i), prompt, SamplingParams.from_dict({"temperature": 0, "max_tokens": 6, "ignore_eos": True})
            )
        )
    while engine.has_work():
        engine.step()
        if len(engine.scheduler.running) > 2:
            assert engine.metrics.total("llm_spec_decode_num_drafts_total") == 0


@pytest.mark.parametrize("draft", ["self", "suffix"])
def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama, draft):
    def once():
        engine = _engine(tiny_llama, draft_model=draft, draft_dtype="bfloat16", num_speculative_tokens=3)
        return _run(engine, PROMPTS, temperature=1.0, top_p=0.9, seed=42, max_tokens=16)

    assert once() == once()


def test_suffix_learns_across_requests_and_stays_exact(tiny_llama, plain_greedy):
    """Requests that repeat earlier ones draft from the global store (longer accepted drafts than the first time),
    with the same greedy output; every finished request's index is dropped."""
    engine = _engine(tiny_llama, draft_model="suffix", num_speculative_tokens=4, spec_adaptive=True)
    accepted = []
    for _ in range(2):
        before = engine.metrics.total("llm_spec_decode_num_accepted_tokens_total")
        assert _run(engine, PROMPTS, temperature=0, max_tokens=24, ignore_eos=True) == plain_greedy
        accepted.append(engine.metrics.total("llm_spec_decode_num_accepted_tokens_total") - before)
    proposer = engine.spec.proposer
    assert proposer.indexes == {} and len(proposer.cache) == 2 * len(PROMPTS)
    assert accepted[1] > accepted[0] + 2 * len(PROMPTS)


@pytest.mark.slow
@pytest.mark.skipif(not (SMOL_DIR / "model.safetensors").exists(), reason="needs the default model (make model)")
def test_sampled_token_frequencies_match_without_speculation():
    """Temperature 1: frequencies of the first three generated tokens over many seeded requests, spec on
    (draft = the target in bf16, whose distribution differs) vs off, pass a chi-square test at alpha = 0.001."""
    from scipy.stats import chi2_contingency

    prompt, samples, positions = "My favourite food is", 240, 3

    def frequencies(**spec) -> list[dict[int, int]]:
        engine = LLMEngine(
            EngineConfig(
                model=str(SMOL_DIR),
                dtype="float32",
                kv_cache_blocks=2048,
                max_num_seqs=samples,
                max_num_batched_tokens=4096,
                spec_max_batch_size=samples,
                **spec,
            )
        )
        for i in range(samples):
            params = SamplingParams.from_dict(
                {"temperature": 1.0, "seed": 1000 + i, "max_tokens": positions, "ignore_eos": True}
            )
            engine.add_request(engine.build_request(str(i), prompt, params))
        counts = [dict() for _ in range(positions)]
        while engine.has_work():
            for out in engine.step():
                for pos, token in enumerate(out.samples[0].token_ids if out.finished else []):
                    counts[pos][token] = counts[pos].get(token, 0) + 1
        return counts

    plain = frequencies()
    spec = frequencies(draft_model="self", draft_dtype="bfloat16", num_speculative_tokens=2)
    for pos in range(1, positions):  # position 0 comes from the prefill, before any speculation
        tokens = sorted(set(plain[pos]) | set(spec[pos]), key=lambda t: -(plain[pos].get(t, 0) + spec[pos].get(t, 0)))
        head, tail = tokens[:8], tokens[8:]  # pool the rare tokens so every expected count is reasonable
        table = [[c.get(t, 0) for t in head] + [sum(c.get(t, 0) for t in tail)] for c in (plain[pos], spec[pos])]
        table = [list(col) for col in zip(*table) if sum(col) > 0]
        _, p_value, _, _ = chi2_contingency(torch.tensor(table).T.tolist())
        assert p_value > 0.001, f"position {pos}: token frequencies differ (p={p_value:.2g}): {table}"
