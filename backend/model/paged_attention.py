"""Paged attention for Hugging Face models, registered as a `transformers` attention implementation.

The runner flattens every scheduled token of every sequence into one ragged batch (batch dimension 1, no
padding in the model's matmuls). Each layer's attention call lands here: the new keys and values are written
into the KV pool at their slots, then each sequence attends over its own blocks through its block table.
Short queries (decodes, speculative verification) are attended in one padded SDPA call; long prefill chunks
each get their own call, so one long prompt does not pad every decode to its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from backend.model.kv_formats import from_cache, to_cache

ATTENTION_NAME = "llm_paged"
_SHORT_QUERY = 16  # queries up to this length share one padded attention call


@dataclass
class AttentionGroup:
    """Sequences attended in one SDPA call, padded to the longest query and the longest block table.

    Grouped-query attention is folded into the query dimension: the `R` query heads that share a KV head
    attend as R * Q query rows of that head, which lets SDPA read each KV head once (several times faster in
    bf16 than SDPA's own GQA expansion) with the same arithmetic."""

    query_index: torch.Tensor | None  # [N * Q] rows of the flat batch (padding repeats a valid row); None:
    # the group is the whole flat batch in order (every query of one length), so no gather or scatter
    num_queries: int  # Q
    block_ids: torch.Tensor  # [N * B] block ids, table after table (padding: block 0, masked out)
    mask: torch.Tensor  # [N, 1, R * Q, B * block_size] True where a query may attend
    out_rows: torch.Tensor  # [rows] flat rows this group produces
    out_select: torch.Tensor  # [rows] positions of those rows in the group's [N * Q] output
    positions: torch.Tensor  # [N, Q] each query's position (padding repeats a valid one)
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> mask, built on first use

    def mask_within(self, window: int | None) -> torch.Tensor:
        """The mask, limited to the last `window` positions (Hugging Face's sliding window: key > query - window)
        where a layer has one (Gemma 2/3's sliding layers, Phi-3); built once per step and window."""
        if not window:
            return self.mask
        if window not in self.windowed:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            recent = key_pos[None, None, :] > self.positions[:, :, None] - window  # [N, Q, K]
            repeats = self.mask.shape[2] // self.num_queries  # the R query heads of a KV head, as the mask's rows
            self.windowed[window] = self.mask & recent.unsqueeze(1).repeat(1, 1, repeats, 1)
        return self.windowed[window]


@dataclass
class SeqSlice:
    """One sequence's share of the flat batch."""

    start_row: int  # first row in the flat batch
    num_tokens: int  # query length this step
    start_pos: int  # position of the first query token
    block_table: list[int]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] KV slot of every flat token
    kv_cache: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim (q8_0: a row's bytes)]
    slices: list[SeqSlice]
    block_size: int
    queries_per_kv: int
    # For a step of short queries only (decodes, verification), what attention in place over the blocks
    # needs (kernels/layer_ops.cpp): each row's sequence and every sequence's block table, padded with 0.
    row_seq: torch.Tensor | None = None  # [T]
    block_tables: torch.Tensor | None = None  # [S, max_blocks]

    @cached_property
    def groups(self) -> list[AttentionGroup]:
        """The SDPA calls of `paged_attention` (short queries share one, each long prefill chunk gets its own),
        built on first use: the in-place attention of our layer ops never needs them."""
        short = [s for s in self.slices if s.num_tokens <= _SHORT_QUERY]
        groups = [_group(short, self.block_size, self.queries_per_kv)] if short else []
        groups += [
            _group([s], self.block_size, self.queries_per_kv) for s in self.slices if s.num_tokens > _SHORT_QUERY
        ]
        if len(groups) == 1 and _covers_in_order(groups[0], self.slot_mapping.numel()):
            groups[0].query_index = None
        device = self.kv_cache.device
        return groups if device.type == "cpu" else [_to_device(g, device) for g in groups]


def build_metadata(
    slices: list[SeqSlice], block_size: int, kv_cache: torch.Tensor, queries_per_kv: int = 1
) -> AttentionMetadata:
    """Everything every layer's attention needs this step, built once: KV slots, and for a step of short queries
    on the CPU the block tables our in-place attention reads (the SDPA groups follow on first use)."""
    slots = []
    for s in slices:
        for pos in range(s.start_pos, s.start_pos + s.num_tokens):
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
    device = kv_cache.device
    meta = AttentionMetadata(
        torch.tensor(slots, dtype=torch.long, device=device), kv_cache, slices, block_size, queries_per_kv
    )
    if device.type == "cpu" and all(s.num_tokens <= _SHORT_QUERY for s in slices):
        width = max(len(s.block_table) for s in slices)
        meta.block_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in slices])
        meta.row_seq = torch.tensor([i for i, s in enumerate(slices) for _ in range(s.num_tokens)])
    return meta


def _covers_in_order(group: AttentionGroup, total_rows: int) -> bool:
    rows = group.query_index
    return rows.numel() == total_rows and bool(torch.equal(rows, torch.arange(total_rows)))


def _to_device(group: AttentionGroup, device: torch.device) -> AttentionGroup:
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(group).items()}
    return AttentionGroup(**moved)


def _group(slices: list[SeqSlice], block_size: int, queries_per_kv: int) -> AttentionGroup:
    n = len(slices)
    max_q = max(s.num_tokens for s in slices)
    max_blocks = max(-(-(s.start_pos + s.num_tokens) // block_size) for s in slices)
    query_index = torch.empty(n, max_q, dtype=torch.long)
    block_ids = torch.zeros(n, max_blocks, dtype=torch.long)
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
        block_ids[i, :used] = torch.tensor(s.block_table[:used], dtype=torch.long)
        out_rows.append(rows)
        out_select.append(torch.arange(i * max_q, i * max_q + s.num_tokens))
    key_pos = torch.arange(max_blocks * block_size)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1).repeat(1, 1, queries_per_kv, 1)
    return AttentionGroup(
        query_index.flatten(), max_q, block_ids.flatten(), mask, torch.cat(out_rows), torch.cat(out_select), q_pos
    )


def paged_attention(
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's keys and values into layer `layer`'s blocks, then attend every sequence over its own
    blocks (the last `sliding_window` positions only, where given; scores soft-capped as `softcap * tanh(s /
    softcap)`, where given). query [T, H, D], key/value [T, KVH, D] for the flat batch; returns [T, H, D]."""
    layer_cache = meta.kv_cache[layer]
    _, _, block_size, kv_heads, width = layer_cache.shape  # width: head_dim, or a q8_0 row's bytes (kv_formats.py)
    layer_cache[0].view(-1, kv_heads, width).index_copy_(0, meta.slot_mapping, to_cache(key, layer_cache.dtype))
    layer_cache[1].view(-1, kv_heads, width).index_copy_(0, meta.slot_mapping, to_cache(value, layer_cache.dtype))
    total, heads, head_dim = query.shape
    out = None if meta.groups and meta.groups[0].query_index is None else query.new_empty(total, heads, head_dim)
    for group in meta.groups:
        q_len = group.num_queries
        n = group.mask.shape[0]
        group_q = query if group.query_index is None else query[group.query_index]
        # [N * Q, H, D] -> [N, KVH, R * Q, D], query rows ordered (r, q) within each KV head
        group_q = group_q.view(n, q_len, kv_heads, heads // kv_heads, head_dim).permute(0, 2, 3, 1, 4)
        group_q = group_q.reshape(n, kv_heads, -1, head_dim)
        kv = from_cache(layer_cache.index_select(1, group.block_ids), query.dtype)
        kv = kv.view(2, n, -1, kv_heads, head_dim).transpose(2, 3)
        mask = group.mask_within(sliding_window)
        if softcap:
            attended = _softcapped_attention(group_q, kv[0], kv[1], mask, scale, softcap)
        else:
            attended = F.scaled_dot_product_attention(group_q, kv[0], kv[1], attn_mask=mask, scale=scale)
        # [N, KVH, R * Q, D] -> [N * Q, H, D]
        flat = attended.view(n, heads, q_len, head_dim).transpose(1, 2).reshape(n * q_len, heads, head_dim)
        if out is None:
            return flat
        out[group.out_rows] = flat[group.out_select]
    return out


def _softcapped_attention(query, key, value, mask, scale: float, softcap: float) -> torch.Tensor:
    """Attention with Gemma 2's capped scores, as Hugging Face's eager attention computes it (SDPA has no cap)."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


def hf_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """`transformers` attention interface: query [1, H, T, D], key/value [1, KVH, T, D]; returns
    ([1, T, H, D], None)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(
        module.layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        kwargs["paged_attention"],
        scale,
        kwargs.get("sliding_window"),
        kwargs.get("softcap"),
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, hf_attention_forward)
