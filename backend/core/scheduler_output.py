"""What a step runs: the scheduler's output, with the layout of the logits rows the step returns built once.

The scheduler picks the sequences and their token counts (`Scheduler.schedule`); a speculating decode then gets
its draft tokens (`SchedulerOutput.with_drafts`, once the proposer ran), and from then on the record is read,
never changed. The model runner returns, for each scheduled sequence in order, its prompt rows first (the
positions whose logits a request records: prompt_logprobs, context_logits), then its sampled rows: 1 to sample
a token, k + 1 to verify k drafts, none for a chunk in the middle of a prompt (vLLM's layout). Once the prompt
rows are taken out, `sample_rows[i]` is where sequence i's sampled rows start.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

import torch

from backend.core.request import Sequence


@dataclass(frozen=True)
class Draft:
    """A proposer's draft for one sequence: its tokens and, when they were sampled from a distribution, those
    distributions [k, V] (None: a deterministic draft, one-hot q)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


NO_DRAFT = Draft([])


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step, draft tokens included
    num_spec_tokens: int = 0  # draft tokens to verify (the last ones of num_new_tokens)
    draft: Draft = NO_DRAFT  # the draft tokens themselves, once proposed (`SchedulerOutput.with_drafts`)

    def __post_init__(self):
        seq = self.seq
        self.start = seq.num_computed_tokens  # first position computed this step
        # After this step the KV covers every token but the last, so the sequence samples.
        self.samples = self.start + self.num_new_tokens - self.num_spec_tokens >= seq.num_tokens
        self.is_prefill = self.start < seq.num_prompt_tokens
        self.num_prompt_rows = self._prompt_rows()
        self.num_sampled_rows = self.num_spec_tokens + 1 if self.samples else 0

    def _prompt_rows(self) -> int:
        """Prompt positions whose logits the request records: from the chunk's first position up to the one before
        the last prompt token (that one's logits pick the first output token)."""
        if not self.is_prefill or not self.seq.request.computing_prompt_outputs:
            return 0
        return max(0, min(self.start + self.num_new_tokens, self.seq.num_prompt_tokens - 1) - self.start)

    @property
    def num_logits(self) -> int:
        """Rows of logits the model runner returns for this sequence: its prompt rows, then its sampled rows."""
        return self.num_prompt_rows + self.num_sampled_rows

    @property
    def token_ids(self) -> list[int]:
        """The tokens computed this step: the sequence's next ones, then the drafts to verify."""
        end = self.start + self.num_new_tokens - self.num_spec_tokens
        return self.seq.token_ids[self.start : end] + self.draft.token_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def with_drafts(self, drafts: dict[int, Draft]) -> SchedulerOutput:
        """The step with each speculating sequence's draft (by seq_id); one that got fewer tokens than its
        scheduled k verifies fewer (its unused KV slots are released after the step)."""
        scheduled = []
        for s in self.scheduled:
            draft = drafts.get(s.seq.seq_id)
            if s.num_spec_tokens and draft is not None:
                unused = s.num_spec_tokens - len(draft.token_ids)
                s = dataclasses.replace(
                    s, num_new_tokens=s.num_new_tokens - unused, num_spec_tokens=len(draft.token_ids), draft=draft
                )
            elif s.num_spec_tokens:
                s = dataclasses.replace(s, num_new_tokens=s.num_new_tokens - s.num_spec_tokens, num_spec_tokens=0)
            scheduled.append(s)
        return SchedulerOutput(scheduled, self.preempted)

    @cached_property
    def sample_rows(self) -> list[int]:
        """Where each scheduled sequence's sampled rows start in the logits once the prompt rows are taken out."""
        starts, row = [], 0
        for s in self.scheduled:
            starts.append(row)
            row += s.num_sampled_rows
        return starts
