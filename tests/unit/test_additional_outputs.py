"""The additional outputs in Triton's vLLM backend's terms: what a response holds for which flags
(backend/engine/output_sender.py), the cumulative logprob the engine keeps per sample (with n > 1 and speculation),
and the front door reading the vLLM shapes back (frontend/triton_stream.py, over the response decoder it shares with
the client: backend/protocol/triton_response.py, whose own tests are tests/unit/test_triton_response.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backend import LLMEngine, SamplingParams
from backend.core.request import FinishReason, RequestOutput, RequestStats, SampleOutput
from backend.protocol.wire import OPTIONAL_OUTPUTS
from backend.serving.response_tensors import TokenTexts, response_arrays, vllm_logprobs
from frontend.triton_stream import _deltas

ALWAYS = {"text_output", "output_ids", "sample_index"}


def entry(token_id, logprob, rank, top=None) -> dict:
    e = {"token_id": token_id, "logprob": logprob, "rank": rank}
    if top is not None:
        e["top_logprobs"] = top
    return e


def output(samples, num_input=4, context_logits=None, cached=0) -> RequestOutput:
    return RequestOutput(
        "r",
        samples,
        num_input,
        False,
        None,
        1,
        context_logits=context_logits,
        stats=RequestStats(),
        num_cached_tokens=cached,
    )


def text_of(token_id, skip_special_tokens=True) -> str:
    return f"<{token_id}>"


def test_vllm_logprobs_sampled_token_first_then_the_top_by_rank():
    inside = entry(7, -0.1, 1, {7: -0.1, 3: -2.5})
    outside = entry(9, -4.0, 12, {7: -0.2, 3: -1.9})
    got = vllm_logprobs([inside, outside], text_of)
    assert got[0] == {
        "7": {"logprob": -0.1, "rank": 1, "decoded_token": "<7>"},
        "3": {"logprob": -2.5, "rank": 2, "decoded_token": "<3>"},
    }
    assert list(got[1]) == ["9", "7", "3"]  # logprobs + 1 keys when the sampled token is not among the top
    assert [v["rank"] for v in got[1].values()] == [12, 1, 2]
    assert vllm_logprobs([entry(5, -0.3, 2)], text_of) == [{"5": {"logprob": -0.3, "rank": 2, "decoded_token": "<5>"}}]
    assert vllm_logprobs(None, text_of) is None


def test_a_response_holds_only_the_outputs_asked_for():
    rows = [torch.arange(6, dtype=torch.float32), -torch.arange(6, dtype=torch.float32)]
    logprobs = [entry(7, -0.1, 1, {7: -0.1}), entry(9, -1.0, 2, {4: -0.5})]
    sample = SampleOutput(0, "ab", [7, 9], None, 5, logprobs, -1.1, rows)
    context = [torch.zeros(3, 6), torch.ones(1, 6)]  # two prefill chunks of a 4-token prompt
    with_prompt = output([sample], context_logits=context, cached=2)
    assert set(response_arrays(with_prompt, [sample], frozenset(), text_of)) == ALWAYS
    for name in OPTIONAL_OUTPUTS:
        assert set(response_arrays(with_prompt, [sample], frozenset({name}), text_of)) == ALWAYS | {name}
    arrays = response_arrays(with_prompt, [sample], frozenset(OPTIONAL_OUTPUTS), text_of)
    assert arrays["context_logits"].shape == (4, 6) and arrays["context_logits"].dtype == np.float32
    assert arrays["context_logits"][3].tolist() == [1.0] * 6
    assert arrays["generation_logits"].shape == (2, 6) and arrays["generation_logits"][1, 5] == -5.0
    # the prompt's outputs travel once: a later response of the stream leaves context_logits out
    assert "context_logits" not in response_arrays(output([sample]), [sample], frozenset(OPTIONAL_OUTPUTS), text_of)
    assert arrays["finish_reason"].tolist() == [b"None"]  # until the sample finishes
    assert arrays["num_output_tokens"].tolist() == [2] and arrays["num_output_tokens"].dtype == np.uint32
    assert arrays["num_input_tokens"].tolist() == [4]
    assert arrays["num_cached_tokens"].tolist() == [2] and arrays["num_cached_tokens"].dtype == np.uint32
    assert arrays["cumulative_logprob"].dtype == np.float32 and arrays["cumulative_logprob"][0] == pytest.approx(-1.1)
    logprobs = json.loads(arrays["logprobs"][0])
    assert len(logprobs) == 2 and list(logprobs[1]) == ["9", "4"]
    assert arrays["text_output"].tolist() == [b"ab"] and arrays["output_ids"].tolist() == [7, 9]


def test_a_response_builds_only_the_outputs_the_client_requested():
    """Triton drops every output the client did not request: those are not built at all."""
    sample = SampleOutput(0, "ab", [7, 9], None, 5, None, -1.1, None)
    wanted = frozenset({"num_output_tokens", "finish_reason"})
    requested = frozenset({"text_output", "num_output_tokens", "logprobs"})
    arrays = response_arrays(output([sample]), [sample], wanted, text_of, requested=requested)
    assert set(arrays) == {"text_output", "num_output_tokens"}  # logprobs was requested but not asked for
    assert arrays["text_output"].tolist() == [b"ab"] and arrays["num_output_tokens"].tolist() == [2]
    assert set(response_arrays(output([sample]), [sample], wanted, text_of, requested=None)) == ALWAYS | wanted
    ids_only = response_arrays(output([sample]), [sample], frozenset(), text_of, requested=frozenset({"output_ids"}))
    assert list(ids_only) == ["output_ids"] and ids_only["output_ids"].tolist() == [7, 9]


def test_null_logprobs_finish_reasons_and_samples_side_by_side():
    done = SampleOutput(0, "x", [3], FinishReason.STOP, 1, None, -0.5)
    cut = SampleOutput(1, "yz", [4, 5], FinishReason.LENGTH, 2, None, -0.7)
    arrays = response_arrays(output([done, cut]), [done, cut], frozenset(OPTIONAL_OUTPUTS), text_of, prefix="P: ")
    assert arrays["logprobs"].tolist() == [b"null", b"null"]  # return_logprobs without `logprobs`
    assert arrays["finish_reason"].tolist() == [b"stop", b"length"]
    assert arrays["num_output_tokens"].tolist() == [1, 2] and arrays["sample_index"].tolist() == [0, 1]
    assert arrays["text_output"].tolist() == [b"P: x", b"P: yz"]
    assert arrays["output_ids"].tolist() == [[3, -1], [4, 5]]


def test_generation_logits_of_several_samples_pad_with_nan():
    short = SampleOutput(0, "x", [3], FinishReason.STOP, 1, None, None, [torch.full((4,), 2.0)])
    long = SampleOutput(1, "yz", [4, 5], FinishReason.LENGTH, 2, None, None, [torch.ones(4), torch.zeros(4)])
    arrays = response_arrays(output([short, long]), [short, long], frozenset({"generation_logits"}), text_of)
    logits = arrays["generation_logits"]
    assert logits.shape == (2, 2, 4) and logits[0, 0].tolist() == [2.0] * 4 and np.isnan(logits[0, 1]).all()
    assert logits[1].tolist() == [[1.0] * 4, [0.0] * 4]


def test_token_texts_decode_each_token_once():
    class Tokenizer:
        calls = 0

        def decode(self, ids, skip_special_tokens, clean_up_tokenization_spaces):
            Tokenizer.calls += 1
            return "" if skip_special_tokens and ids == [2] else f"t{ids[0]}"

    texts = TokenTexts(Tokenizer())
    assert [texts(5), texts(5), texts(2), texts(2, False)] == ["t5", "t5", "", "t2"]
    assert Tokenizer.calls == 3


# ---------------------------------------------------------------------------------------- engine


def stream(engine: LLMEngine, params: SamplingParams, track: bool) -> list[SampleOutput]:
    request = engine.build_request(
        f"r{id(params)}{track}", "The quick brown fox jumps", params, stream=True, tracks_cumulative_logprob=track
    )
    engine.add_request(request)
    samples = []
    for _ in range(500):
        if not engine.has_work():
            break
        samples += [s for out in engine.step() for s in out.samples]
    assert not engine.has_work()
    return samples


@pytest.mark.parametrize("spec", [{}, {"draft_model": "self", "num_speculative_tokens": 3, "draft_dtype": "float32"}])
def test_cumulative_logprob_is_the_running_sum_per_sample(make_engine, spec):
    engine = make_engine(seed=1, **spec)
    drafted = engine.metrics.total("llm_spec_decode_num_draft_tokens_total")
    params = dict(n=2, seed=5, temperature=1.0, max_tokens=8, ignore_eos=True)
    with_logprobs = stream(engine, SamplingParams(logprobs=0, **params), track=False)
    tracked_only = stream(engine, SamplingParams(**params), track=True)
    assert {s.sample_index for s in with_logprobs} == {0, 1}
    totals = {0: 0.0, 1: 0.0}
    for sample in with_logprobs:
        totals[sample.sample_index] += sum(e["logprob"] for e in sample.logprobs)
        assert sample.cumulative_logprob == pytest.approx(totals[sample.sample_index], abs=1e-6)
    assert [s.logprobs for s in tracked_only] == [None] * len(tracked_only)
    final = {s.sample_index: s.cumulative_logprob for s in tracked_only}
    assert final == pytest.approx(totals, abs=1e-5)  # same seed, same tokens, same sums
    if spec:
        assert engine.metrics.total("llm_spec_decode_num_draft_tokens_total") > drafted
    untracked = stream(engine, SamplingParams(**params), track=False)
    assert all(s.cumulative_logprob is None for s in untracked)


# ---------------------------------------------------------------------------------------- front door


class _Result:
    def __init__(self, arrays):
        self.arrays = arrays

    def as_numpy(self, name):
        return self.arrays.get(name)


def test_the_front_door_reads_the_vllm_shapes_back():
    totals: dict[int, int] = {}
    first = SampleOutput(
        1, "ab", [7, 9], None, 2, [entry(7, -0.1, 1, {7: -0.1, 3: -2.0}), entry(9, -3.0, 5, {4: -0.5, 6: -0.9})]
    )
    last = SampleOutput(1, "c", [8], FinishReason.LENGTH, 3, [entry(8, -0.2, 1, {8: -0.2, 4: -2.2})])
    wanted = frozenset(OPTIONAL_OUTPUTS)
    deltas = [
        d
        for s in (first, last)
        for d in _deltas(_Result(response_arrays(output([s]), [s], wanted, text_of)), 2, None, totals)
    ]
    assert [
        (d.index, d.text, d.token_ids, d.num_output_tokens, d.finish_reason, d.num_input_tokens) for d in deltas
    ] == [(1, "ab", [7, 9], 2, None, 4), (1, "c", [8], 3, "length", 4)]
    assert deltas[0].logprobs == [
        {"token_id": 7, "logprob": -0.1, "top_logprobs": {7: -0.1, 3: -2.0}},
        {"token_id": 9, "logprob": -3.0, "top_logprobs": {4: -0.5, 6: -0.9}},
    ]
    plain = _deltas(_Result(response_arrays(output([last]), [last], wanted - {"logprobs"}, text_of)), None, None, {})
    assert plain[0].logprobs is None and plain[0].prompt_logprobs is None


def test_prompt_logprobs_go_out_once_in_vllm_shape_and_come_back():
    """The prompt's logprobs: JSON null in every response but the one carrying them; the front door reads each
    position's token from its first key."""
    sample = SampleOutput(0, "a", [7], None, 1, None)
    scored = [None, entry(5, -1.5, 3, {2: -0.5, 5: -1.5}), entry(6, -0.25, 1, {6: -0.25, 2: -2.0})]
    carrying = RequestOutput("r", [sample], 3, False, None, 1, scored, stats=RequestStats())
    arrays = response_arrays(carrying, [sample], frozenset({"prompt_logprobs"}), text_of)
    assert json.loads(arrays["prompt_logprobs"][0]) == [
        None,
        {
            "5": {"logprob": -1.5, "rank": 3, "decoded_token": "<5>"},
            "2": {"logprob": -0.5, "rank": 1, "decoded_token": "<2>"},
        },
        {
            "6": {"logprob": -0.25, "rank": 1, "decoded_token": "<6>"},
            "2": {"logprob": -2.0, "rank": 2, "decoded_token": "<2>"},
        },
    ]
    assert response_arrays(output([sample]), [sample], frozenset({"prompt_logprobs"}), text_of)[
        "prompt_logprobs"
    ].tolist() == [b"null"]
    (delta,) = _deltas(_Result(response_arrays(carrying, [sample], frozenset(OPTIONAL_OUTPUTS), text_of)), None, 1, {})
    assert delta.prompt_logprobs == [
        None,
        {"token_id": 5, "logprob": -1.5, "top_logprobs": {2: -0.5}},
        {"token_id": 6, "logprob": -0.25, "top_logprobs": {6: -0.25}},
    ]
