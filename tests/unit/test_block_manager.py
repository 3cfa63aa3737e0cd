"""backend/block_manager.py: the KV block pool's accounting: allocation, reference counts, prefix caching
(chained hashes, longest match, LRU eviction), fork + copy-on-write and trimming; plus a property-based test
that drives random operation sequences against a shadow copy of the KV contents."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.block_manager import BlockManager, chain_hash
from backend.request import Request, Sequence
from backend.sampling_params import SamplingParams

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
    assert seq.block_table == [] and seq.num_computed_tokens == 0
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


# ----------------------------------------------------------------------------------------- prefix cache

def test_chain_hash_depends_on_parent():
    tokens = (1, 2, 3, 4)
    assert chain_hash(None, tokens) == chain_hash(None, tokens)
    assert chain_hash(None, tokens) != chain_hash(chain_hash(None, (9, 9, 9, 9)), tokens)
    assert chain_hash(None, (1, 2, 3, 4)) != chain_hash(None, (1, 2, 3, 5))


def test_commit_registers_full_blocks_only():
    bm = BlockManager(8, SIZE)
    seq = new_seq(range(10))
    compute(bm, seq, 6)
    assert len(seq.block_hashes) == 1
    assert bm.blocks[seq.block_table[0]].token_ids == (0, 1, 2, 3)
    assert bm.blocks[seq.block_table[1]].hash is None
    compute(bm, seq, 4)
    assert len(seq.block_hashes) == 2
    assert seq.block_hashes[1] == chain_hash(seq.block_hashes[0], (4, 5, 6, 7))
    assert bm.blocks[seq.block_table[2]].hash is None  # 2 of 4 slots


def test_longest_cached_prefix_is_reused():
    bm = BlockManager(16, SIZE)
    a = admit_and_compute(bm, list(range(13)))  # 3 full blocks + 1 token
    assert bm.match_prefix(list(range(13)) + [50, 51]) == a.block_table[:3]
    assert bm.match_prefix(list(range(9)) + [77] * 6) == a.block_table[:2]
    assert bm.match_prefix(list(range(5))) == a.block_table[:1]
    assert bm.match_prefix([0, 1, 2, 99, 4, 5, 6, 7]) == []
    b = new_seq(list(range(13)) + [50, 51, 52])
    cached = bm.match_prefix(b.token_ids)
    bm.admit(b, cached)
    assert b.num_computed_tokens == 12 and b.num_cached_prompt_tokens == 12
    assert b.block_hashes == a.block_hashes[:3]
    assert all(bm.blocks[x].ref_count == 2 for x in cached)
    assert bm.prefix_queries == 13 + 16 and bm.prefix_hits == 12
    compute(bm, b)
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]


def test_same_block_after_a_different_prefix_does_not_match():
    bm = BlockManager(16, SIZE)
    admit_and_compute(bm, [1, 1, 1, 1, 5, 6, 7, 8, 0])
    # the second block's tokens are identical, but they follow a different first block
    assert bm.match_prefix([2, 2, 2, 2, 5, 6, 7, 8, 0]) == []
    # and a sequence that starts with that block alone does not match it either
    assert bm.match_prefix([5, 6, 7, 8, 0]) == []
    assert len(bm.match_prefix([1, 1, 1, 1, 5, 6, 7, 8, 0])) == 2


def test_at_least_one_token_is_left_uncached():
    bm = BlockManager(16, SIZE)
    a = admit_and_compute(bm, list(range(8)))
    assert len(a.block_hashes) == 2  # both blocks are cached
    assert bm.match_prefix(list(range(8))) == a.block_table[:1]  # but an identical prompt reuses one
    assert bm.match_prefix(list(range(9))) == a.block_table[:2]
    assert bm.match_prefix(list(range(4))) == []
    assert bm.match_prefix(list(range(1))) == [] and bm.match_prefix([]) == []
    for n in range(0, 20):
        assert len(bm.match_prefix(list(range(n)))) * SIZE < max(n, 1)


def test_freed_cached_blocks_are_revived():
    bm = BlockManager(6, SIZE)
    a = admit_and_compute(bm, list(range(9)))
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 2
    b = new_seq(list(range(9)))
    cached = bm.match_prefix(b.token_ids)
    assert cached == table[:2]
    # can_admit counts the revived blocks: 2 revived + 1 new of 6 free
    assert bm.can_admit(b, cached, 1)
    assert bm.can_admit(b, cached, 1, reserve=3) and not bm.can_admit(b, cached, 1, reserve=4)
    bm.admit(b, cached)
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 0
    assert [bm.blocks[x].ref_count for x in cached] == [1, 1]


def test_lru_eviction_order_of_freed_cached_blocks():
    bm = BlockManager(6, SIZE)
    a = admit_and_compute(bm, [1] * 8 + [0], "a")  # 3 blocks, 2 cached
    b = admit_and_compute(bm, [2] * 8 + [0], "b")  # 3 blocks, 2 cached
    a_table = list(a.block_table)
    bm.free(a)  # freed first: evicted first, its tail before its head
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 4
    # the next pops go: a's partial tail (no hash), a's 2nd block, a's 1st block, then b's
    filler = new_seq(range(200, 204))
    assert bm.allocate(filler, 4)
    assert filler.block_table == [a_table[2]]
    assert len(bm.match_prefix([1] * 8 + [0])) == 2
    filler.num_computed_tokens = 4
    assert bm.allocate(filler, 4)
    assert filler.block_table[1] == a_table[1]
    assert bm.match_prefix([1] * 8 + [0]) == [a_table[0]]  # the tail went first: the head still matches
    assert len(bm.match_prefix([2] * 8 + [0])) == 2
    filler.num_computed_tokens = 8
    assert bm.allocate(filler, 4)
    assert bm.match_prefix([1] * 8 + [0]) == []
    assert len(bm.match_prefix([2] * 8 + [0])) == 2  # b, freed later, survives longest


def test_revived_block_moves_to_the_back_of_the_lru():
    bm = BlockManager(4, SIZE)
    a = admit_and_compute(bm, [1] * 4 + [0], "a")
    b = admit_and_compute(bm, [2] * 4 + [0], "b")
    bm.free(a)
    bm.free(b)
    c = new_seq([1] * 4 + [9])  # reuses a's block, then frees it again: now the most recently freed
    bm.admit(c, bm.match_prefix(c.token_ids))
    compute(bm, c)
    bm.free(c)
    filler = new_seq(range(100, 108))
    assert bm.allocate(filler, 8)
    assert len(bm.match_prefix([1] * 4 + [0])) == 1
    assert bm.match_prefix([2] * 4 + [0]) == []


def test_cached_block_in_use_is_never_evicted():
    bm = BlockManager(5, SIZE)
    a = admit_and_compute(bm, [3] * 8 + [0], "a")
    b = new_seq([3] * 8 + [7, 7])
    shared = bm.match_prefix(b.token_ids)
    bm.admit(b, shared)
    compute(bm, b)
    bm.free(a)  # the shared blocks stay held by b
    assert [bm.blocks[x].ref_count for x in shared] == [1, 1]
    assert not any(x in bm._free for x in shared)
    hog = new_seq(range(100, 200))
    got = 0
    while bm.allocate(hog, SIZE):
        hog.num_computed_tokens += SIZE
        got += 1
    assert got == 5 - 3  # only the blocks b does not hold
    assert not set(hog.block_table) & set(b.block_table)
    assert bm.match_prefix([3] * 8 + [1]) == shared
    assert bm.blocks[shared[0]].token_ids == (3, 3, 3, 3)


def test_duplicate_content_is_registered_once():
    bm = BlockManager(8, SIZE)
    a = new_seq([4] * 5)
    b = new_seq([4] * 5)
    bm.admit(a, [])
    bm.admit(b, [])  # both admitted before either committed: no match, both compute
    compute(bm, a)
    compute(bm, b)
    assert a.block_hashes == b.block_hashes
    assert bm.blocks[a.block_table[0]].hash is not None
    assert bm.blocks[b.block_table[0]].hash is None  # the second copy is not registered
    assert bm.match_prefix([4] * 5) == [a.block_table[0]]
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_free_blocks == 1


def test_prefix_caching_disabled():
    bm = BlockManager(8, SIZE, enable_prefix_caching=False)
    a = admit_and_compute(bm, list(range(9)))
    assert a.block_hashes == [] and all(bm.blocks[b].hash is None for b in a.block_table)
    assert bm.match_prefix(list(range(9))) == []
    bm.free(a)
    assert bm.num_cached_free_blocks == 0


# ----------------------------------------------------------------------------------- fork, CoW, trim

def test_fork_shares_and_copy_on_write():
    bm = BlockManager(8, SIZE)
    parent = admit_and_compute(bm, list(range(6)))  # blocks [full, 2 of 4]
    child = new_seq(list(range(6)))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert child.num_computed_tokens == 6 and child.block_hashes == parent.block_hashes
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
    assert refs_from_tables(parent, child) == Counter(
        {b.block_id: b.ref_count for b in bm.blocks if b.ref_count}
    )


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(8, SIZE)
    parent = admit_and_compute(bm, list(range(8)))
    child = new_seq(list(range(8)))
    bm.fork(parent, child)
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
    bm.fork(parent, child)
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
        self.bm.admit(seq, cached)
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
        assert seq.block_table == [] and seq.num_computed_tokens == 0
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
        self.bm.fork(parent, child)
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
