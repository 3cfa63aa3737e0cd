"""Paged attention for Hugging Face models, registered as a `transformers` attention implementation.

The runner flattens every scheduled token of every sequence into one ragged batch (batch dimension 1, no
padding in the model's matmuls). Each layer's attention call lands here: the new keys and values are written
into the KV pool at their slots, then each sequence attends over its own blocks through its block table.
Short queries (decodes, speculative verification) are attended in one padded SDPA call; long prefill chunks
each get their own call, so one long prompt does not pad every decode to its length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "llm_paged"
_SHORT_QUERY = 16  # queries up to this length share one padded attention call


@dataclass
class AttentionGroup:
    """Sequences attended in one SDPA call."""

    query_index: torch.Tensor  # [N, Q] rows of the flat batch (padding repeats a valid row)
    block_tables: torch.Tensor  # [N, B] block ids (padding: block 0, masked out)
    mask: torch.Tensor  # [N, 1, Q, B * block_size] True where a query may attend
    out_rows: torch.Tensor  # [R] flat rows this group produces
    out_select: torch.Tensor  # [R] positions of those rows in the group's [N * Q] output


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] KV slot of every flat token
    groups: list[AttentionGroup]
    kv_cache: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]


@dataclass
class SeqSlice:
    """One sequence's share of the flat batch."""

    start_row: int  # first row in the flat batch
    num_tokens: int  # query length this step
    start_pos: int  # position of the first query token
    block_table: list[int]


def build_metadata(
    slices: list[SeqSlice], block_size: int, kv_cache: torch.Tensor
) -> AttentionMetadata:
    slots = []
    for s in slices:
        for pos in range(s.start_pos, s.start_pos + s.num_tokens):
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
    short = [s for s in slices if s.num_tokens <= _SHORT_QUERY]
    groups = [_group(short, block_size)] if short else []
    groups += [_group([s], block_size) for s in slices if s.num_tokens > _SHORT_QUERY]
    device = kv_cache.device
    if device.type != "cpu":
        groups = [AttentionGroup(*(t.to(device) for t in vars(g).values())) for g in groups]
    return AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), groups, kv_cache)


def _group(slices: list[SeqSlice], block_size: int) -> AttentionGroup:
    n = len(slices)
    max_q = max(s.num_tokens for s in slices)
    max_blocks = max(-(-(s.start_pos + s.num_tokens) // block_size) for s in slices)
    query_index = torch.empty(n, max_q, dtype=torch.long)
    block_tables = torch.zeros(n, max_blocks, dtype=torch.long)
    q_pos = torch.empty(n, max_q, dtype=torch.long)
    out_rows, out_select = [], []
    for i, s in enumerate(slices):
        rows = torch.arange(s.start_row, s.start_row + s.num_tokens)
        query_index[i, : s.num_tokens] = rows
        query_index[i, s.num_tokens :] = s.start_row
        positions = torch.arange(s.start_pos, s.start_pos + s.num_tokens)
        q_pos[i, : s.num_tokens] = positions
        q_pos[i, s.num_tokens :] = s.start_pos
        used = -(-(s.start_pos + s.num_tokens) // block_size)
        block_tables[i, :used] = torch.tensor(s.block_table[:used], dtype=torch.long)
        out_rows.append(rows)
        out_select.append(torch.arange(i * max_q, i * max_q + s.num_tokens))
    key_pos = torch.arange(max_blocks * block_size)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
    return AttentionGroup(query_index, block_tables, mask, torch.cat(out_rows), torch.cat(out_select))


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, H, T, D], key/value [1, KVH, T, D] for the flat batch; returns ([1, T, H, D], None)."""
    meta: AttentionMetadata = kwargs["paged_attention"]
    layer_cache = meta.kv_cache[module.layer_idx]
    kv_heads, head_dim = layer_cache.shape[-2:]
    key_cache = layer_cache[0].view(-1, kv_heads, head_dim)
    value_cache = layer_cache[1].view(-1, kv_heads, head_dim)
    key_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(key_cache.dtype))
    value_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(value_cache.dtype))

    q = query[0]  # [H, T, D]
    heads, total = q.shape[0], q.shape[1]
    out = q.new_empty(total, heads, head_dim)
    for group in meta.groups:
        n, max_q = group.query_index.shape
        group_q = q[:, group.query_index].permute(1, 0, 2, 3)  # [N, H, Q, D]
        shape = (n, -1, kv_heads, head_dim)
        group_k = layer_cache[0][group.block_tables].view(shape).transpose(1, 2).to(q.dtype)
        group_v = layer_cache[1][group.block_tables].view(shape).transpose(1, 2).to(q.dtype)
        attended = F.scaled_dot_product_attention(
            group_q, group_k, group_v, attn_mask=group.mask, scale=scaling, enable_gqa=kv_heads != heads
        )  # [N, H, Q, D]
        flat = attended.transpose(1, 2).reshape(n * max_q, heads, head_dim)
        out[group.out_rows] = flat[group.out_select]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
