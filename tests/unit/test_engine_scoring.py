"""Scoring and steering in the engine: prompt logprobs (token-id prompts, chunked prefill, the prefix cache,
parallel samples, max_tokens 0) against transformers' log-softmax, and logit_bias in greedy, sampled and
speculative decoding."""

from __future__ import annotations

import pytest
import torch

from backend.protocol.sampling_params import SamplingParams
from backend.protocol.values import InvalidRequest
from tests.unit.engine_runs import PROMPTS, check_pool_empty, final, greedy, run


def hf_prompt_logprobs(model, prompt_ids: list[int]) -> list[float]:
    """log p(token i | tokens < i) for i >= 1, from one transformers forward pass in fp32."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, prompt_ids[i]]) for i in range(1, len(prompt_ids))]


def check_against_hf(entries, prompt_ids, reference, top):
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for i, (entry, expected) in enumerate(zip(entries[1:], reference), start=1):
        assert entry["token_id"] == prompt_ids[i]
        assert entry["logprob"] == pytest.approx(expected, abs=1e-4), i
        assert entry["rank"] >= 1
        assert len(entry.get("top_logprobs", {})) == top
        if top:
            best = max(entry["top_logprobs"].values())
            assert best >= entry["logprob"] - 1e-6 and (entry["rank"] == 1) == (best == pytest.approx(entry["logprob"]))


@pytest.mark.parametrize("budget", [64, 8])  # 8: the 30-token prompt is prefilled in 4 chunks
def test_prompt_logprobs_equal_transformers(make_engine, tiny_llama, hf_model_cache, budget):
    engine = make_engine(max_num_batched_tokens=budget)
    prompt = PROMPTS[3] + " and then some more words to make it long"
    request = engine.build_request("pl", prompt, greedy(4, prompt_logprobs=2))
    outputs = run(engine, [request])["pl"]
    carrying = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(carrying) == 1  # sent once
    ids = request.prompt_token_ids
    check_against_hf(carrying[0].prompt_logprobs, ids, hf_prompt_logprobs(hf_model_cache(tiny_llama), ids), 2)
    check_pool_empty(engine)


def test_prompt_logprobs_of_a_cached_prefix_and_token_ids_with_max_tokens_zero(make_engine, tiny_llama, hf_model_cache):
    """A prompt whose blocks are in the prefix cache still gets every logprob (it bypasses the cache); a
    token-id prompt with max_tokens 0 is scored and generates nothing; n samples share one prompt scoring."""
    engine = make_engine()
    prompt = PROMPTS[2] * 3
    run(engine, [engine.build_request("warm", prompt, greedy(2))])
    hits = engine.block_manager.prefix_hits
    ids = engine.input_tokenizer(prompt).input_ids
    scored = engine.build_request("ids", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    sampled = engine.build_request("n2", ids, SamplingParams(max_tokens=3, n=2, seed=7, prompt_logprobs=1))
    results = run(engine, [scored, sampled])
    assert engine.block_manager.prefix_hits == hits  # neither read the cache
    reference = hf_prompt_logprobs(hf_model_cache(tiny_llama), ids)
    whole = final(results["ids"])
    assert scored.prompt == engine.tokenizer.decode(ids)
    assert [s.token_ids for s in whole.samples] == [[]] and whole.samples[0].finish_reason.value == "length"
    check_against_hf(whole.prompt_logprobs, ids, reference, 0)
    both = final(results["n2"])
    assert len(both.samples) == 2 and all(len(s.token_ids) == 3 for s in both.samples)
    check_against_hf(both.prompt_logprobs, ids, reference, 1)
    check_pool_empty(engine)


@pytest.mark.parametrize(
    "ids, fragment",
    [
        ([], "at least one token id"),
        ([1, 49152], "token ids from 0 to 49151"),
        ([-1], "token ids from 0 to 49151"),
    ],
)
def test_bad_token_id_prompts(make_engine, ids, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        make_engine().build_request("bad", ids, greedy(2))


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(InvalidRequest, match="max_tokens must be between 1"):
        SamplingParams.from_dict({"max_tokens": 0})
    assert SamplingParams.from_dict({"max_tokens": 0, "prompt_logprobs": 0}).max_tokens == 0


def test_logit_bias_forces_and_forbids(make_engine, tiny_llama, hf_greedy):
    engine = make_engine()
    plain = engine.build_request("plain", PROMPTS[1], greedy(6))
    forced_token = 1234
    forced = engine.build_request("forced", PROMPTS[1], greedy(6, logit_bias={forced_token: 100.0}))
    reference = hf_greedy(tiny_llama, plain.prompt_token_ids, 6, stop_at_eos=False)
    banned = engine.build_request("banned", PROMPTS[1], greedy(6, logit_bias={reference[0]: -100.0}))
    sampled = engine.build_request(
        "sampled", PROMPTS[1], SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias={forced_token: 100.0})
    )
    results = run(engine, [plain, forced, banned, sampled])
    assert final(results["plain"]).samples[0].token_ids == reference
    assert final(results["forced"]).samples[0].token_ids == [forced_token] * 6
    assert final(results["sampled"]).samples[0].token_ids == [forced_token] * 6
    assert final(results["banned"]).samples[0].token_ids[0] != reference[0]
    check_pool_empty(engine)


@pytest.mark.parametrize("draft", ["self", "ngram"])
def test_logit_bias_under_speculation_equals_no_speculation(make_engine, draft):
    """The verifier sees the biased distribution: greedy outputs with a bias are the same with speculation."""
    bias = {220: 3.0, 28: -100.0, 30: 5.0}
    prompt = "a b c a b c a b c a b c a b c a b"
    plain = make_engine()
    expected = final(run(plain, [plain.build_request("b", prompt, greedy(12, logit_bias=bias))])["b"])
    spec = make_engine(draft_model=draft, num_speculative_tokens=3, draft_dtype="float32")
    got = final(run(spec, [spec.build_request("b", prompt, greedy(12, logit_bias=bias))])["b"])
    assert got.samples[0].token_ids == expected.samples[0].token_ids
    assert 28 not in got.samples[0].token_ids
    check_pool_empty(spec)


@pytest.mark.parametrize(
    "values, fragment",
    [
        ({"logit_bias": {"5": 101}}, "between -100.0 and 100.0"),
        ({"logit_bias": {"x": 1}}, "logit_bias key must be an integer"),
        ({"logit_bias": [1]}, "must be an object"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20"),
    ],
)
def test_bad_scoring_parameters(values, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        SamplingParams.from_dict(values)


def test_logit_bias_ids_checked_against_the_vocabulary(make_engine):
    with pytest.raises(InvalidRequest, match="logit_bias keys must be token ids below 49152"):
        make_engine().build_request("bad", "hi", greedy(2, logit_bias={49152: 1.0}))


@pytest.mark.parametrize("draft", ["", "ngram"])
def test_bad_words_are_never_generated_and_speculation_agrees(make_engine, draft):
    """The greedy output's second token, banned as a word: it never appears, and speculation (verification bans
    it after the draft prefix) gives the same output as plain decoding."""
    prompt = "a b c a b c a b c a b c a b c a b"
    plain = make_engine()
    reference = final(run(plain, [plain.build_request("p", prompt, greedy(8))])["p"]).samples[0].token_ids
    word = plain.input_tokenizer.decode([reference[1]])
    params = greedy(8, bad_words=[word], word_bias={"zzz": 0.5})
    expected = final(run(plain, [plain.build_request("b", prompt, params)])["b"]).samples[0].token_ids
    banned = {seq[-1] for seq in plain.build_request("x", prompt, params).params.bad_word_ids}
    assert reference[1] in banned and not banned & set(expected)
    engine = make_engine(draft_model=draft, num_speculative_tokens=3) if draft else plain
    got = final(run(engine, [engine.build_request("b", prompt, params)])["b"]).samples[0].token_ids
    assert got == expected
    check_pool_empty(engine)


def test_word_bias_adds_to_each_of_the_words_tokens(make_engine):
    engine = make_engine()
    params = engine.build_request("w", "hi", greedy(2, word_bias={"hello world": 2.0}, logit_bias={5: 1.0})).params
    expected = {5: 1.0}
    for token_id in engine.input_tokenizer.encode("hello world", add_special_tokens=False):
        expected[token_id] = expected.get(token_id, 0.0) + 2.0
    assert params.logit_bias == expected and len(expected) > 1


def test_token_id_word_lists_ban_and_stop(make_engine):
    """TensorRT-LLM's token-level word lists: bad_word_ids ban a sequence's last token after the rest (with
    bad_words' own sequences added), and stop_word_ids end a sample once its output ends with one, the sequence
    kept in output_ids."""
    engine = make_engine()
    prompt = "1 2 3 4 5 6 7 8 9 10 11 12"
    reference = final(run(engine, [engine.build_request("r", prompt, greedy(8))])["r"]).samples[0].token_ids
    banned = engine.build_request("b", prompt, greedy(8, bad_word_ids=[[reference[0]]]))
    got = final(run(engine, [banned])["b"]).samples[0].token_ids
    assert got[0] != reference[0] and reference[0] not in got
    params = engine.build_request("w", prompt, greedy(8, bad_word_ids=[[7, 8]], bad_words=["zzz"])).params
    assert [7, 8] in params.bad_word_ids and len(params.bad_word_ids) > 1
    stop = engine.build_request("s", prompt, greedy(8, stop_word_ids=[reference[2:4], [49151, 1]]))
    out = final(run(engine, [stop])["s"]).samples[0]
    assert out.token_ids == reference[:4] and out.finish_reason.value == "stop"
    held = engine.build_request("m", prompt, greedy(8, stop_word_ids=[reference[2:4]], min_tokens=6))
    assert len(final(run(engine, [held])["m"]).samples[0].token_ids) >= 6  # no stop before min_tokens
    with pytest.raises(InvalidRequest, match="bad_word_ids and stop_word_ids must be token ids below 49152"):
        engine.build_request("x", prompt, greedy(2, stop_word_ids=[[49152]]))
    check_pool_empty(engine)
