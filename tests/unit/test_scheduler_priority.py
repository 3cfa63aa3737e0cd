"""backend/core/scheduler.py with request priorities (lower is served first): the queue by priority then arrival,
the running batch by priority, the lowest priority preempted first when blocks run out, and a waiting sequence
of a better priority preempting running ones of a lower one to get in. tests/unit/test_scheduler.py holds the
rest, all at the default priority, and a random workload with priorities."""

from __future__ import annotations

import pytest

from backend.core.request import FinishReason, SequenceStatus
from tests.unit.test_scheduler import make, names, new_seq, run


def ids(seqs):
    return [s.request.request_id for s in seqs]


def test_the_queue_is_ordered_by_priority_then_arrival():
    sched, bm = make(budget=8, max_num_seqs=8)
    for i, (name, priority) in enumerate([("a", 1), ("b", 0), ("c", 1), ("d", -1), ("e", 0)]):
        sched.add(new_seq(4, name, start=10 * i, priority=priority))
    assert ids(sched.waiting) == ["d", "b", "e", "a", "c"]
    out = sched.schedule()  # a budget of two prompts: the two best
    assert names(out) == [("d", 4), ("b", 4)]
    assert ids(sched.waiting) == ["e", "a", "c"]


def test_the_running_batch_is_served_by_priority_first():
    """A better-priority prompt takes the step's budget before the decodes of a worse one."""
    sched, bm = make(budget=5)
    low = new_seq(3, "low", priority=1)
    sched.add(low)
    run(sched, sched.schedule())  # low is decoding
    high = new_seq(20, "high", start=50, priority=0)
    sched.add(high)
    out = sched.schedule()
    assert names(out) == [("low", 1), ("high", 4)]  # admitted after the running batch, as at one priority
    run(sched, out)
    assert names(sched.schedule()) == [("high", 5)]  # then first: the whole budget


@pytest.mark.parametrize(
    ("priorities", "victim"),
    [
        ((0, 2, 1), "b"),  # the lowest priority, though c was admitted after it
        ((0, 1, 1), "c"),  # among equals the most recently admitted
        ((1, 0, 0), "a"),  # the first admitted, being the lowest
        ((0, 0, 0), "c"),  # one priority: the most recently admitted, as without priorities
    ],
)
def test_blocks_running_out_preempt_the_lowest_priority_first(priorities, victim):
    # 7 blocks of 4 tokens; three 8-token prompts take 2 blocks each; each decode needs a third
    sched, bm = make(num_blocks=7, budget=64)
    seqs = [new_seq(8, name, start=100 * i, priority=p) for i, (name, p) in enumerate(zip("abc", priorities))]
    for s in seqs:
        sched.add(s)
    run(sched, sched.schedule())
    assert bm.num_free_blocks == 1
    out = sched.schedule()
    assert ids(out.preempted) == [victim]
    assert sorted(n for n, _ in names(out)) == sorted(set("abc") - {victim})
    assert ids(sched.waiting) == [victim] and not out.preempted[0].block_table


def test_a_lower_priority_sequence_preempts_itself_rather_than_a_better_one():
    sched, bm = make(num_blocks=5, budget=64)
    low, high = new_seq(8, "low", priority=3), new_seq(8, "high", start=100)
    sched.add(low)
    run(sched, sched.schedule())
    sched.add(high)
    run(sched, sched.schedule())  # both decoding, one block free; each needs one
    out = sched.schedule()
    assert ids(out.preempted) == ["low"] and names(out) == [("high", 1)]


def test_a_better_priority_preempts_running_ones_of_a_lower_one_to_get_in():
    # 6 blocks; three 6-token prompts take them all (room for two more tokens each)
    sched, bm = make(num_blocks=6, budget=64)
    l1, l2, l3 = (new_seq(6, f"l{i}", start=100 * i, priority=p) for i, p in ((1, 0), (2, 1), (3, 0)))
    waiter = new_seq(4, "w", start=400, priority=1)
    for s in (l1, l2, l3, waiter):
        sched.add(s)
    run(sched, sched.schedule())
    assert bm.num_free_blocks == 0 and ids(sched.waiting) == ["w"]
    high = new_seq(4, "high", start=500, priority=-1)
    same = new_seq(4, "same", start=600, priority=0)
    sched.add(high)
    sched.add(same)
    out = sched.schedule()
    # l2 (the lowest priority) is taken out of the step and preempted; its 2 blocks admit high, and `same`
    # (better than l2) the last one; `w` would fit no more than it may go before l2
    assert ids(out.preempted) == ["l2"]
    assert names(out) == [("l1", 1), ("l3", 1), ("high", 4), ("same", 4)]
    assert bm.num_free_blocks == 0 and ids(sched.waiting) == ["l2", "w"]
    assert l2.status == SequenceStatus.WAITING and not l2.block_table and l2.num_computed_tokens == 0
    run(sched, out)
    out = sched.schedule()  # high first; `same`, whose decode needs a block, comes after its equals: itself
    assert ids(out.preempted) == ["same"] and names(out) == [("high", 1), ("l1", 1), ("l3", 1)]
    run(sched, out)
    for s in (l1, l3, high):
        sched.finish(s, FinishReason.ABORT)
    out = sched.schedule()
    assert names(out) == [("same", 5), ("l2", 7), ("w", 4)]
    run(sched, out)
    for s in (same, l2, waiter):
        sched.finish(s, FinishReason.ABORT)
    assert bm.num_used_blocks == 0 and not sched.has_work()


def test_a_better_priority_preempts_for_a_sequence_slot():
    sched, bm = make(budget=64, max_num_seqs=2)
    low, mid = new_seq(4, "low", priority=2), new_seq(4, "mid", start=50, priority=1)
    sched.add(low)
    sched.add(mid)
    run(sched, sched.schedule())
    sched.add(new_seq(4, "high", start=100, priority=0))
    sched.add(new_seq(4, "equal", start=150, priority=2))
    out = sched.schedule()
    assert ids(out.preempted) == ["low"] and names(out) == [("mid", 1), ("high", 4)]
    assert ids(sched.waiting) == ["low", "equal"]  # the preempted first among its priority
