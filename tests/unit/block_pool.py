"""Driving the KV block pool in unit tests as an engine step would: sequences, admission with the prefix cache,
computing tokens and registering full blocks."""

from __future__ import annotations

from collections import Counter

from backend.core.block_manager import BlockManager
from backend.core.client_request import ClientRequest
from backend.core.request import Request, Sequence
from backend.core.runner_output import ModelRunnerOutput
from backend.core.scheduler import Scheduler
from backend.core.scheduler_output import SchedulerOutput
from backend.protocol.sampling_params import SamplingParams

SIZE = 4


def new_seq(tokens, request_id="r") -> Sequence:
    request = Request(ClientRequest(request_id, "", list(tokens), SamplingParams()))
    seq = Sequence(request, 0, detokenizer=None)
    request.sequences = [seq]
    return seq


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """An engine step of n of `seq`'s tokens (no token sampled): room for them, then the scheduler applies the
    step (computed count, full blocks registered)."""
    n = seq.num_uncomputed_tokens if n is None else n
    assert bm.allocate(seq, n)
    step = SchedulerOutput()
    step.add(seq, n)
    Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=n).update_from_output(step, ModelRunnerOutput(), None)


def admit(bm: BlockManager, seq: Sequence, cached: list[int]) -> None:
    """A waiting sequence given `cached` prefix blocks; the scheduler counts their tokens as computed."""
    bm.admit(seq, cached)
    seq.num_computed_tokens = seq.num_cached_prompt_tokens


def fork(bm: BlockManager, parent: Sequence, child: Sequence) -> None:
    """A parallel sample sharing its parent's blocks; the scheduler gives it the parent's computed count."""
    bm.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens


def admit_and_compute(bm: BlockManager, tokens, request_id="r") -> Sequence:
    seq = new_seq(tokens, request_id)
    cached = bm.match_prefix(seq.token_ids)
    assert bm.can_admit(seq, cached, seq.num_tokens - len(cached) * SIZE)
    admit(bm, seq, cached)
    compute(bm, seq)
    return seq


def refs_from_tables(*seqs) -> Counter:
    return Counter(b for s in seqs for b in s.block_table)
