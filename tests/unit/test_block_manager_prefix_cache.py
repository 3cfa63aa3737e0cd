"""backend/core/block_manager.py's prefix cache: chained hashes, longest match, revival of freed blocks, LRU
eviction, duplicates, and caching switched off."""

from __future__ import annotations

from backend.core.block_manager import BlockManager, chain_hash
from backend.core.scheduler import Scheduler
from tests.unit.block_pool import SIZE, admit, admit_and_compute, compute, new_seq

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
    scheduler = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    scheduler.add(b)
    assert scheduler.schedule().scheduled[0].start == 12  # admitted with the cached prefix computed
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
    admit(bm, c, bm.match_prefix(c.token_ids))
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
    admit(bm, b, shared)
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
    admit(bm, a, [])
    admit(bm, b, [])  # both admitted before either committed: no match, both compute
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
