"""Rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Draft token x_i, proposed from distribution q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)),
where p_i is the target's distribution at that position. At the first rejection the emitted token is drawn
from normalize(max(0, p_i - q_i)) and the rest of the draft is dropped; if every draft token is accepted,
one bonus token is drawn from p_k. The emitted tokens are then distributed exactly as if the target had
sampled them one by one. Greedy requests accept exactly when the draft token is the target's argmax.
A deterministic draft (n-gram lookup) has a one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.sampling.sampler import Sampler


@dataclass
class Verification:
    """The result for one sequence: `tokens` = accepted draft tokens + one final (corrected or bonus) token."""

    tokens: list[int]
    num_accepted: int


def verify_greedy(target_argmax: list[int], draft_tokens: list[int]) -> Verification:
    """target_argmax[i] is the target's choice after draft_tokens[:i]; len = len(draft_tokens) + 1."""
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_argmax[accepted]:
        accepted += 1
    return Verification(draft_tokens[:accepted] + [target_argmax[accepted]], accepted)


def verify_sampled(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> Verification:
    """target_probs [k + 1, V]; draft_probs [k, V], or None for a deterministic (one-hot) draft."""
    for i, token in enumerate(draft_tokens):
        p = target_probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        accept_prob = min(1.0, float(p[token]) / q_token) if q_token > 0 else 0.0
        if float(torch.rand((), generator=generator)) < accept_prob:
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[i], min=0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p  # p == q exactly: any rejection is impossible
        return Verification(draft_tokens[:i] + [Sampler.draw(residual, generator)], i)
    bonus = Sampler.draw(target_probs[len(draft_tokens)], generator)
    return Verification(list(draft_tokens) + [bonus], len(draft_tokens))
