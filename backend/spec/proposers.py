"""Draft proposers for speculative decoding, behind one small interface.

A proposer fills `seq.spec_token_ids` (at most the k asked for) and, when its drafts are sampled from a
distribution, `seq.spec_draft_probs` ([k, V]; None means a deterministic draft, one-hot q).
"""

from __future__ import annotations

import torch

from backend.core.request import Sequence
from backend.model.runner import ForwardItem, ModelRunner
from backend.sampling.sampler import Sampler, argmax_rows


class Proposer:
    def propose(self, requests: list[tuple[Sequence, int]]) -> None:
        """For each (sequence, k): propose up to k tokens following the sequence's tokens."""
        raise NotImplementedError

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Mirror the target's copy-on-write block copies in the proposer's own KV cache, if any."""


class NgramProposer(Proposer):
    """Prompt lookup: continue the latest earlier occurrence of the sequence's last n tokens."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[tuple[Sequence, int]]) -> None:
        for seq, k in requests:
            seq.spec_token_ids = self.lookup(seq.token_ids, k)
            seq.spec_draft_probs = None

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
    of a step, then drafts one token per pass."""

    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner = runner
        self.sampler = sampler

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def propose(self, requests: list[tuple[Sequence, int]]) -> None:
        for seq, _ in requests:
            seq.spec_token_ids, seq.spec_draft_probs = [], []
        active = list(requests)
        items = [
            ForwardItem(seq.token_ids[seq.draft_num_computed :], seq.draft_num_computed, seq.block_table, 1)
            for seq, _ in active
        ]
        while active:
            rows = [seq.sampling_row(seq.spec_token_ids) for seq, _ in active]
            logits = self.sampler.process_logits(self.runner.forward(items)[:, : self.sampler.vocab_size], rows)
            sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
            tokens = argmax_rows(logits)
            if sampled:
                q = self.sampler.probs(logits[sampled], [rows[i] for i in sampled])
                for i, row_q, token in zip(sampled, q, self.sampler.draw_rows(q, [rows[i] for i in sampled])):
                    active[i][0].spec_draft_probs.append(row_q)
                    tokens[i] = token
            still, items = [], []
            for (seq, k), row, token in zip(active, rows, tokens):
                context = row.context
                seq.draft_num_computed = len(context)  # the draft's KV now covers every token so far
                seq.spec_token_ids.append(token)
                if len(seq.spec_token_ids) < k:
                    still.append((seq, k))
                    items.append(ForwardItem([token], len(context), seq.block_table, 1))
            active = still
        for seq, _ in requests:
            probs = seq.spec_draft_probs
            seq.spec_draft_probs = torch.stack(probs) if probs else None
