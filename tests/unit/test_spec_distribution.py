"""Speculative sampling keeps the target's distribution with drafts whose q is not p: many short sampled
continuations, without speculation, with a (barely) trained EAGLE head (its drafts mostly rejected) and with the
target's own weights in bf16 (mostly accepted), each held to the target's exact distribution (computed from
transformers' fp32 logits) by a chi-square test; a sampler with another temperature is rejected by the same test,
so the test can fail. Every request has its own seed: the counts, and so the verdict, are the same on every run."""

import pytest
import torch
from scipy.stats import chisquare

from backend import EngineConfig, LLMEngine, SamplingParams
from backend.spec import train_draft
from tests.unit.conftest import make_tiny_model

PROMPT = "Hello there, how are you today?"
TOKENS, TOP_K, REQUESTS = 3, 4, 1200  # 64 outcomes, about 19 samples each
SAMPLED = {"temperature": 1.0, "top_k": TOP_K, "max_tokens": TOKENS, "ignore_eos": True}
ALPHA = 1e-3


@pytest.fixture(scope="module")
def peaked(tmp_path_factory, tiny_model_factory) -> str:
    """A tiny tied Llama whose next-token distributions are far from flat (larger initial weights)."""
    tiny_model_factory("llama")  # skips without the tokenizer
    return make_tiny_model(tmp_path_factory.mktemp("peaked"), "llama", tie_word_embeddings=True, initializer_range=0.2)


@pytest.fixture(scope="module")
def draft(peaked, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("eagle") / "draft"
    args = train_draft.parser().parse_args(
        [
            "--model", peaked, "--out", str(out), "--minutes", "0.3", "--data-share", "0.5",
            "--quantization", "none", "--vocab", "256", "--window", "8", "--max-steps", "3", "--log-seconds", "0",
        ]
    )  # fmt: skip
    train_draft.train(args, log=lambda line: None)
    return str(out)


def exact_distribution(model_dir: str) -> dict[tuple[int, ...], float]:
    """P(continuation) for every continuation of TOKENS tokens under top-k sampling at temperature 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(model_dir)(PROMPT).input_ids
    frontier = {(): 1.0}
    with torch.no_grad():
        for _ in range(TOKENS):
            grown = {}
            for tail, p in frontier.items():
                logits = model(torch.tensor([prompt + list(tail)])).logits[0, -1]
                top = logits.topk(TOP_K)
                for token, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
                    grown[tail + (token,)] = p * q
            frontier = grown
    return frontier


def sampled_counts(model_dir: str, params: dict, **config) -> tuple[dict[tuple[int, ...], int], LLMEngine]:
    settings = dict(model=model_dir, dtype="float32", kv_cache_blocks=512, block_size=4, max_num_seqs=32)
    engine = LLMEngine(EngineConfig(**{**settings, **config}))
    for seed in range(REQUESTS):
        sampling = SamplingParams.from_dict({**params, "seed": seed})
        engine.add_request(engine.build_request(str(seed), PROMPT, sampling, stream=False))
    counts: dict[tuple[int, ...], int] = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                key = tuple(out.samples[0].token_ids)
                counts[key] = counts.get(key, 0) + 1
    assert sum(counts.values()) == REQUESTS and engine.block_manager.num_used_blocks == 0
    return counts, engine


def p_value(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit; outcomes expected fewer than 5 times are pooled, and an outcome the target
    cannot produce fails the test outright."""
    if set(counts) - set(exact):
        return 0.0
    observed, expected, pooled = [], [], [0, 0.0]
    for outcome, p in exact.items():
        if p * REQUESTS < 5:
            pooled[0] += counts.get(outcome, 0)
            pooled[1] += p * REQUESTS
        else:
            observed.append(counts.get(outcome, 0))
            expected.append(p * REQUESTS)
    if pooled[1]:
        observed.append(pooled[0])
        expected.append(pooled[1])
    scale = sum(observed) / sum(expected)  # the exact probabilities sum to 1 up to float rounding
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def total_variation(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float]) -> float:
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / REQUESTS - exact.get(k, 0.0)) for k in keys)


def test_speculative_sampling_keeps_the_targets_distribution(peaked, draft):
    exact = exact_distribution(peaked)
    runs = {"plain": {}, "eagle": {"draft_model": draft}, "self in bf16": {"draft_model": "self"}}
    drafted = accepted = 0
    for name, config in runs.items():
        spec = dict(num_speculative_tokens=2, spec_max_batch_size=32, spec_adaptive=False) if config else {}
        counts, engine = sampled_counts(peaked, SAMPLED, **config, **spec)
        tv = total_variation(counts, exact)
        assert p_value(counts, exact) > ALPHA, f"{name}: total variation {tv:.3f} from the target's distribution"
        if config:
            assert engine.metrics.total("llm_spec_decode_num_draft_tokens_total") > 0, name
        drafted += engine.metrics.total("llm_spec_decode_num_draft_tokens_total")
        accepted += engine.metrics.total("llm_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < drafted  # both of the rejection sampler's branches ran
    hotter, _ = sampled_counts(peaked, {**SAMPLED, "temperature": 2.0})
    assert p_value(hotter, exact) < ALPHA  # the test tells another distribution apart
