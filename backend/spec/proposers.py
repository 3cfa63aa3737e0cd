"""Draft proposers for speculative decoding, behind one small interface.

A proposer returns a `Draft` per sequence: at most the k tokens asked for and, when they are sampled from a
distribution, those distributions ([k, V]; None means a deterministic draft, one-hot q). It reads the sequences and
changes none: what a draft model's KV now covers goes back in the draft (`Draft.draft_num_computed`), for
`Scheduler.update_from_output` to record.
"""

from __future__ import annotations

import torch

from backend.core.request import Sequence
from backend.core.scheduler_output import Draft
from backend.model.runner import ForwardItem, ModelRunner
from backend.sampling.sampler import Sampler, argmax_rows


class Proposer:
    # True for a proposer whose drafts end where it stops trusting them: the adaptive policy then asks for the
    # full k and only switches a sequence off and on by its acceptance (spec/policy.py)
    sizes_drafts = False

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[Draft]:
        """For each (sequence, k): up to k tokens following the sequence's tokens."""
        raise NotImplementedError

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Mirror the target's copy-on-write block copies in the proposer's own KV cache, if any."""

    def observe(self, output) -> None:
        """What a step's target pass produced (its logits, the tokens each sequence got from them, by seq_id), for a
        proposer that drafts from the target's own state (`eagle_proposer.py`)."""

    def finish(self, seqs: list[Sequence]) -> None:
        """These sequences are done (finished or aborted): learn from their output, drop their state."""


class NgramProposer(Proposer):
    """Prompt lookup: continue the latest earlier occurrence of the sequence's last n tokens."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[Draft]:
        return [Draft(self.lookup(seq.token_ids, k)) for seq, k in requests]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest match first
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + k]
        return []


class DraftModelProposer(Proposer):
    """A smaller (or lower-precision) model with its own paged KV cache, addressed by the target's block
    tables. It catches up on the tokens it has not seen (prompt chunks, accepted tokens) in its first pass
    of a step, then drafts one token per pass; each draft says how far its KV then reaches."""

    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner = runner
        self.sampler = sampler

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[Draft]:
        tokens = {seq.seq_id: [] for seq, _ in requests}
        probs = {seq.seq_id: [] for seq, _ in requests}
        computed = {seq.seq_id: seq.draft_num_computed for seq, _ in requests}
        active = list(requests)
        items = [
            ForwardItem(seq.token_ids[seq.draft_num_computed :], seq.draft_num_computed, seq.block_table, 1)
            for seq, _ in active
        ]
        while active:
            rows = [seq.sampling_row(tokens[seq.seq_id]) for seq, _ in active]
            logits = self.sampler.process_logits(self.runner.forward(items)[:, : self.sampler.vocab_size], rows)
            sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
            chosen = argmax_rows(logits)
            if sampled:
                q = self.sampler.probs(logits[sampled], [rows[i] for i in sampled])
                for i, row_q, token in zip(sampled, q, self.sampler.draw_rows(q, [rows[i] for i in sampled])):
                    probs[active[i][0].seq_id].append(row_q)
                    chosen[i] = token
            still, items = [], []
            for (seq, k), row, token in zip(active, rows, chosen):
                context = row.context
                computed[seq.seq_id] = len(context)  # the draft's KV now covers every token so far
                tokens[seq.seq_id].append(token)
                if len(tokens[seq.seq_id]) < k:
                    still.append((seq, k))
                    items.append(ForwardItem([token], len(context), seq.block_table, 1))
            active = still
        return [
            Draft(
                tokens[seq.seq_id],
                torch.stack(probs[seq.seq_id]) if probs[seq.seq_id] else None,
                computed[seq.seq_id],
            )
            for seq, _ in requests
        ]
