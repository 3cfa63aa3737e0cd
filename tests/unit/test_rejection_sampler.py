"""Rejection sampler: output format, greedy rule, determinism, and exactness of the emitted distribution."""

import pytest
import torch

from backend.spec.rejection_sampler import verify_greedy, verify_sampled

VOCAB = 8


def _dist(generator: torch.Generator, size: int = VOCAB, sharp: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(size, generator=generator) * sharp, dim=-1)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_one(target, drafts, draft, generator):
    """One sequence's verification through the batched call."""
    return verify_sampled(target, [drafts], [draft], [generator])[0]


@pytest.mark.parametrize(
    "argmax, drafts, tokens, accepted",
    [
        ([5, 6, 7, 8], [5, 6, 7], [5, 6, 7, 8], 3),  # all accepted: bonus token appended
        ([5, 9, 7, 8], [5, 6, 7], [5, 9], 1),  # first mismatch: the target's token replaces it, rest dropped
        ([4, 6, 7, 8], [5, 6, 7], [4], 0),
        ([3], [], [3], 0),  # nothing to verify: a plain decode
    ],
)
def test_greedy_accepts_exactly_the_matching_prefix(argmax, drafts, tokens, accepted):
    result = verify_greedy(argmax, drafts)
    assert result.tokens == tokens
    assert result.num_accepted == accepted


def test_format_bonus_only_when_all_accepted():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        k = 3
        target = torch.stack([_dist(gen) for _ in range(k + 1)])
        draft = torch.stack([_dist(gen) for _ in range(k)])
        drafts = [_draw(draft[i], gen) for i in range(k)]
        result = verify_one(target, drafts, draft, gen)
        assert len(result.tokens) == result.num_accepted + 1
        assert result.tokens[: result.num_accepted] == drafts[: result.num_accepted]
        assert 0 <= result.num_accepted <= k
        if result.num_accepted < k:  # the rejection point holds a token from the residual max(0, p - q)
            i = result.num_accepted
            assert float(target[i, result.tokens[-1]]) > float(draft[i, result.tokens[-1]])


def test_identical_draft_is_always_accepted():
    gen = torch.Generator().manual_seed(1)
    target = torch.stack([_dist(gen) for _ in range(5)])
    for _ in range(100):
        drafts = [_draw(target[i], gen) for i in range(4)]
        result = verify_one(target, drafts, target[:4].clone(), gen)
        assert result.num_accepted == 4 and len(result.tokens) == 5


def test_zero_probability_draft_token_is_rejected():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    draft = torch.tensor([[1.0, 0.0, 0.0]])
    result = verify_one(target, [0], draft, torch.Generator().manual_seed(0))
    assert result.tokens == [1] and result.num_accepted == 0


def test_seeded_determinism_and_batch_equals_single():
    base = torch.Generator().manual_seed(7)
    cases = []
    for _ in range(6):
        target = torch.stack([_dist(base) for _ in range(4)])
        draft = torch.stack([_dist(base) for _ in range(3)])
        drafts = [_draw(draft[i], base) for i in range(3)]
        cases.append((target, drafts, draft))

    def run(order, batched=False):
        generators = {i: torch.Generator().manual_seed(100 + i) for i in range(len(cases))}
        results = {}
        for _round in range(3):  # several steps, sequences interleaved in the given order
            if batched:  # one call for all of them, their rows in the given order
                target = torch.cat([cases[i][0] for i in order])
                drafts, draft_probs = [cases[i][1] for i in order], [cases[i][2] for i in order]
                verified = verify_sampled(target, drafts, draft_probs, [generators[i] for i in order])
                for i, result in zip(order, verified):
                    results.setdefault(i, []).append(result.tokens)
            else:
                for i in order:
                    results.setdefault(i, []).append(verify_one(*cases[i], generators[i]).tokens)
        return results

    singly = {}
    for i in range(len(cases)):
        singly.update(run([i]))
    assert run(list(range(len(cases)))) == singly
    assert run(list(reversed(range(len(cases))))) == singly
    assert run(list(range(len(cases))), batched=True) == singly
    assert run(list(reversed(range(len(cases)))), batched=True) == singly


def _emitted_first_token_hist(target, draft, k, trials, gen, one_hot_draft=False):
    counts = torch.zeros(VOCAB)
    bonus_counts = torch.zeros(VOCAB)
    for _ in range(trials):
        drafts = [_draw(draft[i], gen) for i in range(k)]
        q = None if one_hot_draft else draft
        if one_hot_draft:  # a deterministic proposer: always the same draft tokens
            drafts = [int(torch.argmax(draft[i])) for i in range(k)]
        result = verify_one(target, drafts, q, gen)
        counts[result.tokens[0]] += 1
        if result.num_accepted == k:
            bonus_counts[result.tokens[-1]] += 1
    return counts / trials, bonus_counts


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_emitted_distribution_converges_to_target(one_hot_draft):
    """As vLLM's test does: the distance to the target shrinks with samples, far below random references."""
    gen = torch.Generator().manual_seed(1234)
    k = 2
    target = torch.stack([_dist(gen) for _ in range(k + 1)])
    draft = torch.stack([_dist(gen) for _ in range(k)])
    references = [_dist(gen) for _ in range(20)]
    distances = []
    for trials in (200, 4000):
        empirical, bonus = _emitted_first_token_hist(target, draft, k, trials, gen, one_hot_draft)
        distances.append(_tv(empirical, target[0]))
    assert distances[1] < distances[0] or distances[1] < 0.02
    assert distances[1] < 0.04
    reference_distance = min(_tv(empirical, ref) for ref in references)
    assert distances[1] < reference_distance / 3
    # the bonus token, drawn when the whole draft is accepted, follows the target's last position
    if bonus.sum() > 500:
        assert _tv(bonus / bonus.sum(), target[k]) < 0.08
