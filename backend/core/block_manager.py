"""The KV block pool: fixed-size blocks, a free list, reference counts, prefix caching and copy-on-write.

This class only does the accounting; the tensors live in the model runner, which applies the block copies
that copy-on-write asks for before each forward pass.

Prefix caching: each full block whose KV has been computed is registered under a hash of its tokens chained
with its parent block's hash (blake2b, so equal hashes mean equal prefixes; the tokens are compared as well).
A freed block keeps its contents and hash; free blocks are handed out least-recently-freed first, so cached
prefixes survive as long as memory allows.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from backend.core.request import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None


def chain_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._num_cached_free = 0  # free blocks still holding a cached prefix
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for the runner
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    # ---- pool state -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reusable until evicted)."""
        return self._num_cached_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ---------------------------------------------------------------------------------
    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached prefix
            self._num_cached_free -= 1
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    def _retain(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            self._num_cached_free -= block.hash is not None
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released twice"
        if block.ref_count == 0:
            self._free[block_id] = None  # most recently freed: evicted last
            self._num_cached_free += block.hash is not None

    def match_prefix(self, token_ids: list[int], salt: bytes | None = None) -> list[int]:
        """Block ids of the longest cached run of full blocks that prefixes `token_ids`.

        At least one token is left uncached, so the sequence still has a position to compute logits from. `salt`
        (a sequence's `cache_salt`: its LoRA adapter) starts the chain, so equal tokens under another adapter
        never match.
        """
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        matched: list[int] = []
        parent = salt
        for start in range(0, len(token_ids) - 1 - (len(token_ids) - 1) % size, size):
            chunk = tuple(token_ids[start : start + size])
            parent = chain_hash(parent, chunk)
            block_id = self._cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            matched.append(block_id)
        return matched

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int, reserve: int = 0) -> bool:
        """Whether `seq` (not yet holding blocks) fits with `cached` prefix blocks and `num_new_tokens`."""
        total = self.blocks_needed(len(cached) * self.block_size + num_new_tokens)
        revived = sum(1 for block_id in cached if self.blocks[block_id].ref_count == 0)
        return total - len(cached) + revived + reserve <= self.num_free_blocks

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give a waiting sequence its cached prefix blocks; `allocate` adds the rest."""
        assert not seq.block_table
        for block_id in cached:
            self._retain(block_id)
        seq.block_table = list(cached)
        seq.block_hashes = [self.blocks[block_id].hash for block_id in cached]
        seq.num_cached_prompt_tokens = len(cached) * self.block_size
        self.prefix_queries += seq.num_prompt_tokens
        self.prefix_hits += seq.num_cached_prompt_tokens

    def slots_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `allocate(seq, num_new_tokens)` would take from the free list (new ones and copies)."""
        end = seq.num_computed_tokens + num_new_tokens
        needed = max(0, self.blocks_needed(end) - len(seq.block_table))
        first = seq.num_computed_tokens // self.block_size
        shared = sum(1 for b in seq.block_table[first:] if self.blocks[b].ref_count > 1)
        return needed + shared

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more KV entries; copy any shared block about to be written."""
        if self.slots_needed(seq, num_new_tokens) > self.num_free_blocks:
            return False
        first = seq.num_computed_tokens // self.block_size
        for index in range(first, len(seq.block_table)):
            old = seq.block_table[index]
            if self.blocks[old].ref_count > 1:  # copy-on-write
                new = self._pop_free()
                self.pending_copies.append((old, new))
                self._release(old)
                seq.block_table[index] = new
        end = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < self.blocks_needed(end):
            seq.block_table.append(self._pop_free())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes copy first."""
        for block_id in parent.block_table:
            self._retain(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):  # tail first: evicted before the prefix it extends
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []

    def trim(self, seq: Sequence) -> None:
        """Release blocks past the computed tokens (after a rejected speculation)."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for index in range(len(seq.block_hashes), min(seq.num_computed_tokens, seq.num_tokens) // size):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
            chunk = tuple(seq.token_ids[index * size : (index + 1) * size])
            block_hash = chain_hash(parent, chunk)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block.hash is None and block_hash not in self._cached:
                block.hash, block.token_ids = block_hash, chunk
                self._cached[block_hash] = block.block_id

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
