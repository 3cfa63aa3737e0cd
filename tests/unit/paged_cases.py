"""The paged-KV test cases shared by the model runner's and the fused forward's tests: a small pool, block
tables scattered over it, and prompts of several lengths."""

from __future__ import annotations

import random

from backend.model.runner import ForwardItem

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


def ragged_step_items() -> list[list[ForwardItem]]:
    """Three steps over the prompts: the first's chunk beside the two others whole, the chunk's rest beside a
    decode and a verification of three positions (speculative-style), then three decodes."""
    tables = scattered_tables(3, 12, seed=5)
    a, b, c = PROMPTS
    return [
        [ForwardItem(a[:18], 0, tables[0], 0), ForwardItem(b, 0, tables[1], 1), ForwardItem(c, 0, tables[2], 2)],
        [
            ForwardItem(a[18:], 18, tables[0], 1),
            ForwardItem([9], len(b), tables[1], 1),
            ForwardItem([11, 12, 13], len(c), tables[2], 3),
        ],
        [
            ForwardItem([5], len(a), tables[0], 1),
            ForwardItem([6], len(b) + 1, tables[1], 1),
            ForwardItem([7], len(c) + 3, tables[2], 1),
        ],
    ]
