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
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    generators: list[torch.Generator],
) -> list[Verification]:
    """Verify several sequences' drafts at once. `target_probs`: each sequence's k + 1 rows in turn; `draft_probs`:
    each one's [k, V], or None for a deterministic (one-hot) draft; `generators`: each one's own. Every draft
    token's acceptance probability is gathered in one op and each sequence draws its k uniforms in one call;
    only the token after the accepted prefix (from the residual, or the bonus) is drawn per sequence."""
    starts, row = [], 0
    for tokens in drafts:
        starts.append(row)
        row += len(tokens) + 1
    accepted = [[] for _ in drafts]
    positions = [(start + i, token) for start, tokens in zip(starts, drafts) for i, token in enumerate(tokens)]
    if positions:
        rows, tokens = zip(*positions)
        p = target_probs[list(rows), list(tokens)]
        q = torch.cat(
            [
                torch.ones(len(d)) if qs is None else qs[torch.arange(len(d)), d]
                for d, qs in zip(drafts, draft_probs)
                if d
            ]
        )
        accept_prob = torch.where(q > 0, p / q, 0.0).clamp(max=1.0)
        uniforms = torch.cat([torch.rand(len(d), generator=g) for d, g in zip(drafts, generators) if d])
        flags, first = (uniforms < accept_prob).tolist(), 0
        for i, d in enumerate(drafts):
            accepted[i], first = flags[first : first + len(d)], first + len(d)
    results = []
    for tokens, qs, generator, start, flags in zip(drafts, draft_probs, generators, starts, accepted):
        n = flags.index(False) if False in flags else len(tokens)
        p = target_probs[start + n]
        if n < len(tokens):  # rejected at n: draw from normalize(max(0, p - q))
            if qs is None:
                residual = p.clone()
                residual[tokens[n]] = 0.0
            else:
                residual = torch.clamp(p - qs[n], min=0.0)
            total = float(residual.sum())
            p = residual / total if total > 0 else p  # p == q exactly: any rejection is impossible
        results.append(Verification(list(tokens[:n]) + [Sampler.draw(p, generator)], n))
    return results
