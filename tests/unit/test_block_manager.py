"""backend/core/block_manager.py: the KV block pool's accounting: allocation, reference counts, fork +
copy-on-write and trimming; plus a property-based test that drives random operation sequences against a shadow
copy of the KV contents (the prefix cache's own tests: test_block_manager_prefix_cache.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.core.block_manager import BlockManager
from backend.core.request import Sequence
from tests.unit.block_pool import SIZE, admit, admit_and_compute, fork, new_seq, refs_from_tables

# ------------------------------------------------------------------------------------------ allocation


def test_allocate_and_free():
    bm = BlockManager(8, SIZE)
    seq = new_seq(range(10))
    assert bm.blocks_needed(10) == 3 and bm.blocks_needed(8) == 2 and bm.blocks_needed(0) == 0
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    seq.num_computed_tokens = 10
    assert bm.allocate(seq, 2)  # still inside the third block
    assert len(seq.block_table) == 3
    assert bm.allocate(seq, 3)  # crosses into a fourth
    assert len(seq.block_table) == 4
    table = list(seq.block_table)
    bm.free(seq)
    assert seq.block_table == []  # (its computed count goes back to 0 in the scheduler: test_scheduler.py)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    assert all(bm.blocks[b].ref_count == 0 for b in table)


def test_exhaustion_returns_false_and_changes_nothing():
    bm = BlockManager(4, SIZE)
    a, b = new_seq(range(12)), new_seq(range(100, 110))
    assert bm.allocate(a, 12)
    assert bm.num_free_blocks == 1
    assert bm.slots_needed(b, 10) == 3
    assert not bm.allocate(b, 10)
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate(b, 4)
    assert bm.num_free_blocks == 0
    assert not bm.allocate(new_seq([1]), 1)


def test_double_free_is_detected():
    bm = BlockManager(4, SIZE)
    seq = new_seq(range(4))
    bm.allocate(seq, 4)
    block = seq.block_table[0]
    bm._release(block)
    with pytest.raises(AssertionError):
        bm._release(block)


# ----------------------------------------------------------------------------------- fork, CoW, trim


def test_fork_shares_and_copy_on_write():
    bm = BlockManager(8, SIZE)
    parent = admit_and_compute(bm, list(range(6)))  # blocks [full, 2 of 4]
    child = new_seq(list(range(6)))
    fork(bm, parent, child)
    assert child.block_table == parent.block_table
    assert child.block_hashes == parent.block_hashes  # (its computed count: the scheduler's, test_scheduler.py)
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    assert bm.num_used_blocks == 2
    head, tail = parent.block_table
    parent.token_ids.append(100)
    child.token_ids.append(200)
    assert bm.slots_needed(parent, 1) == 1  # the copy
    assert bm.allocate(parent, 1)
    new_tail = parent.block_table[1]
    assert new_tail != tail and parent.block_table[0] == head
    assert bm.pending_copies == [(tail, new_tail)]
    assert child.block_table == [head, tail]  # the other sequence is untouched
    assert bm.blocks[tail].ref_count == 1 and bm.blocks[new_tail].ref_count == 1
    assert bm.blocks[head].ref_count == 2
    assert bm.slots_needed(child, 1) == 0
    assert bm.allocate(child, 1)  # now the only holder: writes in place
    assert child.block_table == [head, tail]
    assert bm.take_pending_copies() == [(tail, new_tail)]
    assert bm.pending_copies == [] and bm.take_pending_copies() == []
    assert refs_from_tables(parent, child) == Counter({b.block_id: b.ref_count for b in bm.blocks if b.ref_count})


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(8, SIZE)
    parent = admit_and_compute(bm, list(range(8)))
    child = new_seq(list(range(8)))
    fork(bm, parent, child)
    parent.token_ids.append(1)
    child.token_ids.append(2)
    assert bm.allocate(parent, 1) and bm.allocate(child, 1)
    assert bm.pending_copies == []
    assert parent.block_table[:2] == child.block_table[:2]
    assert parent.block_table[2] != child.block_table[2]
    assert bm.num_used_blocks == 4


def test_copy_on_write_needs_a_free_block():
    bm = BlockManager(2, SIZE)
    parent = admit_and_compute(bm, list(range(6)))
    child = new_seq(list(range(6)))
    fork(bm, parent, child)
    assert bm.num_free_blocks == 0
    assert not bm.allocate(parent, 1)
    assert bm.pending_copies == [] and parent.block_table == child.block_table
    bm.free(child)
    assert bm.allocate(parent, 1) and bm.pending_copies == []


def test_trim_releases_blocks_past_the_computed_tokens():
    bm = BlockManager(8, SIZE)
    seq = admit_and_compute(bm, list(range(7)))
    assert bm.allocate(seq, 1 + 6)  # a decode plus a 6-token lookahead: up to position 14
    assert len(seq.block_table) == 4
    seq.num_computed_tokens += 2  # only 2 of them were accepted
    bm.trim(seq)
    assert len(seq.block_table) == bm.blocks_needed(9) == 3
    assert bm.num_used_blocks == 3
    seq.num_computed_tokens = 8
    bm.trim(seq)
    assert len(seq.block_table) == 2 and bm.num_used_blocks == 2


# ------------------------------------------------------------------------- property-based: random ops

BASES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 0, 0, 0, 0, 9, 9], [7] * 12)


class BlockPoolMachine(RuleBasedStateMachine):
    """Random admit/compute/fork/commit/free/preempt/trim against a shadow KV: every computed position of
    every live sequence must hold that sequence's KV (a position's KV depends on the whole prefix up to it,
    so the shadow stores that prefix), and reference counts must equal table membership."""

    NUM_BLOCKS = 10

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, SIZE, enable_prefix_caching=True)
        self.kv: dict[int, list] = {b: [None] * SIZE for b in range(self.NUM_BLOCKS)}
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.counter = 0

    # -- helpers
    def _apply_copies(self):
        for src, dst in self.bm.take_pending_copies():
            self.kv[dst] = list(self.kv[src])

    def _write(self, seq: Sequence, n: int):
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.kv[seq.block_table[pos // SIZE]][pos % SIZE] = tuple(seq.token_ids[: pos + 1])
        seq.num_computed_tokens += n
        self.bm.commit(seq)

    # -- rules
    @rule(base=st.sampled_from(BASES), cut=st.integers(1, 12), suffix=st.lists(st.integers(0, 2), max_size=6))
    def add(self, base, cut, suffix):
        self.counter += 1
        self.waiting.append(new_seq(base[:cut] + suffix, f"r{self.counter}"))

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 12))
    def admit(self, index, chunk):
        seq = self.waiting[index % len(self.waiting)]
        cached = self.bm.match_prefix(seq.token_ids)
        for i, block_id in enumerate(cached):  # a hit really holds those tokens
            for slot in range(SIZE):
                assert self.kv[block_id][slot] == tuple(seq.token_ids[: i * SIZE + slot + 1])
        num_new = min(seq.num_tokens - len(cached) * SIZE, chunk)
        if not self.bm.can_admit(seq, cached, num_new):
            return
        self.waiting.remove(seq)
        admit(self.bm, seq, cached)
        assert self.bm.allocate(seq, num_new), "can_admit promised room"
        self._apply_copies()
        self._write(seq, num_new)
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 9), token=st.integers(0, 2))
    def step(self, index, chunk, token):
        seq = self.running[index % len(self.running)]
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(token)  # a decode: the sampled token joins the sequence
        n = min(seq.num_uncomputed_tokens, chunk)
        free_before = self.bm.num_free_blocks
        needed = self.bm.slots_needed(seq, n)
        if self.bm.allocate(seq, n):
            assert self.bm.num_free_blocks == free_before - needed
            self._apply_copies()
            self._write(seq, n)
        else:
            assert needed > free_before
            self.preempt_seq(seq)

    def preempt_seq(self, seq):
        self.running.remove(seq)
        self.bm.free(seq)
        assert seq.block_table == []
        seq.num_computed_tokens = 0  # recomputed from the start (the scheduler's part of a preemption)
        self.waiting.insert(0, seq)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def preempt(self, index):
        self.preempt_seq(self.running[index % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def fork(self, index):
        parent = self.running[index % len(self.running)]
        child = Sequence(parent.request, len(parent.request.sequences), detokenizer=None)
        parent.request.sequences.append(child)
        child.token_ids = list(parent.token_ids)
        fork(self.bm, parent, child)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        seq = self.running.pop(index % len(self.running))
        self.bm.free(seq)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), lookahead=st.integers(1, 6), accepted=st.integers(0, 6))
    def speculate(self, index, lookahead, accepted):
        seq = self.running[index % len(self.running)]
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(0)
        n = seq.num_uncomputed_tokens
        if not self.bm.allocate(seq, n + lookahead):
            return
        self._apply_copies()
        self._write(seq, n)
        accepted = min(accepted, lookahead)
        for i in range(accepted):
            seq.token_ids.append(1 + i % 2)
        if accepted:
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + accepted):
                self.kv[seq.block_table[pos // SIZE]][pos % SIZE] = tuple(seq.token_ids[: pos + 1])
            seq.num_computed_tokens += accepted
            self.bm.commit(seq)
        self.bm.trim(seq)
        assert len(seq.block_table) == self.bm.blocks_needed(seq.num_computed_tokens)

    # -- invariants
    @invariant()
    def ref_counts_match_tables(self):
        holders = refs_from_tables(*self.running)
        for block in self.bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), block.block_id
            assert (block.ref_count == 0) == (block.block_id in self.bm._free)
        assert self.bm.num_free_blocks + len(holders) == self.NUM_BLOCKS
        for seq in self.waiting:
            assert seq.block_table == []

    @invariant()
    def computed_kv_holds_the_sequence_tokens(self):
        for seq in self.running:
            assert len(seq.block_table) >= self.bm.blocks_needed(seq.num_computed_tokens)
            assert len(seq.block_hashes) == seq.num_computed_tokens // SIZE
            for pos in range(seq.num_computed_tokens):
                kv = self.kv[seq.block_table[pos // SIZE]][pos % SIZE]
                assert kv == tuple(seq.token_ids[: pos + 1]), (seq.seq_id, pos)

    @invariant()
    def cache_index_is_consistent(self):
        for block_hash, block_id in self.bm._cached.items():
            block = self.bm.blocks[block_id]
            assert block.hash == block_hash
            assert tuple(kv[-1] for kv in self.kv[block_id]) == block.token_ids
        cached_free = sum(self.bm.blocks[b].hash is not None for b in self.bm._free)
        assert self.bm.num_cached_free_blocks == cached_free

    def teardown(self):
        for seq in list(self.running):
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.NUM_BLOCKS
        assert self.bm.num_used_blocks == 0
        assert all(block.ref_count == 0 for block in self.bm.blocks)
        assert sorted(self.bm._free) == list(range(self.NUM_BLOCKS))


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
