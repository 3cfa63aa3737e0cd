"""Driving the KV block pool in unit tests as an engine step would: sequences, admission with the prefix cache,
computing tokens and registering full blocks."""

from __future__ import annotations

from collections import Counter

from backend.core.block_manager import BlockManager
from backend.core.request import Request, Sequence
from backend.protocol.sampling_params import SamplingParams

SIZE = 4


def new_seq(tokens, request_id="r") -> Sequence:
    request = Request(request_id, "", list(tokens), SamplingParams())
    seq = Sequence(request, 0, detokenizer=None)
    request.sequences = [seq]
    return seq


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """What an engine step does for `seq`: room for n tokens, 'run' them, register full blocks."""
    n = seq.num_uncomputed_tokens if n is None else n
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)


def admit_and_compute(bm: BlockManager, tokens, request_id="r") -> Sequence:
    seq = new_seq(tokens, request_id)
    cached = bm.match_prefix(seq.token_ids)
    assert bm.can_admit(seq, cached, seq.num_tokens - len(cached) * SIZE)
    bm.admit(seq, cached)
    compute(bm, seq)
    return seq


def refs_from_tables(*seqs) -> Counter:
    return Counter(b for s in seqs for b in s.block_table)
