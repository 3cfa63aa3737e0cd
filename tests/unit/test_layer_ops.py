"""The C++ decoder-layer ops (backend/model/kernels/layer_ops.cpp) against torch on the same inputs: SiLU bit for
bit in whole vectors (both take torch's vectorised exp), attention over paged KV blocks up to summation order, for
head widths the vector path takes (multiples of 8) and the scalar path takes, and contexts that end inside a group
of 8 keys. Each test runs on every copy of the ops this CPU runs (baseline, AVX2, AVX-512), the KV readers'
copies with them, so that an AVX-512 machine tests the copies older CPUs take."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from backend.model import kernels
from backend.model.kv_formats import KV_DTYPES, dequantize_q8_0, from_cache, quantize_q8_0, to_cache
from tests.conftest import machine_lacks

COPIES = (0, 1, 2)  # the layer ops' copies: baseline, AVX2, AVX-512 (kernels/isa.h)
LAYER_OPS = ("add_rms_norm", "silu_mul", "rope_paged_attention")  # each takes `isa` last


class OnCopy:
    """The kernels module with the layer ops bound to one copy (`isa`): each op takes it as its last argument."""

    def __init__(self, module, isa: int):
        self.module, self.isa = module, isa

    def __getattr__(self, name: str):
        op = getattr(self.module, name)
        return functools.partial(op, isa=self.isa) if name in LAYER_OPS else op


@pytest.fixture(scope="module", params=COPIES, ids=[kernels.ISA_NAMES[i] for i in COPIES])
def ops(built_kernels, request):
    if request.param > built_kernels.best_isa():
        pytest.skip(machine_lacks(f"{kernels.ISA_NAMES[request.param]}, whose copy of the layer ops it would run"))
    return OnCopy(built_kernels, request.param)


def test_layer_ops_run_the_copy_for_this_cpus_instruction_set(built_kernels):
    """By default the layer ops run the copy for this CPU's instruction set, read from its flags at run time;
    clones named for a CPU model (`arch=haswell`) once left every AMD CPU on the baseline SSE2 copy."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert built_kernels.layer_ops_isa() == (2 if "avx512f" in flags else 1 if "avx2" in flags else 0)
    assert built_kernels.layer_ops_isa() == built_kernels.best_isa()


def test_layer_ops_refuse_a_copy_this_cpu_cannot_run(built_kernels):
    gate_up = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="no copy for instruction set 3"):
        built_kernels.silu_mul(gate_up, isa=3)  # the low-bit kernel's test-only copy: not a layer-ops copy
    if built_kernels.best_isa() < 2:
        with pytest.raises(RuntimeError, match="does not run instruction set 2"):
            built_kernels.silu_mul(gate_up, isa=2)


@pytest.mark.parametrize("delta", [False, True])
def test_add_rms_norm_is_hfs_rms_norm_of_the_sum(ops, delta):
    """hidden += delta in place, then weight * (hidden * rsqrt(mean(hidden^2) + eps)): up to the order of the sum
    of squares. 1536 values a row: the vector body; 29: the tail alone."""
    for width in (29, 1536):
        g = torch.Generator().manual_seed(width)
        hidden, weight = torch.randn(5, width, generator=g), torch.randn(width, generator=g)
        d = torch.randn(5, width, generator=g) if delta else None
        summed = hidden + d if delta else hidden.clone()
        want = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6))
        got = ops.add_rms_norm(hidden, d, weight, 1e-6)
        assert torch.equal(hidden, summed)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("width", [1, 7, 29, 32, 1536])
def test_silu_mul_is_torchs_silu_times_up(ops, width):
    """Bit for bit where torch runs its vector loop over the whole row (widths in whole vectors, as the models'
    are); torch takes std::exp for the last few values of a row, we take the vector exp for all of them, and the
    baseline copy, which has no vector exp, std::exp for every value. 40 rows: wide rows are shared out to the
    kernels' pool in chunks."""
    gate_up = torch.randn(40, 2 * width, generator=torch.Generator().manual_seed(width)) * 8
    want = torch.nn.functional.silu(gate_up[:, :width]) * gate_up[:, width:]
    got = ops.silu_mul(gate_up)
    if width % 16 == 0 and ops.isa > 0:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=3e-7, atol=0)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


ATTENTION_CASES = [(64, [1, 13, 300]), (16, [8, 17]), (12, [5, 21]), (96, [2, 33, 70])]


@pytest.mark.parametrize(
    "dim,contexts,kv_dtype",
    [(d, c, t) for d, c in ATTENTION_CASES for t in KV_DTYPES if t != "q8_0" or d % 32 == 0],
)
def test_rope_paged_attention_is_softmax_attention_over_the_blocks(ops, dim, contexts, kv_dtype):
    """Rows of sequences whose blocks are scattered over the cache: each writes its rotated key and its value at
    its slot and attends over its sequence's positions 0..p (3 query heads per KV head). A 16-bit or q8_0 cache
    holds them as kv_formats.py writes them in torch (bit for bit), and attention reads them back as float32."""
    g = torch.Generator().manual_seed(dim)
    heads, kv_heads, block, blocks = 6, 2, 16, 64
    dtype = KV_DTYPES[kv_dtype]
    cache = to_cache(torch.randn(2, blocks, block, kv_heads, dim, generator=g), dtype)
    rows = len(contexts)
    need = [(c + block - 1) // block for c in contexts]
    order = torch.randperm(blocks, generator=g)
    tables = torch.zeros(rows, max(need), dtype=torch.long)
    taken = 0
    for r, n in enumerate(need):
        tables[r, :n] = order[taken : taken + n]
        taken += n
    positions = torch.tensor(contexts) - 1
    slots = tables[torch.arange(rows), positions // block] * block + positions % block
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    angle = positions[:, None].float() * torch.rand(dim, generator=g)
    cos, sin = angle.cos(), angle.sin()
    scale = dim**-0.5
    expected_cache = cache.clone()
    got = ops.rope_paged_attention(
        qkv, cos, sin, cache, slots, positions, torch.arange(rows), tables, heads, kv_heads, scale
    )

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    for r in range(rows):
        flat = expected_cache.view(2, blocks * block, kv_heads, -1)
        flat[0, slots[r]] = to_cache(rotate(k[r].view(kv_heads, dim), cos[r], sin[r]), dtype)
        flat[1, slots[r]] = to_cache(v[r].view(kv_heads, dim), dtype)
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    expected_cache = from_cache(expected_cache, torch.float32)
    for r, context in enumerate(contexts):
        where = (tables[r, :, None] * block + torch.arange(block)).flatten()[:context]
        keys = expected_cache[0].view(blocks * block, kv_heads, dim)[where].repeat_interleave(3, 1)  # [C, H, D]
        values = expected_cache[1].view(blocks * block, kv_heads, dim)[where].repeat_interleave(3, 1)
        query = rotate(q[r].view(heads, dim), cos[r], sin[r])
        weights = torch.softmax(torch.einsum("hd,chd->hc", query, keys) * scale, -1)
        want = torch.einsum("hc,chd->hd", weights, values).reshape(-1)
        torch.testing.assert_close(got[r], want, rtol=2e-6, atol=2e-6)


def q8_0_rows() -> torch.Tensor:
    """Rows of 128 values (4 records each) that test the rounding: zeros; a block whose d is exactly 1 holding
    ties (x.5, both signs: llama.cpp's roundf rounds them away from zero, torch.round to even); a tiny block whose
    fp16 d underflows to 0; large, small and mixed magnitudes."""
    g = torch.Generator().manual_seed(80)
    ties = torch.tensor([127.0, -126.5, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5] * 4)
    blocks = [
        torch.zeros(32),
        ties,
        torch.randn(32, generator=g) * 1e-7,
        torch.randn(32, generator=g) * 300,
        torch.randn(32, generator=g),
        torch.randn(32, generator=g) * torch.logspace(-4, 2, 32),
        -ties,
        torch.full((32,), -3.0),
    ]
    return torch.stack(blocks).view(2, 128)


def test_q8_0_records_are_llama_cpps_reference_bit_for_bit(ops):
    """The C++ cache write quantizes keys and values into the bytes kv_formats.quantize_q8_0 computes (ties away
    from zero), and its read gives kv_formats.dequantize_q8_0's values: with one position in context a row's
    attention output is its value row, q * d, exactly. A rotation of angle 0 leaves the key as it is."""
    rows, dim = 2, 128
    values = q8_0_rows()
    keys = values.flip(0) * 0.25
    records = quantize_q8_0(values)
    assert records.view(-1, 34)[1, 2:].view(torch.int8)[:8].tolist() == [127, -127, 3, -3, 1, -1, 2, -2]
    cache = torch.zeros(2, 4, 16, 1, dim // 32 * 34, dtype=torch.uint8)
    qkv = torch.cat([torch.randn(rows, dim), keys, values], 1)
    slots = torch.tensor([0, 16])  # position 0 of blocks 0 and 1
    out = ops.rope_paged_attention(
        qkv,
        torch.ones(rows, dim),
        torch.zeros(rows, dim),
        cache,
        slots,
        torch.zeros(rows, dtype=torch.long),
        torch.arange(rows),
        torch.tensor([[0], [1]]),
        1,
        1,
        dim**-0.5,
    )
    written = cache.view(2, -1, dim // 32 * 34)[:, slots]
    assert torch.equal(written[0], quantize_q8_0(keys))
    assert torch.equal(written[1], records)
    assert torch.equal(out, dequantize_q8_0(records))


def test_attention_by_kv_group_equals_attention_head_by_head(ops):
    """A step of many rows attends a KV head's query heads together (each key and value read once for the
    group); one row attends head by head. Every head's result is the same bit for bit either way."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, block, blocks = 6, 2, 64, 16, 256
    contexts = torch.randint(1, 70, (40,), generator=g)  # 40 rows x 2 KV heads: groups for up to 20 threads
    rows = len(contexts)
    need = (contexts + block - 1) // block
    tables = torch.randperm(blocks, generator=g)[: rows * int(need.max())].view(rows, -1)
    positions = contexts - 1
    slots = tables[torch.arange(rows), positions // block] * block + positions % block
    cache = torch.randn(2, blocks, block, kv_heads, dim, generator=g)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    cos, sin = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)
    seqs, scale = torch.arange(rows), dim**-0.5
    together = ops.rope_paged_attention(qkv, cos, sin, cache, slots, positions, seqs, tables, heads, kv_heads, scale)
    for r in range(rows):
        alone = ops.rope_paged_attention(
            qkv[r : r + 1],
            cos[r : r + 1],
            sin[r : r + 1],
            cache,
            slots[r : r + 1],
            positions[r : r + 1],
            seqs[r : r + 1],
            tables,
            heads,
            kv_heads,
            scale,
        )
        torch.testing.assert_close(together[r], alone[0], rtol=0, atol=0)
