"""Draft proposers: n-gram lookup rules; suffix decoding over the request and the outputs of finished ones."""

import json

import pytest

from backend.core.config import ConfigError, EngineConfig
from backend.spec.proposers import NgramProposer
from backend.spec.suffix_proposer import SuffixProposer


@pytest.mark.parametrize(
    "tokens, k, expected",
    [
        ([1, 2, 3, 4, 1, 2], 2, [3, 4]),  # continue after the earlier "1 2"
        ([1, 2, 3, 1, 2, 9, 1, 2], 3, [9, 1, 2]),  # the latest match wins
        ([5, 6, 7, 8], 3, []),  # no earlier occurrence of the tail
        ([7, 1, 2, 3, 9, 2, 3], 2, [9, 2]),  # the longest n that matches (n=2: "2 3")
        ([4, 4, 4], 5, [4]),  # a continuation shorter than k is fine
    ],
)
def test_ngram_lookup(tokens, k, expected):
    assert NgramProposer(1, 4).lookup(tokens, k) == expected


def test_ngram_respects_min_n():
    assert NgramProposer(2, 4).lookup([1, 2, 3, 9, 1], 2) == []
    assert NgramProposer(1, 4).lookup([1, 2, 3, 9, 1], 2) == [2, 3]


class FakeSeq:
    """What SuffixProposer reads of a Sequence."""

    def __init__(self, seq_id, prompt, output=()):
        self.seq_id, self.token_ids, self.num_prompt_tokens = seq_id, [*prompt, *output], len(prompt)

    @property
    def num_output_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens


def suffix(**overrides) -> SuffixProposer:
    settings = dict(max_depth=24, min_token_prob=0.1, spec_factor=1.0, cache_tokens=1000)
    return SuffixProposer(**{**settings, **overrides})


def test_suffix_continues_the_request_s_own_prompt():
    proposer = suffix()
    seq = FakeSeq(1, [5, 1, 2, 3, 4, 6, 7, 8, 0, 1, 2, 3])
    assert proposer.match(seq, 4).tokens == [4, 6, 7]  # a 3-token match drafts 3 (spec_factor 1)
    seq.token_ids += [4, 6]  # accepted: the index catches up incrementally
    assert proposer.match(seq, 4).tokens == [7, 8, 0, 1]


def test_suffix_learns_from_finished_requests_and_drops_their_state():
    proposer = suffix()
    template = [40, 41, 42, 43, 44, 45]
    done = FakeSeq(1, [9, 90, 91], [*template, 2])
    proposer.match(done, 4)
    assert 1 in proposer.indexes
    proposer.finish([done])
    assert proposer.indexes == {} and len(proposer.cache) == 1
    new = FakeSeq(2, [8, 8, 90, 91])  # another prompt, the same ending: the template is drafted from its start
    assert proposer.match(new, 4).tokens == [40, 41]
    new.token_ids += [40, 41, 42, 43]
    assert proposer.match(new, 4).tokens == [44, 45, 2]


def test_suffix_without_a_global_store_uses_the_request_alone():
    proposer = suffix(cache_tokens=0)
    done = FakeSeq(1, [90, 91], [40, 41, 42])
    proposer.finish([done])
    assert proposer.cache is None
    assert proposer.match(FakeSeq(2, [90, 91]), 4).tokens == []


def test_suffix_prefers_the_more_probable_of_its_two_lookups():
    proposer = suffix(spec_factor=4.0)
    for value in (50, 50, 50):
        proposer.finish([FakeSeq(value, [90, 91], [1, 2, value, 51])])
    own = FakeSeq(9, [1, 2, 60, 61, 5, 1, 2, 62, 63, 0, 1, 2])  # its prompt: 60 or 62; three earlier outputs: 50
    assert proposer.match(own, 2).tokens == [50, 51]
    assert suffix(cache_tokens=0, spec_factor=4.0).match(own, 2).tokens == [62, 63]  # a tie: the latest


def test_suffix_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    base = {"model": str(tmp_path), "draft_model": "suffix", "num_speculative_tokens": "8"}
    config = EngineConfig.from_parameters(base, base_dir=tmp_path)
    assert (config.draft_model, config.speculative) == ("suffix", True)  # no model folder looked for
    settings = {"suffix_max_depth": "12", "suffix_min_token_prob": "0.25", "suffix_cache_tokens": "0"}
    config = EngineConfig.from_parameters({**base, **settings, "suffix_spec_factor": "2"})
    assert (config.suffix_max_depth, config.suffix_min_token_prob, config.suffix_cache_tokens) == (12, 0.25, 0)
    for name, value in (
        ("suffix_max_depth", "1"),
        ("suffix_min_token_prob", "1.5"),
        ("suffix_spec_factor", "-1"),
        ("suffix_cache_tokens", "-5"),
    ):
        with pytest.raises(ConfigError, match=f"'{name}' must be between"):
            EngineConfig.from_parameters({**base, name: value})
