"""backend/model/rotary_table.py: the table returns, bit for bit, what the model's rotary embedding returns per call,
for any positions (out of order, repeated, past the table's size so that it grows), in float32 and bfloat16, with
and without Llama-3's scaling; frequencies that depend on the sequence length keep the per-call path."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from backend.model.rotary_table import RotaryTable

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip


def rotary(rope_scaling: dict | None = None, head_dim: int = 64) -> LlamaRotaryEmbedding:
    config = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=4096, rope_scaling=rope_scaling
    )
    return LlamaRotaryEmbedding(config)


POSITION_SETS = [[0], [5], [17, 3, 3, 200], list(range(40, 77)), [1000, 12, 999], list(range(300))]


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_equals_the_embedding_per_call(scaling, dtype, head_dim):
    embedding = rotary(scaling, head_dim)
    table = RotaryTable(embedding)
    assert not table.per_step
    like = torch.zeros(1, 8, dtype=dtype)
    for positions in POSITION_SETS:
        p = torch.tensor(positions)
        cos, sin = table(like, p)
        want_cos, want_sin = embedding(like, p[None])
        assert cos.dtype == dtype and cos.shape == (len(positions), head_dim)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    assert table.cos.shape[0] >= 1001  # grew past its first chunk


def test_table_follows_a_change_of_dtype():
    table = RotaryTable(rotary())
    table(torch.zeros(1, 8), torch.tensor([3]))
    cos, _ = table(torch.zeros(1, 8, dtype=torch.bfloat16), torch.tensor([3]))
    assert cos.dtype == torch.bfloat16


def test_length_dependent_rotary_types_are_computed_per_call():
    embedding = rotary({"rope_type": "dynamic", "factor": 2.0})
    table = RotaryTable(embedding)
    assert table.per_step
    like, p = torch.zeros(1, 8), torch.tensor([4, 9000])
    cos, sin = table(like, p)
    want_cos, want_sin = embedding(like, p[None])
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    assert table.cos.numel() == 0
