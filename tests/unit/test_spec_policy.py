"""backend/spec/policy.py: the adaptive draft length per sequence (grows on acceptance, shrinks and turns off on
rejection, re-probes), as SpeculativeDecoder applies it under the request's own k, the remaining output and the
batch rule; and its engine parameters."""

import json
from types import SimpleNamespace

import pytest

from backend.core.config import ConfigError, EngineConfig
from backend.spec.decoder import SpeculativeDecoder
from backend.spec.policy import INITIAL_K, AdaptivePolicy


class FakeSeq:
    """What the policy and SpeculativeDecoder.num_draft_tokens read of a Sequence."""

    def __init__(self, max_tokens=100, num_speculative_tokens=None, num_output_tokens=0, num_tokens=10):
        self.params = SimpleNamespace(max_tokens=max_tokens, num_speculative_tokens=num_speculative_tokens)
        self.num_output_tokens = num_output_tokens
        self.num_tokens = num_tokens


def policy(max_k=4, min_acceptance=0.3, probe_interval=4) -> AdaptivePolicy:
    return AdaptivePolicy(max_k, min_acceptance, probe_interval)


def step(p: AdaptivePolicy, seq, accepted: int | None = None, cap: int = 4) -> int:
    """One decode step: ask for a draft length; verify it with `accepted` accepted (None: all of them)."""
    k = p.draft_length(seq, cap)
    if k:
        p.observe(seq, k, k if accepted is None else min(accepted, k))
    return k


def turn_off(p: AdaptivePolicy, seq) -> None:
    """Rejected drafts until the policy stops drafting (it must, within a few steps)."""
    for _ in range(10):
        if not p.state(seq).k:
            return
        step(p, seq, accepted=0)
    pytest.fail("rejected drafts never turned speculation off")


def test_k_grows_to_the_max_while_drafts_are_accepted():
    p, seq = policy(max_k=4), FakeSeq()
    assert [step(p, seq) for _ in range(5)] == [INITIAL_K, 3, 4, 4, 4]


def test_a_proposer_that_sizes_its_drafts_is_asked_for_the_cap_while_on():
    p, seq = AdaptivePolicy(4, 0.3, 4, full_length=True), FakeSeq()
    assert step(p, seq) == 4  # from the first draft
    assert step(p, seq, accepted=1) == 4
    assert p.state(seq).k == 4  # a partly rejected draft does not shorten the next
    turn_off(p, seq)  # mostly rejected drafts still switch it off
    assert [step(p, seq) for _ in range(4)] == [0, 0, 0, 1]  # a probe, accepted: back to the cap
    assert step(p, seq) == 4


def test_k_shrinks_to_the_accepted_length_plus_one():
    p, seq = policy(max_k=4), FakeSeq()
    for _ in range(3):
        step(p, seq)
    assert p.state(seq).k == 4
    step(p, seq, accepted=2)
    assert p.state(seq).k == 3
    step(p, seq, accepted=0)
    assert p.state(seq).k == 1


def test_speculation_turns_off_when_acceptance_is_low_and_stays_off_between_probes():
    p, seq = policy(probe_interval=4), FakeSeq()
    assert [step(p, seq, accepted=0) for _ in range(2)] == [INITIAL_K, 1]
    assert p.state(seq).k == 0 and p.state(seq).rate < 0.3  # off after two fully rejected drafts
    assert [p.draft_length(seq, 4) for _ in range(3)] == [0, 0, 0]  # plain decodes until the probe


def test_probe_every_interval_turns_it_back_on_when_accepted():
    p, seq = policy(probe_interval=4), FakeSeq()
    turn_off(p, seq)
    # a rejected probe: one draft token, once per interval
    assert [step(p, seq, accepted=0) for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]
    assert p.state(seq).k == 0
    # the output starts copying: the next probe is accepted, and k grows again
    assert [step(p, seq) for _ in range(6)] == [0, 0, 0, 1, 2, 3]


def test_a_probe_without_a_draft_is_retried_next_step():
    p, seq = policy(probe_interval=3), FakeSeq()
    turn_off(p, seq)
    assert [p.draft_length(seq, 4) for _ in range(3)] == [0, 0, 1]
    # the proposer found nothing (no observe): the next step probes again rather than waiting an interval
    assert p.draft_length(seq, 4) == 1


def test_cap_bounds_the_draft_and_zero_cap_asks_nothing():
    p, seq = policy(max_k=4), FakeSeq()
    for _ in range(4):
        step(p, seq)
    assert p.draft_length(seq, 2) == 2
    assert p.draft_length(seq, 0) == 0
    assert p.state(seq).k == 4  # a capped step does not forget what the sequence earned


def test_sequences_have_their_own_state_and_it_goes_with_them():
    p, copying, chatting = policy(), FakeSeq(), FakeSeq()
    for _ in range(4):
        step(p, copying)
        step(p, chatting, accepted=0)
    assert p.state(copying).k == 4 and p.state(chatting).k == 0
    del copying
    assert len(p._states) == 1  # kept weakly: a finished sequence leaves no state behind


# ---------------------------------------------------------------------------- in SpeculativeDecoder


def decoder(**overrides) -> SpeculativeDecoder:
    settings = dict(
        model="unused", draft_model="ngram", num_speculative_tokens=4, spec_adaptive=True, spec_probe_interval=4
    )
    config = EngineConfig(**{**settings, **overrides})
    return SpeculativeDecoder(config, None, None, None, max_model_len=1000)


def test_adaptive_respects_the_requests_own_k():
    spec, seq = decoder(), FakeSeq(num_speculative_tokens=2)
    for _ in range(6):
        k = spec.num_draft_tokens(seq)
        spec.policy.observe(seq, k, k)
        assert k <= 2
    assert k == 2
    assert spec.num_draft_tokens(FakeSeq(num_speculative_tokens=0)) == 0


def test_adaptive_respects_the_remaining_max_tokens():
    spec, seq = decoder(), FakeSeq(max_tokens=20)
    for _ in range(4):
        spec.policy.observe(seq, 4, 4)
    seq.num_output_tokens = 17  # 3 tokens left: the bonus token is one of them
    assert spec.num_draft_tokens(seq) == 2
    seq.num_output_tokens = 19
    assert spec.num_draft_tokens(seq) == 0


def test_without_adaptive_the_configured_k_is_used():
    spec = decoder(spec_adaptive=False)
    assert spec.policy is None
    assert spec.num_draft_tokens(FakeSeq()) == 4


def test_off_for_a_large_batch():
    spec = decoder(spec_max_batch_size=4)
    assert spec.active(4) and not spec.active(5)


# ---------------------------------------------------------------------------- parameters


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(tmp_path)


def test_parameters_parse(model_dir):
    config = EngineConfig.from_parameters(
        {"model": model_dir, "spec_adaptive": "true", "spec_min_acceptance": "0.25", "spec_probe_interval": "16"}
    )
    assert (config.spec_adaptive, config.spec_min_acceptance, config.spec_probe_interval) == (True, 0.25, 16)


@pytest.mark.parametrize(
    "name, raw, fragment",
    [
        ("spec_min_acceptance", "1.5", "'spec_min_acceptance' must be between 0 and 1"),
        ("spec_min_acceptance", "-0.1", "'spec_min_acceptance' must be between 0 and 1"),
        ("spec_min_acceptance", "nan", "'spec_min_acceptance' must be between 0 and 1"),
        ("spec_min_acceptance", "half", "'spec_min_acceptance' must be a number"),
        ("spec_probe_interval", "0", "'spec_probe_interval' must be between 1"),
        ("spec_adaptive", "sometimes", "'spec_adaptive' must be true or false"),
    ],
)
def test_bad_values_name_the_parameter(model_dir, name, raw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        EngineConfig.from_parameters({"model": model_dir, name: raw})
