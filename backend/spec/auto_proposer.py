"""`draft_model: auto`: per sequence and per step, the draft that is worth its verification: suffix decoding's, the
trained head's (`draft_head`), or none.

A drafted token costs the target a verification row (`spec_row_cost` of a one-row step; on a CPU the rows are not
free) and a head-drafted token also the head's own pass (`head_token_cost`); it pays when it is accepted. So each
source's draft is valued by its expected accepted length, less what its tokens cost, and the best positive one is
sent:

- suffix decoding's draft comes with its expected accepted length (the sum of its path probabilities,
  `suffix_index.py`), corrected per sequence by how its drafts have fared: the measured accepted tokens over the
  expected ones (a weighted average);
- the head's chain of i tokens is expected to keep `a + a^2 + ... + a^i` of them, where `a` is the sequence's
  measured per-token acceptance of head drafts (accepted tokens over the tokens verified up to the first
  rejection, a weighted average, starting at the head's held-out agreement),
  and it is cut where the next token's `a^i` no longer pays for its cost;
- neither worth its cost: no draft this step (the adaptive policy's probes still bring a sequence back).

The suffix look-up is a dictionary access and runs first; the head drafts only the sequences suffix decoding
leaves, and only when its chain is worth it. Both sources are exact to verify (the same rejection sampler).
"""

from __future__ import annotations

from backend.core.request import Sequence
from backend.core.runner_output import ModelRunnerOutput
from backend.core.scheduler_output import Draft
from backend.spec.proposers import Proposer
from backend.spec.suffix_proposer import SuffixProposer

SMOOTHING = 0.3  # weight of the latest verification in each sequence's measured acceptance
SUFFIX, HEAD = "suffix", "head"


class _SeqChoice:
    __slots__ = ("suffix_calibration", "head_acceptance", "last")

    def __init__(self, head_acceptance: float):
        self.suffix_calibration = 1.0  # accepted tokens per expected one, of this sequence's suffix drafts
        self.head_acceptance = head_acceptance  # accepted tokens per drafted one, of its head drafts
        self.last: tuple[str, int, float] | None = None  # (source, drafted, expected) of the draft in flight


class AutoProposer(Proposer):
    sizes_drafts = True  # every draft is sized here: the policy asks for the cap while a sequence is on

    def __init__(self, suffix: SuffixProposer, head: Proposer | None, row_cost: float, head_token_cost: float):
        self.suffix = suffix
        self.head = head
        self.row_cost = row_cost
        self.head_token_cost = head_token_cost
        agreement = (getattr(head, "config", None) or {}).get("trained_with", {}).get("heldout_agreement_by_step")
        self.head_prior = float(agreement[0]) if agreement else 0.5
        self.choices: dict[int, _SeqChoice] = {}  # seq_id -> its measured acceptance, while it runs
        self.picks = {SUFFIX: 0, HEAD: 0, "none": 0}  # drafts sent by source (reported by the benchmark)

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[Draft]:
        drafts: dict[int, Draft] = {}
        for_head = []
        for seq, k in requests:
            choice = self.choices.get(seq.seq_id)
            if choice is None:
                choice = self.choices[seq.seq_id] = _SeqChoice(self.head_prior)
            match = self.suffix.match(seq, k)
            expected = match.score * choice.suffix_calibration
            suffix_value = expected - self.row_cost * len(match.tokens)
            head_length, head_value = self._head_chain(choice.head_acceptance, k)
            if head_value > max(suffix_value, 0.0):
                for_head.append((seq, head_length))
            elif suffix_value > 0.0:
                drafts[seq.seq_id] = Draft(match.tokens)
                choice.last = (SUFFIX, len(match.tokens), expected)
        if for_head:
            for (seq, _), draft in zip(for_head, self.head.propose(for_head)):
                drafts[seq.seq_id] = draft
                self.choices[seq.seq_id].last = (HEAD, len(draft.token_ids), 0.0)
        for seq, _ in requests:
            choice = self.choices[seq.seq_id]
            self.picks[choice.last[0] if seq.seq_id in drafts else "none"] += 1
        return [drafts.get(seq.seq_id, Draft([])) for seq, _ in requests]

    def _head_chain(self, acceptance: float, k: int) -> tuple[int, float]:
        """(chain length, expected accepted tokens less their cost) of the head's best chain of at most k."""
        if self.head is None:
            return 0, 0.0
        cost = self.row_cost + self.head_token_cost
        length, value, reach = 0, 0.0, 1.0
        while length < k:
            reach *= acceptance  # the chance the next token is accepted, all before it accepted
            if reach <= cost:
                break
            length, value = length + 1, value + reach - cost
        return length, value

    def observe(self, output: ModelRunnerOutput) -> None:
        if self.head is not None:
            self.head.observe(output)
        for seq_id, accepted in output.num_accepted.items():
            choice = self.choices.get(seq_id)
            if choice is None or choice.last is None:
                continue
            source, drafted, expected = choice.last
            choice.last = None
            if source == SUFFIX and expected > 0:
                choice.suffix_calibration += SMOOTHING * (accepted / expected - choice.suffix_calibration)
            elif source == HEAD and drafted:
                # a chain is verified token by token up to its first rejection: accepted of these trials passed
                trials = accepted + (accepted < drafted)
                choice.head_acceptance += SMOOTHING * (accepted / trials - choice.head_acceptance)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if self.head is not None:
            self.head.copy_blocks(copies)

    def finish(self, seqs: list[Sequence]) -> None:
        self.suffix.finish(seqs)
        if self.head is not None:
            self.head.finish(seqs)
        for seq in seqs:
            self.choices.pop(seq.seq_id, None)
