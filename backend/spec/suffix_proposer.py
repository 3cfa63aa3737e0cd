"""Suffix decoding (`draft_model: suffix`): drafts from the request's own prompt and output and from recent outputs of
every request, each continuation scored by how often it followed the same context (`suffix_index.py`).

Per decoding sequence the proposer keeps a `SequenceIndex`, brought up to date when the sequence next drafts (so
a sequence that does not speculate, in a busy batch or switched off by the adaptive policy, costs nothing per step);
a finished sequence's output goes into the global `SuffixCache` and its index is dropped (`finish`, called by the
engine when a request is done). Each draft is the better-scoring of the two look-ups, so its length follows the
evidence: long where the context has been seen continued the same way (copying the prompt, a repeated template), a
token or two where it is weak, none where no continuation is probable enough. Drafts are deterministic (one-hot q),
verified by the same rejection sampler as every other proposer's.
"""

from __future__ import annotations

from backend.core.request import Sequence
from backend.core.scheduler_output import Draft
from backend.spec.proposers import Proposer
from backend.spec.suffix_cache import SuffixCache
from backend.spec.suffix_index import Match, SequenceIndex, best_draft


class SuffixProposer(Proposer):
    sizes_drafts = True  # its drafts stop where their probability does: the policy need not shorten them

    def __init__(self, max_depth: int, min_token_prob: float, spec_factor: float, cache_tokens: int):
        self.max_depth = max_depth
        self.min_token_prob = min_token_prob
        self.spec_factor = spec_factor
        self.cache = SuffixCache(cache_tokens, max_depth) if cache_tokens else None
        self.indexes: dict[int, SequenceIndex] = {}  # seq_id -> its index, while it runs

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[Draft]:
        return [Draft(self.match(seq, k).tokens) for seq, k in requests]

    def match(self, seq: Sequence, k: int) -> Match:
        """The better-scoring draft of the sequence's own index and the global store (its tokens and score)."""
        tokens = seq.token_ids
        index = self.indexes.get(seq.seq_id)
        if index is None:
            index = self.indexes[seq.seq_id] = SequenceIndex()
        index.update(tokens)
        args = (tokens, k, self.max_depth, self.spec_factor, self.min_token_prob)
        own = best_draft(index.candidates(tokens), *args)
        if self.cache is None or own.score >= k:  # k certain tokens: the store cannot score higher
            return own
        shared = best_draft(self.cache.candidates(tokens), *args)
        if shared.score > own.score:
            self.cache.touch(shared.sources)
            return shared
        return own

    def finish(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.indexes.pop(seq.seq_id, None)
            if self.cache is not None and seq.num_output_tokens:
                self.cache.add(seq.token_ids, seq.num_prompt_tokens)
