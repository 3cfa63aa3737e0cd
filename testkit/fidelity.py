"""Comparing greedy completions: where two token lists part, and the near-tie rule of reduced precision.

The rule (as vLLM's `check_logprobs_close`, widened as docs/benchmarks.md explains): each greedy completion is
identical to Hugging Face's in the same dtype up to its first differing token, and there the two tokens are a
near-tie: each among the other side's top-`TOP_K` candidates, and on each side their logits less than
`MAX_LOGIT_GAP` apart. (bf16 logits near 16 are 0.125 apart, and three-way ties occur.) float32 is held to
identity (`Verdict.identical`). `testkit.hf_reference.HFReference.judge` applies it against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TOP_K = 5
MAX_LOGIT_GAP = 1.0


@dataclass
class Verdict:
    identical: bool
    near_tie: bool
    detail: str  # where and how the two differ ("" when identical)


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where two token id lists hold different tokens (None if one is a prefix of the other)."""
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)


def first_mismatch(got: list[int], want: list[int]) -> str:
    """A readable description of where two token id lists diverge."""
    position = first_difference(got, want)
    if position is not None:
        return f"first difference at output token {position}: got {got[position]}, reference {want[position]}"
    return f"lengths differ: got {len(got)} tokens, reference {len(want)}"


def judge(ours: list[int], reference: list[int], our_top: dict[int, float], ref_logits: torch.Tensor | None) -> Verdict:
    """Compare two greedy completions. `our_top`: our top-k {token: logprob} at the first differing position
    (log-probabilities differ by exactly the logits' difference); `ref_logits`: the reference's logits there."""
    position = first_difference(ours, reference)
    if position is None:
        if len(ours) == len(reference):
            return Verdict(True, True, "")
        return Verdict(False, False, f"lengths differ ({len(ours)} vs {len(reference)}) with no differing token")
    import torch

    mine, theirs = ours[position], reference[position]
    ref_top = torch.topk(ref_logits, TOP_K).indices.tolist()
    ref_gap = float(ref_logits[theirs] - ref_logits[mine])
    our_gap = our_top[mine] - our_top[theirs] if theirs in our_top else float("inf")
    ok = mine in ref_top and theirs in our_top and abs(ref_gap) < MAX_LOGIT_GAP and abs(our_gap) < MAX_LOGIT_GAP
    return Verdict(
        False,
        ok,
        f"token {position}: ours {mine}, reference {theirs}; logit gap reference "
        f"{ref_gap:.3f}, ours {our_gap:.3f}; ours in reference top-{TOP_K}: {mine in ref_top}, "
        f"reference in our top-{TOP_K}: {theirs in our_top}",
    )


def summarize(verdicts: list[Verdict]) -> str:
    identical = sum(v.identical for v in verdicts)
    ties = sum(v.near_tie and not v.identical for v in verdicts)
    bad = len(verdicts) - identical - ties
    return f"{identical} identical, {ties} near-ties, {bad} violations of {len(verdicts)}"
