"""backend/core/scheduler.py: iteration-level scheduling under a token budget and a sequence cap, chunked prefill,
decodes first, preemption of the most recently admitted sequences when blocks run out."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.core.block_manager import BlockManager
from backend.core.client_request import ClientRequest
from backend.core.request import FinishReason, Request, Sequence, SequenceStatus
from backend.core.runner_output import ModelRunnerOutput, SampledTokens
from backend.core.scheduler import Scheduler
from backend.core.scheduler_output import Draft, ScheduledSeq
from backend.protocol.sampling_params import SamplingParams

SIZE = 4


def new_seq(num_tokens: int, request_id: str, start: int = 0, n: int = 1, priority: int = 0) -> Sequence:
    params = SamplingParams(n=n, priority=priority)
    request = Request(ClientRequest(request_id, "", list(range(start, start + num_tokens)), params))
    seqs = [Sequence(request, i, detokenizer=None) for i in range(n)]
    request.sequences = seqs
    return seqs[0]


def make(num_blocks=64, max_num_seqs=8, budget=16, prefix_caching=True):
    bm = BlockManager(num_blocks, SIZE, prefix_caching)
    return Scheduler(bm, max_num_seqs, budget), bm


def never_stops(seq, token_id, logits, row, entry):
    return None


def run(sched: Scheduler, out, token: int = 7, stop_rule=never_stops):
    """The step as the engine ends it: the model chose `token` for every sequence the schedule says draws one (the
    parallel samples forked from a row included), and the scheduler applies that."""
    assert all(out.sequences[item.seq_id].status == SequenceStatus.RUNNING for item in out.scheduled)
    sampled = [SampledTokens(seq_id, [token], [0], out.sequences[seq_id].num_tokens - 1) for seq_id, _ in out.draws]
    sched.update_from_output(out, ModelRunnerOutput(torch.zeros(1, 1), sampled), stop_rule)


def names(out):
    return [(out.sequences[s.seq_id].request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_scheduled_seq_fields():
    seq = new_seq(10, "a")
    item = ScheduledSeq.of(seq, 4)
    assert item.start == 0 and item.is_prefill and not item.samples
    assert item.token_ids == [0, 1, 2, 3] and item.sample_ids == ()
    seq.num_computed_tokens = 6
    item = ScheduledSeq.of(seq, 4)
    assert item.start == 6 and item.is_prefill and item.samples
    assert item.sample_ids == (seq.seq_id,)
    seq.token_ids.append(1)
    seq.num_computed_tokens = 10
    item = ScheduledSeq.of(seq, 3, num_spec_tokens=2)
    assert not item.is_prefill and item.samples
    assert item.token_ids == [1] and item.num_sampled_rows == 3
    seq.token_ids.append(2)
    assert item.token_ids == [1]  # fixed when scheduled: the sequence's later tokens do not change it


def test_single_prompt_fits_in_one_step():
    sched, bm = make(budget=32)
    seq = new_seq(10, "a")
    sched.add(seq)
    assert seq.status == SequenceStatus.WAITING and sched.has_work()
    out = sched.schedule()
    assert names(out) == [("a", 10)] and out.scheduled[0].samples and out.num_batched_tokens == 10
    assert seq.status == SequenceStatus.RUNNING and sched.running == [seq] and not sched.waiting
    assert len(seq.block_table) == 3
    run(sched, out)
    out = sched.schedule()
    assert names(out) == [("a", 1)] and out.scheduled[0].samples and not out.scheduled[0].is_prefill


def test_long_prompt_is_chunked_across_steps():
    sched, bm = make(budget=16)
    seq = new_seq(40, "a")
    sched.add(seq)
    chunks = []
    while True:
        out = sched.schedule()
        assert out.num_batched_tokens <= 16
        chunks.append((out.scheduled[0].start, out.scheduled[0].num_new_tokens, out.scheduled[0].samples))
        run(sched, out)
        if out.scheduled[0].samples:
            break
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert seq.num_computed_tokens == 40 and seq.num_tokens == 41
    assert len(seq.block_table) == 10


def test_token_budget_is_respected_and_filled():
    sched, bm = make(budget=16, max_num_seqs=16)
    lengths = [5, 9, 3, 12, 7, 20, 1]
    for i, n in enumerate(lengths):
        sched.add(new_seq(n, f"r{i}", start=100 * i))
    total_prompt = sum(lengths)
    steps = 0
    prefill_done = 0
    while any(s.in_prefill for s in sched.running) or sched.waiting:
        out = sched.schedule()
        assert 0 < out.num_batched_tokens <= 16
        if sched.waiting:  # work was left over: the budget must have been used up
            assert out.num_batched_tokens == 16
        prefill_done += sum(s.num_new_tokens for s in out.scheduled if s.is_prefill)
        run(sched, out)
        steps += 1
        assert steps < 50
    assert prefill_done == total_prompt


def test_decodes_are_scheduled_before_prefills():
    sched, bm = make(budget=5)
    a = new_seq(3, "a")
    sched.add(a)
    run(sched, sched.schedule())  # a is now decoding
    b = new_seq(20, "b", start=50)
    sched.add(b)
    out = sched.schedule()
    assert names(out) == [("a", 1), ("b", 4)]
    run(sched, out)
    c = new_seq(2, "c", start=90)
    sched.add(c)
    out = sched.schedule()
    assert names(out)[0] == ("a", 1) and names(out)[1] == ("b", 4) and out.num_batched_tokens == 5
    run(sched, out)
    # once a prefill finishes in the middle, its decode jumps ahead of the still-prefilling ones
    for _ in range(4):
        out = sched.schedule()
        run(sched, out)
    kinds = [s.is_prefill for s in sched.schedule().scheduled]
    assert kinds == sorted(kinds)  # all decodes (False) before all prefills (True)


def test_decode_ordering_with_prefill_admitted_first():
    sched, bm = make(budget=6)
    long = new_seq(40, "long")
    short = new_seq(3, "short", start=200)
    # a state the running list can reach: the prefilling sequence ahead of a decoding one
    assert bm.allocate(long, 6)
    long.num_computed_tokens = 6
    assert bm.allocate(short, 3)
    short.num_computed_tokens = 3
    short.token_ids.append(5)
    for seq in (long, short):
        seq.status = SequenceStatus.RUNNING
    sched.running = [long, short]
    out = sched.schedule()
    assert names(out) == [("short", 1), ("long", 5)]
    assert not out.scheduled[0].is_prefill and out.scheduled[1].is_prefill
    assert sched.running == [long, short]  # the order of admission is kept


def test_new_sequences_join_the_running_batch_at_the_next_step():
    sched, bm = make(budget=32)
    a = new_seq(4, "a")
    sched.add(a)
    run(sched, sched.schedule())
    run(sched, sched.schedule())
    b = new_seq(6, "b", start=40)
    sched.add(b)
    out = sched.schedule()
    assert names(out) == [("a", 1), ("b", 6)]
    run(sched, out)
    out = sched.schedule()
    assert names(out) == [("a", 1), ("b", 1)]


def test_finished_sequences_leave_and_free_their_blocks():
    sched, bm = make(budget=32)
    a, b = new_seq(5, "a"), new_seq(5, "b", start=40)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())
    used = bm.num_used_blocks
    sched.finish(a, FinishReason.ABORT)
    assert a.status == SequenceStatus.FINISHED and a not in sched.running and a.finish_reason == FinishReason.ABORT
    assert a.block_table == [] and a.num_computed_tokens == 0 and bm.num_used_blocks == used - 2
    assert names(sched.schedule()) == [("b", 1)]
    # finishing a waiting sequence removes it from the queue
    c = new_seq(3, "c", start=80)
    sched.add(c)
    sched.finish(c, FinishReason.ABORT)
    assert not sched.waiting and c.status == SequenceStatus.FINISHED


def test_max_num_seqs():
    sched, bm = make(budget=100, max_num_seqs=2)
    seqs = [new_seq(3, f"r{i}", start=10 * i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert names(out) == [("r0", 3), ("r1", 3)]
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    run(sched, out)
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.running) == 2
    run(sched, out)
    sched.finish(seqs[0], FinishReason.ABORT)
    out = sched.schedule()
    assert [n for n, _ in names(out)] == ["r1", "r2"]


def test_parallel_samples_reserve_sequence_slots():
    sched, bm = make(budget=100, max_num_seqs=4)
    parent = new_seq(5, "p", n=3)
    sched.add(parent, parallel=parent.request.sequences[1:])
    other = new_seq(5, "q", start=50)
    other2 = new_seq(5, "s", start=90)
    sched.add(other)
    sched.add(other2)
    out = sched.schedule()
    # p holds 3 slots (itself + 2 unforked), q the 4th; s has to wait
    assert names(out) == [("p", 5), ("q", 5)]
    assert sched.reserved_slots == 2
    assert sched.unforked(parent) == parent.request.sequences[1:]
    # the schedule lists every draw: the parallel samples take a token from their parent's row
    assert out.draws == [(s.seq_id, 0) for s in parent.request.sequences] + [(other.seq_id, 1)]
    run(sched, out, token=8)  # the children sample from the parent's row, then share its blocks
    children = parent.request.sequences[1:]
    assert all(child.token_ids[-1] == 8 and child.block_table == parent.block_table for child in children)
    assert all(child.num_computed_tokens == parent.num_computed_tokens == 5 for child in children)
    assert sched.reserved_slots == 0 and sched.unforked(parent) == []
    assert len(sched.running) == 4 and all(c.status == SequenceStatus.RUNNING for c in children)
    out = sched.schedule()
    assert len(out.scheduled) == 4 and other2 in sched.waiting


def test_preemption_of_the_most_recently_admitted_goes_to_the_front():
    # 7 blocks of 4 tokens; three 8-token prompts take 2 blocks each; each decode needs a third
    sched, bm = make(num_blocks=7, budget=64)
    a, b, c = new_seq(8, "a"), new_seq(8, "b", start=100), new_seq(8, "c", start=200)
    for s in (a, b, c):
        sched.add(s)
    run(sched, sched.schedule())
    assert bm.num_free_blocks == 1
    late = new_seq(3, "late", start=300)
    sched.add(late)
    out = sched.schedule()  # a takes the last block; b needs one: c (admitted last) is preempted
    assert out.preempted == [c]
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert list(sched.waiting) == [c, late]  # the front of the queue
    assert sched.num_preemptions == 1 and c.num_preemptions == 1
    assert names(out) == [("a", 1), ("b", 1)]  # no admission in a step that preempted
    assert c.num_tokens == 9  # its sampled token is kept: it will be recomputed
    run(sched, out)
    sched.finish(a, FinishReason.ABORT)
    sched.finish(b, FinishReason.ABORT)
    out = sched.schedule()
    # re-admitted first; its first block survived in the prefix cache (b reused its tail block)
    assert names(out) == [("c", 9 - 4), ("late", 3)]
    assert c.num_cached_prompt_tokens == 4 and out.scheduled[0].samples


def test_two_victims_keep_their_order_at_the_front():
    sched, bm = make(num_blocks=4, budget=64)
    seqs = [new_seq(4, f"r{i}", start=10 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert len(out.scheduled) == 4 and bm.num_free_blocks == 0
    run(sched, out)
    out = sched.schedule()
    # r0 and r1 each need a new block: r3 then r2 are preempted
    assert out.preempted == [seqs[3], seqs[2]]
    assert list(sched.waiting) == [seqs[2], seqs[3]]
    assert names(out) == [("r0", 1), ("r1", 1)]


def test_a_sequence_preempts_itself_when_nothing_else_can_go():
    sched, bm = make(num_blocks=2, budget=64)
    a = new_seq(8, "a")
    sched.add(a)
    run(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted == [a] and out.scheduled == []
    assert list(sched.waiting) == [a] and bm.num_used_blocks == 0


def test_admission_waits_for_blocks():
    sched, bm = make(num_blocks=3, budget=64)
    a = new_seq(10, "a")
    b = new_seq(5, "b", start=50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert names(out) == [("a", 10)]
    assert list(sched.waiting) == [b]  # 2 blocks needed, 0 free
    run(sched, out)
    sched.finish(a, FinishReason.ABORT)
    assert names(sched.schedule()) == [("b", 5)]


def test_waiting_queue_is_fifo_without_skipping():
    sched, bm = make(num_blocks=4, budget=64)
    big = new_seq(20, "big")  # 5 blocks: never fits now
    small = new_seq(2, "small", start=60)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert out.scheduled == [] and list(sched.waiting) == [big, small]


def test_chunked_prefill_with_budget_one():
    sched, bm = make(budget=1)
    a = new_seq(3, "a")
    sched.add(a)
    got = []
    for _ in range(4):
        out = sched.schedule()
        got.append(names(out))
        run(sched, out)
    assert got == [[("a", 1)]] * 4
    assert a.num_computed_tokens == 4 and a.num_tokens == 5


@pytest.mark.parametrize("budget", [3, 8, 13])
def test_speculative_tokens_count_against_the_budget(budget):
    sched, bm = make(budget=budget)
    a = new_seq(2, "a")
    sched.add(a)
    run(sched, sched.schedule())
    out = sched.schedule(num_spec_tokens=lambda seq: 4)
    item = out.scheduled[0]
    assert item.num_spec_tokens == min(4, budget - 1)
    assert item.num_new_tokens == 1 + item.num_spec_tokens <= budget
    assert item.samples


def test_a_verified_draft_keeps_its_accepted_tokens_kv_and_registers_the_blocks_they_fill():
    sched, bm = make(budget=16)
    seq = new_seq(6, "a")
    sched.add(seq)
    run(sched, sched.schedule(), token=60)  # 7 tokens, 6 computed
    out = sched.schedule(num_spec_tokens=lambda s: 3)
    drafts = Draft([61, 62, 63], draft_num_computed=9)  # a draft model's KV after drafting: up to token 62
    out = out.with_drafts({seq.seq_id: drafts})
    assert out.scheduled[0].token_ids == [60, 61, 62, 63] and out.scheduled[0].num_sampled_rows == 4
    # the target accepted 2 of the 3 drafts, then chose 70
    result = SampledTokens(seq.seq_id, [61, 62, 70], [0, 1, 2], 6)
    output = ModelRunnerOutput(torch.zeros(4, 1), [result], num_accepted={seq.seq_id: 2})
    sched.update_from_output(out, output, never_stops)
    assert seq.token_ids == list(range(6)) + [60, 61, 62, 70]
    assert seq.num_computed_tokens == 9  # the rejected draft's KV is dropped, and its block slot
    assert seq.draft_num_computed == 9 and (seq.request.stats.draft_tokens, seq.request.stats.accepted_tokens) == (3, 2)
    assert len(seq.block_table) == bm.blocks_needed(9)
    # the second block (tokens 4-7) is full of computed tokens, two of them accepted drafts: registered with them
    assert bm.match_prefix(seq.token_ids) == seq.block_table[:2]


# ------------------------------------------------------------------------------ property-based workloads

workload = st.lists(  # (prompt length, output length, which shared prefix, arrival step)
    st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 2), st.integers(0, 6)),
    min_size=1,
    max_size=8,
)


def stops_at_max_tokens(seq, token_id, logits, row, entry):
    return FinishReason.LENGTH if seq.num_output_tokens >= seq.params.max_tokens else None


@settings(max_examples=80, deadline=None)
@given(
    jobs=workload,
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6),
    spare_blocks=st.integers(0, 12),
    prefix_caching=st.booleans(),
    priorities=st.lists(st.integers(-2, 2), max_size=8),  # request i's is priorities[i] (0 past the list)
)
def test_random_workloads_respect_limits_and_finish(
    jobs, budget, max_num_seqs, spare_blocks, prefix_caching, priorities
):
    longest = max(length + out for length, out, _, _ in jobs)
    num_blocks = -(-longest // SIZE) + spare_blocks  # every sequence fits alone, as build_request guarantees
    sched, bm = make(num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=budget, prefix_caching=prefix_caching)
    prefixes = [list(range(1000, 1030)), list(range(2000, 2030)), list(range(3000, 3030))]
    seqs = []
    for i, (length, out, prefix, arrival) in enumerate(jobs):
        params = SamplingParams(max_tokens=out, priority=priorities[i] if i < len(priorities) else 0)
        request = Request(ClientRequest(f"r{i}", "", prefixes[prefix][:length], params))
        seq = Sequence(request, 0, detokenizer=None)
        request.sequences = [seq]
        seqs.append((arrival, seq))
    finished = set()
    for step in range(2000):
        for arrival, seq in seqs:
            if arrival == step:
                sched.add(seq)
        if not sched.has_work() and step > 6:
            break
        queued = list(sched.waiting)
        out = sched.schedule()
        # admitted strictly by priority: none of those left waiting is of a better one than an admitted one
        admitted = [s.priority for s in queued if s.status == SequenceStatus.RUNNING]
        left = [s.priority for s in queued if s.status == SequenceStatus.WAITING]
        assert not admitted or not left or max(admitted) <= min(left)
        assert [s.priority for s in sched.waiting] == sorted(s.priority for s in sched.waiting)
        ids = [s.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        assert out.num_batched_tokens <= budget
        assert all(s.num_new_tokens > 0 for s in out.scheduled)
        assert len(sched.running) <= max_num_seqs
        assert not {s.seq_id for s in out.preempted} & set(ids)
        assert all(s.status == SequenceStatus.WAITING for s in out.preempted)
        for item in out.scheduled:
            assert len(out.sequences[item.seq_id].block_table) >= bm.blocks_needed(item.start + item.num_new_tokens)
        run(sched, out, stop_rule=stops_at_max_tokens)
        finished |= {item.seq_id for item in out.scheduled if out.sequences[item.seq_id].is_finished}
        held = {b for s in sched.running for b in s.block_table}
        assert bm.num_used_blocks == len(held)  # only running sequences hold blocks
        assert all(not s.block_table for s in sched.waiting)
    assert finished == {seq.seq_id for _, seq in seqs}, "a sequence never finished"
    assert bm.num_used_blocks == 0 and not sched.running and not sched.waiting
    for _, seq in seqs:
        assert seq.num_output_tokens == seq.params.max_tokens
