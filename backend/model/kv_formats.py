"""What the paged KV cache holds (EngineConfig.kv_cache_dtype) and how torch writes and reads it.

float32, float16 and bfloat16 caches are tensors of that dtype, written with `.to()` (rounded to nearest even) and
read back with `.to()` of the model's dtype. A q8_0 cache (llama.cpp's `-ctk q8_0 -ctv q8_0`) is a uint8 tensor
whose last dimension is a row's bytes: each key or value row of head_dim values is head_dim / 32 of llama.cpp's
block_q8_0 records (an fp16 scale d = max|x| / 127, then 32 int8 q = round(x / d)), 34 bytes per 32 values. One
tensor of the usual [layers, 2, blocks, block_size, kv_heads, *] shape, rather than int8 values and fp16 scales in
two, so that everything that moves or counts blocks (copy-on-write copies, the decoder stack's per-layer offsets,
the memory log) works on it unchanged, and a row is one contiguous record run, as llama.cpp lays it out.

q8_0's rounding is llama.cpp's reference quantize_row_q8_0_ref bit for bit: q = roundf(x * (1 / d)) of the fp32
d, half away from zero (torch.round rounds ties to even, so `_round_half_away` fixes them up), and d stored in fp16
rounded to nearest even. Our C++ kernels (kernels/kv_formats.cpp) write and read the same bytes; tests hold them to
this module bit for bit.
"""

from __future__ import annotations

import torch

Q8_0 = "q8_0"
Q8_0_BLOCK, Q8_0_RECORD = 32, 34  # values per record, bytes per record
# kv_cache_dtype -> the cache tensor's dtype (uint8: q8_0 records)
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, Q8_0: torch.uint8}


def is_q8_0(cache_dtype: torch.dtype) -> bool:
    return cache_dtype == torch.uint8


def row_width(cache_dtype: torch.dtype, head_dim: int) -> int:
    """Elements of a cache row (its last dimension) holding one head's `head_dim` values."""
    if is_q8_0(cache_dtype):
        if head_dim % Q8_0_BLOCK:
            raise ValueError(f"a q8_0 KV cache needs a head_dim that is a multiple of 32, not {head_dim}")
        return head_dim // Q8_0_BLOCK * Q8_0_RECORD
    return head_dim


def row_bytes(cache_dtype: torch.dtype, head_dim: int) -> int:
    return row_width(cache_dtype, head_dim) * cache_dtype.itemsize


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, ties away from zero (x - trunc(x) is exact in floating point)."""
    whole = torch.trunc(x)
    return torch.where((x - whole).abs() >= 0.5, whole + torch.sign(x), whole)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats -> [..., D / 32 * 34] uint8 block_q8_0 records (computed in fp32)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, Q8_0_BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = _round_half_away(blocks * inverse).to(torch.int8)
    records = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], -1)
    return records.reshape(*x.shape[:-1], -1)


def dequantize_q8_0(records: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., n * 34] uint8 records -> [..., n * 32] values q * d (in fp32, then `dtype`)."""
    blocks = records.reshape(*records.shape[:-1], -1, Q8_0_RECORD)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).reshape(*records.shape[:-1], -1).to(dtype)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., head_dim] as the cache holds them."""
    return quantize_q8_0(x) if is_q8_0(cache_dtype) else x.to(cache_dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows back as values [..., head_dim] of `dtype`."""
    return dequantize_q8_0(rows, dtype) if is_q8_0(rows.dtype) else rows.to(dtype)
