"""What a step runs: the scheduler's output, plain records fixed when the step is scheduled.

The scheduler picks the sequences and their token counts (`Scheduler.schedule`) and records each as a
`ScheduledSeq`: the sequence's id, the positions and tokens it computes, whether it samples, its logits rows, and
the sequences that draw a token from its row (itself and the parallel samples waiting to fork from it). A
speculating decode then gets its draft tokens (`SchedulerOutput.with_drafts`, once the proposer ran), and from then
on the record is read, never changed. The model runner returns, for each scheduled sequence in order, its prompt
rows first (the positions whose logits a request records: prompt_logprobs, context_logits), then its sampled rows:
1 to sample a token, k + 1 to verify k drafts, none for a chunk in the middle of a prompt (vLLM's layout). Once
the prompt rows are taken out, `sample_rows[i]` is where sequence i's sampled rows start.

The records name sequences by id; `SchedulerOutput.sequences` resolves an id for what the step reads (block
tables, sampling parameters, generators). Only `Scheduler.update_from_output` changes a sequence.
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
    distributions [k, V] (None: a deterministic draft, one-hot q). `draft_num_computed`: the tokens whose KV a
    draft model holds once it drafted (None: the proposer keeps no KV of the sequence's tokens)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    draft_num_computed: int | None = None


NO_DRAFT = Draft([])


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's part of a step, as scheduled (`of`); its drafts put in by `SchedulerOutput.with_drafts`."""

    seq_id: int
    start: int  # first position computed this step
    token_ids: list[int]  # the tokens computed this step: the sequence's next ones, then its drafts once they are in
    num_new_tokens: int  # tokens this step computes for it, the draft slots included
    num_spec_tokens: int = 0  # draft tokens to verify (the last ones of num_new_tokens)
    samples: bool = False  # after this step the KV covers every token but the last: it samples
    is_prefill: bool = False
    num_prompt_rows: int = 0  # prompt positions whose logits the request records (`_prompt_rows`)
    # the sequences that take a token from its sampled rows: itself and, on its prompt's last chunk, its parallel
    # samples waiting to fork; none when it samples nothing (a chunk mid-prompt, a prompt scored with max_tokens 0)
    sample_ids: tuple[int, ...] = ()
    draft: Draft = NO_DRAFT

    @classmethod
    def of(
        cls, seq: Sequence, num_new_tokens: int, num_spec_tokens: int = 0, parallel: list[Sequence] = ()
    ) -> ScheduledSeq:
        """The record of `seq` computing `num_new_tokens` (the last `num_spec_tokens` of them drafts to come) from its
        computed count on; `parallel`: its samples waiting to fork from its first sampled row."""
        start = seq.num_computed_tokens
        end = start + num_new_tokens - num_spec_tokens
        samples = end >= seq.num_tokens
        is_prefill = start < seq.num_prompt_tokens
        sample_ids = ()
        if samples and seq.params.max_tokens > 0:
            sample_ids = (seq.seq_id, *(child.seq_id for child in parallel))
        return cls(
            seq.seq_id,
            start,
            seq.token_ids[start:end],
            num_new_tokens,
            num_spec_tokens,
            samples,
            is_prefill,
            _prompt_rows(seq, start, num_new_tokens) if is_prefill else 0,
            sample_ids,
        )

    @property
    def num_sampled_rows(self) -> int:
        return self.num_spec_tokens + 1 if self.samples else 0

    @property
    def num_logits(self) -> int:
        """Rows of logits the model runner returns for this sequence: its prompt rows, then its sampled rows."""
        return self.num_prompt_rows + self.num_sampled_rows


def _prompt_rows(seq: Sequence, start: int, num_new_tokens: int) -> int:
    """Prompt positions whose logits the request records: from the chunk's first position up to the one before the
    last prompt token (that one's logits pick the first output token)."""
    if not seq.request.computing_prompt_outputs:
        return 0
    return max(0, min(start + num_new_tokens, seq.num_prompt_tokens - 1) - start)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # the sequences the records name, by seq_id (the parallel samples waiting to fork included), for reading
    sequences: dict[int, Sequence] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) before the pass

    def add(self, seq: Sequence, num_new_tokens: int, num_spec_tokens: int = 0, parallel: list[Sequence] = ()):
        """Schedule `seq` (`ScheduledSeq.of`)."""
        self.scheduled.append(ScheduledSeq.of(seq, num_new_tokens, num_spec_tokens, parallel))
        self.sequences[seq.seq_id] = seq
        for child in parallel:
            self.sequences[child.seq_id] = child

    def remove(self, seq: Sequence) -> int:
        """Take `seq` back out (it is being preempted); the tokens it gives back to the budget."""
        for i, item in enumerate(self.scheduled):
            if item.seq_id == seq.seq_id:
                del self.scheduled[i]
                for seq_id in (item.seq_id, *item.sample_ids):
                    self.sequences.pop(seq_id, None)
                return item.num_new_tokens
        return 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def with_drafts(self, drafts: dict[int, Draft]) -> SchedulerOutput:
        """The step with each speculating sequence's draft (by seq_id); one that got fewer tokens than its
        scheduled k verifies fewer (its unused KV slots are released after the step)."""
        scheduled = []
        for s in self.scheduled:
            if s.num_spec_tokens:
                draft = drafts.get(s.seq_id, NO_DRAFT)
                unused = s.num_spec_tokens - len(draft.token_ids)
                s = dataclasses.replace(
                    s,
                    token_ids=s.token_ids + draft.token_ids,
                    num_new_tokens=s.num_new_tokens - unused,
                    num_spec_tokens=len(draft.token_ids),
                    draft=draft,
                )
            scheduled.append(s)
        return SchedulerOutput(scheduled, self.preempted, self.sequences, self.block_copies)

    @cached_property
    def sample_rows(self) -> list[int]:
        """Where each scheduled sequence's sampled rows start in the logits once the prompt rows are taken out."""
        starts, row = [], 0
        for s in self.scheduled:
            starts.append(row)
            row += s.num_sampled_rows
        return starts

    @cached_property
    def draws(self) -> list[tuple[int, int]]:
        """(seq_id, its row of the sampled logits) of every sequence that draws one token this step: each one
        that samples without verifying drafts, and the parallel samples that fork from its row."""
        return [
            (seq_id, row)
            for s, row in zip(self.scheduled, self.sample_rows)
            if not s.num_spec_tokens
            for seq_id in s.sample_ids
        ]
