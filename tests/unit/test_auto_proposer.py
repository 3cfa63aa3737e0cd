"""draft_model auto: per sequence the draft worth its verification (suffix decoding's, the head's, or none), from
each source's measured acceptance and what a drafted token costs."""

import json

import pytest

from backend.core.config import ConfigError, EngineConfig
from backend.core.runner_output import ModelRunnerOutput
from backend.core.scheduler_output import Draft
from backend.spec.auto_proposer import AutoProposer
from backend.spec.proposers import Proposer
from backend.spec.suffix_proposer import SuffixProposer
from tests.unit.test_proposers import FakeSeq


class FakeHead(Proposer):
    """A head that drafts the tokens 7, 8, 9, ... and records what it was asked."""

    config = {"trained_with": {"heldout_agreement_by_step": [0.8, 0.6]}}

    def __init__(self):
        self.asked, self.observed, self.finished = [], 0, []

    def propose(self, requests):
        self.asked.append([(seq.seq_id, k) for seq, k in requests])
        return [Draft(list(range(7, 7 + k))) for _, k in requests]

    def observe(self, output):
        self.observed += 1

    def finish(self, seqs):
        self.finished += [seq.seq_id for seq in seqs]


def auto(head=None, row_cost=0.3, head_token_cost=0.2) -> AutoProposer:
    return AutoProposer(SuffixProposer(24, 0.1, 1.0, 1000), head, row_cost, head_token_cost)


def verified(seq_id: int, accepted: int) -> ModelRunnerOutput:
    return ModelRunnerOutput(num_accepted={seq_id: accepted})


COPYING = [5, 1, 2, 3, 4, 6, 7, 8, 0, 1, 2, 3]  # its end repeats: suffix decoding drafts [4, 6, 7]


def test_a_confident_suffix_draft_wins_and_the_head_is_not_asked():
    head = FakeHead()
    proposer = auto(head)
    assert proposer.propose([(FakeSeq(1, COPYING), 3)]) == [Draft([4, 6, 7])]
    assert head.asked == [] and proposer.picks == {"suffix": 1, "head": 0, "none": 0}


def test_the_head_drafts_where_suffix_decoding_has_nothing_its_chain_cut_where_it_stops_paying():
    head = FakeHead()
    proposer = auto(head)  # a = 0.8 (held-out agreement): 0.8, 0.64 pay for 0.5 a token, 0.512 pays, 0.41 does not
    (draft,) = proposer.propose([(FakeSeq(2, [10, 11, 12, 13]), 4)])
    assert draft == Draft([7, 8, 9]) and head.asked == [[(2, 3)]]
    proposer.observe(verified(2, 0))  # rejected at the first token twice: a falls 0.8 -> 0.56 -> 0.39
    proposer.propose([(FakeSeq(2, [10, 11, 12, 13]), 4)])
    proposer.observe(verified(2, 0))
    assert proposer.propose([(FakeSeq(2, [10, 11, 12, 13]), 4)]) == [Draft([])]  # nothing pays: no draft
    assert proposer.picks["none"] == 1 and head.observed == 2


def test_a_suffix_draft_that_keeps_failing_is_no_longer_sent():
    proposer = auto()
    for _ in range(8):
        (draft,) = proposer.propose([(FakeSeq(3, COPYING), 3)])
        if not draft.token_ids:
            break
        proposer.observe(verified(3, 0))
    else:
        raise AssertionError("a suffix draft rejected eight times is still sent")
    assert proposer.choices[3].suffix_calibration < 0.3


def test_without_a_head_auto_is_suffix_decoding_priced_by_its_cost():
    cheap, dear = auto(row_cost=0.0), auto(row_cost=1.0)  # a row as dear as a step: no draft can pay
    assert cheap.propose([(FakeSeq(4, COPYING), 3)]) == [Draft([4, 6, 7])]
    assert dear.propose([(FakeSeq(4, COPYING), 3)]) == [Draft([])]


def test_finish_forgets_the_sequence_in_both_sources():
    head = FakeHead()
    proposer = auto(head)
    seq = FakeSeq(5, [10, 11, 12, 13], [14])
    proposer.propose([(seq, 2)])
    proposer.finish([seq])
    assert proposer.choices == {} and head.finished == [5] and len(proposer.suffix.cache) == 1


def test_auto_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    base = {"model": str(tmp_path), "draft_model": "auto", "num_speculative_tokens": "4"}
    config = EngineConfig.from_parameters({**base, "draft_head": str(tmp_path), "spec_row_cost": "0.5"})
    assert (config.draft_model, config.draft_head, config.spec_row_cost) == ("auto", str(tmp_path), 0.5)
    with pytest.raises(ConfigError, match="'draft_head'.*draft_model is 'suffix'"):
        EngineConfig.from_parameters({**base, "draft_model": "suffix", "draft_head": str(tmp_path)})
    with pytest.raises(ConfigError, match="the folder does not exist"):
        EngineConfig.from_parameters({**base, "draft_head": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="'spec_head_token_cost' must be between"):
        EngineConfig.from_parameters({**base, "spec_head_token_cost": "-1"})
