"""Context and generation logits (TensorRT-LLM's return_context_logits / return_generation_logits) from the engine:
every prompt position's logits and every generated token's, against one transformers forward pass in fp32, with
chunked prefill, speculation, parallel samples and a cached prefix; the size limit refuses with the sizes."""

from __future__ import annotations

import pytest
import torch

from backend.protocol.sampling_params import SamplingParams
from backend.protocol.values import InvalidRequest
from tests.unit.engine_runs import PROMPTS, check_pool_empty, final, greedy, run


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every position of `ids` [len, V] from one transformers forward pass in fp32."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def logits_params(max_tokens: int, **extra):
    params = greedy(max_tokens, **extra)
    params.context_logits = params.generation_logits = True
    return params


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 64},
        {"max_num_batched_tokens": 8},  # the prompt in several chunks
        {"draft_model": "self", "draft_dtype": "float32", "num_speculative_tokens": 3},  # tokens verified in groups
    ],
    ids=["one-chunk", "chunked", "speculative"],
)
def test_context_and_generation_logits_equal_transformers(make_engine, tiny_llama, hf_model_cache, settings):
    engine = make_engine(**settings)
    prompt = PROMPTS[2]
    request = engine.build_request("lg", prompt, logits_params(6))
    outputs = run(engine, [request])["lg"]
    carrying = [o for o in outputs if o.context_logits is not None]
    assert len(carrying) == 1 and carrying[0] is outputs[0]  # once, with the first token
    out = final(outputs)
    tokens = out.samples[0].token_ids
    assert len(tokens) == 6
    ids = request.prompt_token_ids
    reference = hf_logits(hf_model_cache(tiny_llama), ids + tokens)
    context = torch.cat(carrying[0].context_logits)
    assert context.shape == (len(ids), reference.shape[1])
    torch.testing.assert_close(context, reference[: len(ids)], atol=1e-4, rtol=1e-4)
    generation = torch.stack(out.samples[0].generation_logits)
    assert generation.shape == (6, reference.shape[1])
    # row i scores token i: the last prompt position's row again, then each generated token's position but the last
    torch.testing.assert_close(generation, reference[len(ids) - 1 : -1], atol=1e-4, rtol=1e-4)
    assert generation.argmax(-1).tolist() == tokens  # greedy chose from these rows
    check_pool_empty(engine)


def test_streamed_generation_logits_follow_each_samples_own_tokens(make_engine, tiny_llama, hf_model_cache):
    engine = make_engine()
    params = SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=5, generation_logits=True)
    request = engine.build_request("s", PROMPTS[1], params, stream=True)
    outputs = run(engine, [request])["s"]
    rows, tokens = {0: [], 1: []}, {0: [], 1: []}
    for output in outputs:
        for sample in output.samples:
            assert len(sample.generation_logits) == len(sample.token_ids)  # a stream's rows travel with its tokens
            rows[sample.sample_index] += sample.generation_logits
            tokens[sample.sample_index] += sample.token_ids
    ids = request.prompt_token_ids
    for index in (0, 1):
        reference = hf_logits(hf_model_cache(tiny_llama), ids + tokens[index])
        torch.testing.assert_close(torch.stack(rows[index]), reference[len(ids) - 1 : -1], atol=1e-4, rtol=1e-4)
    check_pool_empty(engine)


def test_a_cached_prefix_still_gets_every_context_row(make_engine, tiny_llama, hf_model_cache):
    engine = make_engine()
    prompt = PROMPTS[2] * 2
    run(engine, [engine.build_request("warm", prompt, greedy(2))])
    hits = engine.block_manager.prefix_hits
    request = engine.build_request("again", prompt, logits_params(1))
    out = final(run(engine, [request])["again"])
    assert engine.block_manager.prefix_hits == hits  # bypassed the cache: cached blocks have no logits
    ids = request.prompt_token_ids
    torch.testing.assert_close(
        torch.cat(out.context_logits), hf_logits(hf_model_cache(tiny_llama), ids), atol=1e-4, rtol=1e-4
    )
    check_pool_empty(engine)


def test_logits_beyond_max_logits_mb_are_refused_with_the_sizes(make_engine):
    engine = make_engine(max_logits_mb=1)  # 1 MiB: 5 rows of a 49152-token vocabulary
    params = greedy(6)
    params.generation_logits = True
    with pytest.raises(
        InvalidRequest, match=r"return_generation_logits: 6 rows of 49152 logits are 1\.1 MiB; at most 1"
    ):
        engine.build_request("big", PROMPTS[0], params)
    params = greedy(2)
    params.context_logits = True
    with pytest.raises(InvalidRequest, match=r"return_context_logits: \d+ rows .* shorten the prompt"):
        engine.build_request("long", PROMPTS[2], params)
    params.max_tokens, params.context_logits = 5, False
    params.generation_logits = True
    engine.build_request("fits", PROMPTS[2], params)  # 5 rows: 0.94 MiB
