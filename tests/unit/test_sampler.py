"""backend/sampling/sampler.py: penalties and min_tokens on the logits; temperature, top-k, top-p, min-p on the
distribution; seeded per-sequence draws; logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from backend.core.client_request import ClientRequest
from backend.core.request import Request, Sequence
from backend.protocol.sampling_params import SamplingParams
from backend.sampling.sampler import Sampler, SamplingRow, argmax_rows, take_rows

EOS = 2
VOCAB = 8


def seq_with(prompt=(0, 1), output=(), **params) -> Sequence:
    request = Request(ClientRequest("r", "", list(prompt), SamplingParams(**params)))
    seq = Sequence(request, 0, detokenizer=None)
    request.sequences = [seq]
    seq.token_ids.extend(output)
    return seq


class OneRow:
    """The batched sampler asked about one sequence at a time (a batch of one row), as these tests read it."""

    def __init__(self, sampler: Sampler):
        self.batched = sampler

    def sample(self, logits, seq):
        return self.batched.sample(logits[None], [seq.sampling_row()])[0]

    def probs(self, logits, seq):
        return self.batched.probs(logits[None], [seq.sampling_row()])[0]

    def process_logits(self, logits, seq, context):
        row = SamplingRow(seq.params, list(context), seq.num_prompt_tokens, seq.generator)
        return self.batched.process_logits(logits[None], [row])[0]


@pytest.fixture
def sampler():
    return OneRow(Sampler(VOCAB, {EOS}))


def logits_of(probs) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def draw_many(sampler, logits, seq, n=1500) -> torch.Tensor:
    counts = torch.zeros(logits.shape[-1])
    for _ in range(n):
        counts[sampler.sample(logits, seq)] += 1
    return counts / n


# --------------------------------------------------------------------------------------------- greedy


def test_greedy_is_argmax(sampler):
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(VOCAB, generator=gen) * 3
        seq = seq_with(temperature=0.0, seed=1)
        assert sampler.sample(logits, seq) == int(torch.argmax(logits))
    # greedy ignores top-k/top-p and consumes no randomness
    seq = seq_with(temperature=0.0, top_k=1, top_p=0.1)
    state = seq.generator.get_state()
    assert sampler.sample(torch.tensor([0.0, 5, 1, 0, 0, 0, 0, 0]), seq) == 1
    assert torch.equal(seq.generator.get_state(), state)


def test_greedy_respects_penalties(sampler):
    logits = torch.tensor([0.0, 3.0, 2.9, 0, 0, 0, 0, 0])
    seq = seq_with(prompt=(0,), output=(1,), temperature=0.0, presence_penalty=0.5)
    assert sampler.sample(logits, seq) == 2


# ------------------------------------------------------------------------------------------ the support


def test_top_k_restricts_support(sampler):
    logits = torch.tensor([1.0, 3.0, 0.5, 2.0, 2.5, -1.0, 0.0, 1.5])
    seq = seq_with(top_k=3, seed=7)
    probs = sampler.probs(logits, seq)
    assert set(torch.nonzero(probs).flatten().tolist()) == {1, 3, 4}
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    expected = torch.softmax(logits[[1, 3, 4]], dim=-1)
    assert torch.allclose(probs[[1, 3, 4]], expected, atol=1e-6)
    freq = draw_many(sampler, logits, seq)
    assert set(torch.nonzero(freq).flatten().tolist()) <= {1, 3, 4}
    assert torch.allclose(freq[[1, 3, 4]], expected, atol=0.05)


@pytest.mark.parametrize("top_k", [0, -1, VOCAB, VOCAB + 5])
def test_top_k_off(sampler, top_k):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    probs = sampler.probs(logits, seq_with(top_k=top_k))
    assert torch.allclose(probs, torch.softmax(logits, -1), atol=1e-6)


def test_top_p_restricts_support(sampler):
    logits = logits_of([0.05, 0.5, 0.15, 0.3, 1e-9, 1e-9, 1e-9, 1e-9])
    seq = seq_with(top_p=0.7, seed=11)
    probs = sampler.probs(logits, seq)
    # sorted: 0.5, 0.3 (cumulative 0.8 >= 0.7) -> keep those two only
    assert set(torch.nonzero(probs).flatten().tolist()) == {1, 3}
    assert torch.allclose(probs[[1, 3]], torch.tensor([0.625, 0.375]), atol=1e-5)
    freq = draw_many(sampler, logits, seq)
    assert set(torch.nonzero(freq).flatten().tolist()) <= {1, 3}
    assert abs(float(freq[1]) - 0.625) < 0.05


def test_top_p_keeps_at_least_the_top_token(sampler):
    logits = logits_of([0.9, 0.05, 0.05, 1e-9, 1e-9, 1e-9, 1e-9, 1e-9])
    probs = sampler.probs(logits, seq_with(top_p=0.01))
    assert torch.nonzero(probs).flatten().tolist() == [0] and float(probs[0]) == pytest.approx(1.0)


def test_top_p_exact_boundary_keeps_the_smallest_set(sampler):
    logits = logits_of([0.5, 0.25, 0.25, 1e-30, 1e-30, 1e-30, 1e-30, 1e-30])
    assert float(torch.softmax(logits, -1)[0]) == 0.5  # exactly representable: the boundary is exact
    probs = sampler.probs(logits, seq_with(top_p=0.5))
    assert torch.nonzero(probs).flatten().tolist() == [0]


def test_min_p_restricts_support(sampler):
    logits = logits_of([0.5, 0.3, 0.15, 0.04, 0.01, 1e-9, 1e-9, 1e-9])
    seq = seq_with(min_p=0.2, seed=5)  # threshold: 0.2 * 0.5 = 0.1
    probs = sampler.probs(logits, seq)
    assert set(torch.nonzero(probs).flatten().tolist()) == {0, 1, 2}
    assert torch.allclose(probs[[0, 1, 2]], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=1e-5)
    freq = draw_many(sampler, logits, seq, n=800)
    assert set(torch.nonzero(freq).flatten().tolist()) <= {0, 1, 2}


def test_top_k_and_min_p_combine(sampler):
    logits = logits_of([0.3, 0.25, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01])
    probs = sampler.probs(logits, seq_with(top_k=4, min_p=0.5))
    # top-k: 0..3; min-p: at least half the top probability (0.15) -> 0..2
    assert set(torch.nonzero(probs).flatten().tolist()) == {0, 1, 2}
    assert torch.allclose(probs[:3], torch.tensor([0.3, 0.25, 0.2]) / 0.75, atol=1e-5)


def test_top_p_after_top_k_uses_the_renormalised_distribution(sampler):
    logits = logits_of([0.3, 0.25, 0.2, 0.1, 0.08, 0.04, 0.02, 0.01])
    probs = sampler.probs(logits, seq_with(top_k=4, top_p=0.6))
    # after top-k: 0.353, 0.294, 0.235, 0.118; the first two already reach 0.6
    assert set(torch.nonzero(probs).flatten().tolist()) == {0, 1}


def test_temperature(sampler):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0, 0, 0, 0])
    cold = sampler.probs(logits, seq_with(temperature=0.5))
    warm = sampler.probs(logits, seq_with(temperature=2.0))
    assert torch.allclose(cold, torch.softmax(logits / 0.5, -1), atol=1e-6)
    assert torch.allclose(warm, torch.softmax(logits / 2.0, -1), atol=1e-6)

    def entropy(p):
        return float(-(p * torch.log(p)).sum())

    assert entropy(cold) < entropy(torch.softmax(logits, -1)) < entropy(warm)
    assert float(cold[0]) > float(warm[0])
    tiny = sampler.probs(logits, seq_with(temperature=1e-3))
    assert float(tiny[0]) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------- penalties


def test_repetition_penalty(sampler):
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0, 0.0, 0.0])
    seq = seq_with(prompt=(0, 1), output=(4, 4), repetition_penalty=2.0)
    before = logits.clone()
    out = sampler.process_logits(logits, seq, seq.token_ids)
    assert torch.equal(logits, before)  # the input is not modified
    assert out[0] == 1.0  # positive, seen in the prompt: divided
    assert out[1] == -4.0  # negative, seen in the prompt: multiplied
    assert out[4] == 0.25  # seen in the output (twice: still once)
    for unseen in (2, 3, 5, 6, 7):
        assert out[unseen] == logits[unseen]


def test_presence_and_frequency_penalties(sampler):
    logits = torch.zeros(VOCAB)
    seq = seq_with(prompt=(5, 5, 6), output=(1, 1, 1, 3), presence_penalty=0.5, frequency_penalty=0.25)
    out = sampler.process_logits(logits, seq, seq.token_ids)
    assert out[1] == pytest.approx(-(0.5 + 3 * 0.25))
    assert out[3] == pytest.approx(-(0.5 + 1 * 0.25))
    assert out[5] == 0 and out[6] == 0  # prompt tokens are not penalised by presence/frequency
    assert out[0] == 0 and out[7] == 0
    negative = seq_with(prompt=(5,), output=(1,), presence_penalty=-1.0)
    assert sampler.process_logits(logits, negative, negative.token_ids)[1] == 1.0  # a negative one encourages


def test_penalties_use_the_given_context(sampler):
    """process_logits takes the context explicitly (speculative verification scores several positions)."""
    seq = seq_with(prompt=(0,), output=(3, 3), frequency_penalty=1.0)
    out = sampler.process_logits(torch.zeros(VOCAB), seq, [0, 3])
    assert out[3] == -1.0


def test_no_penalty_leaves_logits_alone(sampler):
    logits = torch.randn(VOCAB)
    seq = seq_with(output=(1, 2, 3))
    assert torch.equal(sampler.process_logits(logits, seq, seq.token_ids), logits)


# ---------------------------------------------------------------------------------------- min_tokens


def test_min_tokens_bans_eos_and_stop_token_ids(sampler):
    logits = torch.tensor([0.0, 0.0, 10.0, 0.0, 9.0, 0.0, 0.0, 0.0])
    seq = seq_with(output=(1,), min_tokens=3, stop_token_ids=[4], temperature=0.0)
    out = sampler.process_logits(logits, seq, seq.token_ids)
    assert out[EOS] == float("-inf") and out[4] == float("-inf")
    assert sampler.sample(logits, seq) not in (EOS, 4)
    sampled = seq_with(output=(1,), min_tokens=3, seed=0)
    freq = draw_many(sampler, logits, sampled, n=200)
    assert freq[EOS] == 0
    # once min_tokens outputs exist, EOS is allowed again
    done = seq_with(output=(1, 1, 1), min_tokens=3, stop_token_ids=[4], temperature=0.0)
    assert sampler.sample(logits, done) == EOS


def test_min_tokens_with_ignore_eos_bans_only_stop_ids(sampler):
    logits = torch.tensor([0.0, 0.0, 10.0, 0.0, 9.0, 0.0, 0.0, 0.0])
    seq = seq_with(min_tokens=2, ignore_eos=True, stop_token_ids=[4], temperature=0.0)
    out = sampler.process_logits(logits, seq, seq.token_ids)
    assert out[EOS] == 10.0 and out[4] == float("-inf")


# ---------------------------------------------------------------------------------------- bad words


def test_a_one_token_bad_word_is_never_taken(sampler):
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0, 9.0, 5.0, 0.0, 0.0])
    seq = seq_with(output=(1,), bad_word_ids=[[4]], temperature=0.0)
    assert sampler.process_logits(logits, seq, seq.token_ids)[4] == float("-inf")
    assert sampler.sample(logits, seq) == 5


def test_a_longer_bad_word_bans_its_last_token_only_after_the_rest(sampler):
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0, 9.0, 5.0, 0.0, 0.0])
    seq = seq_with(prompt=(0,), output=(6, 3), bad_word_ids=[[6, 3, 4]])
    assert sampler.process_logits(logits, seq, [0, 6, 3])[4] == float("-inf")
    assert sampler.process_logits(logits, seq, [0, 3, 3])[4] == 9.0  # the word's other tokens not all there
    assert sampler.process_logits(logits, seq, [3])[4] == 9.0  # a context shorter than the word's prefix


def test_verification_rows_ban_after_their_draft_prefix(sampler):
    """A draft row's context holds the drafts before it, so a bad word completed by a draft token is banned at
    the next position, as plain sampling would ban it."""
    logits = torch.zeros(VOCAB)
    seq = seq_with(prompt=(0,), bad_word_ids=[[5, 4]])
    row = seq.sampling_row(drafts=[5])
    assert row.context[-1] == 5
    out = sampler.batched.process_logits(logits[None], [row])[0]
    assert out[4] == float("-inf")


# ---------------------------------------------------------------------------------------- randomness


def test_draw_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[Sampler.draw(probs, gen)] += 1
    freq = counts / 4000
    assert counts[3] == 0
    assert torch.allclose(freq, probs, atol=0.03)


def test_same_seed_same_tokens(sampler):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(9))

    def tokens(seed, other_draws=0):
        seq = seq_with(seed=seed, temperature=1.0)
        noise = seq_with(seed=seed + 1)
        out = []
        for _ in range(30):
            for _ in range(other_draws):  # another sequence drawing in the same batch
                sampler.sample(logits, noise)
            out.append(sampler.sample(logits, seq))
        return out

    first = tokens(42)
    assert tokens(42) == first
    assert tokens(42, other_draws=3) == first  # reproducible whatever else shares the batch
    assert tokens(43) != first
    assert len(set(first)) > 1  # it really samples


def test_samples_of_one_request_draw_differently():
    request = Request(ClientRequest("r", "", [0, 1], SamplingParams(seed=5)))
    a, b = Sequence(request, 0, None), Sequence(request, 1, None)
    assert request.seed_for(0) != request.seed_for(1)
    sampler = OneRow(Sampler(VOCAB, {EOS}))
    logits = torch.zeros(VOCAB)
    assert [sampler.sample(logits, a) for _ in range(20)] != [sampler.sample(logits, b) for _ in range(20)]


def test_unseeded_requests_use_the_base_seed():
    r1 = ClientRequest("a", "", [0], SamplingParams(), base_seed=17)
    r2 = ClientRequest("b", "", [0], SamplingParams(), base_seed=17)
    r3 = ClientRequest("c", "", [0], SamplingParams(seed=17))
    assert r1.seed_for(0) == r2.seed_for(0) == r3.seed_for(0) == 17
    assert 0 <= ClientRequest("d", "", [0], SamplingParams(seed=2**64 - 1)).seed_for(7) < 2**63


# ------------------------------------------------------------------------------------------ logprobs


def logprobs(logits: torch.Tensor, token_id: int, top: int) -> dict:
    return Sampler.logprobs_rows(logits[None], [token_id], top)[0]


def test_logprobs(sampler):
    logits = torch.tensor([1.0, 3.0, 0.5, 2.0, -1.0, 0.0, 0.0, 0.0])
    logp = torch.log_softmax(logits, -1)
    entry = logprobs(logits, 2, 3)
    assert entry["token_id"] == 2
    assert entry["logprob"] == pytest.approx(float(logp[2]))
    assert entry["rank"] == 4 and logprobs(logits, 1, 0)["rank"] == 1  # 1: the most likely token
    assert list(entry["top_logprobs"]) == [1, 3, 0]
    assert entry["top_logprobs"][1] == pytest.approx(float(logp[1]))
    assert all(isinstance(k, int) and isinstance(v, float) for k, v in entry["top_logprobs"].items())
    assert "top_logprobs" not in logprobs(logits, 1, 0)
    assert math.isclose(sum(math.exp(v) for v in torch.log_softmax(logits, -1).tolist()), 1.0, rel_tol=1e-6)


# ------------------------------------------------------------------------------------------------- batches

MIXED_ROWS = [
    dict(temperature=0.0),
    dict(temperature=0.8, top_k=3, seed=1),
    dict(temperature=1.2, top_p=0.6, seed=2),
    dict(temperature=1.0, min_p=0.3, seed=3),
    dict(temperature=0.0, repetition_penalty=1.5),
    dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.25, seed=4),
    dict(temperature=1.0, logit_bias={3: 5.0, 5: -100.0}, seed=5),
    dict(temperature=1.0, top_k=4, top_p=0.8, min_p=0.1, min_tokens=5, stop_token_ids=[6], seed=6),
    dict(temperature=0.0, min_tokens=4, logit_bias={2: 100.0}),
]


def test_a_batch_samples_each_row_as_if_alone():
    """The whole batch in one call: every row's processed logits, distribution and token (its seeded draws
    included) equal that row's in a batch of one, whatever its neighbours ask for."""
    sampler = Sampler(VOCAB, {EOS})
    logits = torch.randn(len(MIXED_ROWS), VOCAB, generator=torch.Generator().manual_seed(9)) * 2

    def row_of(i, params):
        return seq_with(prompt=(0, 1, 4), output=(4, 2), **params).sampling_row()

    batch = [row_of(i, p) for i, p in enumerate(MIXED_ROWS)]
    alone = [row_of(i, p) for i, p in enumerate(MIXED_ROWS)]
    processed = sampler.process_logits(logits, batch)
    sampled = [i for i, p in enumerate(MIXED_ROWS) if p["temperature"] > 0]
    probs = sampler.probs(processed[sampled], [batch[i] for i in sampled])
    for i, row in enumerate(alone):
        assert torch.equal(processed[i], sampler.process_logits(logits[i : i + 1], [row])[0]), MIXED_ROWS[i]
    for j, i in enumerate(sampled):
        assert torch.equal(probs[j], sampler.probs(processed[i : i + 1], [alone[i]])[0]), MIXED_ROWS[i]
    batch = [row_of(i, p) for i, p in enumerate(MIXED_ROWS)]  # fresh generators: the same seeds again
    alone = [row_of(i, p) for i, p in enumerate(MIXED_ROWS)]
    for _ in range(5):
        tokens = sampler.sample(logits, batch)
        assert tokens == [sampler.sample(logits[i : i + 1], [alone[i]])[0] for i in range(len(alone))]


def test_argmax_rows_is_torch_argmax_first_index_on_ties():
    """numpy's argmax serves float32 CPU rows: the same index as torch.argmax, the first on a tie, any layout."""
    logits = torch.randn(5, 300)
    logits[1, [7, 200]] = 50.0  # a tie: the first wins
    logits[2, :] = 0.0  # all equal
    logits[3, [9, 10]] = float("inf")
    expected = torch.argmax(logits, dim=-1).tolist()
    assert argmax_rows(logits) == expected
    assert expected[1:4] == [7, 0, 9]
    assert argmax_rows(logits.t().contiguous().t()) == expected  # not contiguous rows
    assert argmax_rows(logits[::2]) == torch.argmax(logits[::2], dim=-1).tolist()
    assert argmax_rows(logits.bfloat16()) == torch.argmax(logits.bfloat16(), dim=-1).tolist()  # torch's own


def test_take_rows_is_a_view_only_for_consecutive_rows():
    values = torch.arange(12.0).view(6, 2)
    view = take_rows(values, [2, 3, 4])
    assert torch.equal(view, values[[2, 3, 4]]) and view.data_ptr() == values[2].data_ptr()
    for rows in ([4, 2], [0, 2], [3, 3], [5]):
        assert torch.equal(take_rows(values, rows), values[rows])
