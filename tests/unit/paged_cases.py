"""The paged-KV test cases shared by the model runner's and the fused forward's tests: a small pool, block
tables scattered over it, and prompts of several lengths."""

from __future__ import annotations

import random

BLOCK = 4
NUM_BLOCKS = 64


def scattered_tables(num_seqs: int, blocks_each: int, seed: int = 0) -> list[list[int]]:
    """Disjoint, shuffled block tables: the KV of a sequence is not contiguous in the pool."""
    ids = list(range(1, NUM_BLOCKS))
    random.Random(seed).shuffle(ids)
    return [ids[i * blocks_each : (i + 1) * blocks_each] for i in range(num_seqs)]


PROMPTS = [
    [5, 17, 300, 4000, 12, 99, 1000, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
    [42, 43, 44],
    [1000, 2000, 3000, 4000, 5000, 6000, 7],
]
