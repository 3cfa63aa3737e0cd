"""backend/model/linear.py: fused dense projections, and the weight-only 4-/8-bit kinds against dense arithmetic."""

from __future__ import annotations

import pytest
import torch

from backend.model.linear import GROUP_SIZE, DenseLinear, Int4Linear, Int8Linear, make_linear


def q4_1_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Weights on a GGUF Q4_1 grid: each block of 32 inputs is d * q + m with q in 0..15, both ends used."""
    g = torch.Generator().manual_seed(seed)
    blocks = in_features // GROUP_SIZE
    q = torch.randint(0, 16, (out_features, blocks, GROUP_SIZE), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_features, blocks, 1, generator=g) * 0.02 + 0.001).to(torch.bfloat16).float()
    m = (torch.randn(out_features, blocks, 1, generator=g) * 0.1).to(torch.bfloat16).float()
    return (d * q + m).reshape(out_features, in_features)


def test_concatenated_projections_equal_separate_ones():
    torch.manual_seed(0)
    ws = [torch.randn(n, 64) for n in (32, 16, 16)]
    bs = [torch.randn(32), None, torch.randn(16)]
    x = torch.randn(5, 64)
    fused = make_linear(ws, bs)
    assert isinstance(fused, DenseLinear) and fused.out_features == 64
    expected = torch.cat([x @ w.T + (b if b is not None else 0) for w, b in zip(ws, bs)], dim=1)
    torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)


def test_int4_recovers_a_q4_1_grid_and_matches_dense_arithmetic():
    weight = q4_1_weight(96, 128)
    layer = make_linear([weight.to(torch.bfloat16)], [None], "int4", max_m=4)
    assert isinstance(layer, Int4Linear)
    x = torch.randn(3, 128).to(torch.bfloat16)
    reference = x.float() @ weight.T  # the grid's exact values, float32 accumulation
    got = layer(x).float()
    # only bf16 rounding of inputs to the kernel's arithmetic separates the two
    assert (got - reference).abs().max() < 0.02 * reference.abs().max()
    dense = DenseLinear(weight.to(torch.bfloat16))
    assert (got - dense(x).float()).abs().max() < 0.02 * reference.abs().max()


def test_int4_and_int8_fall_back_to_dense_above_max_m():
    weight = q4_1_weight(64, 64).to(torch.bfloat16)
    x = torch.randn(9, 64).to(torch.bfloat16)
    for kind in ("int4", "int8"):
        layer = make_linear([weight], [None], kind, max_m=8)
        torch.testing.assert_close(layer(x), DenseLinear(weight)(x))


def test_int8_is_close_to_dense_and_adds_bias():
    torch.manual_seed(1)
    weight = torch.randn(48, 48).to(torch.bfloat16)  # 48 inputs: not a multiple of 32, so int4 falls to int8
    bias = torch.randn(48).to(torch.bfloat16)
    layer = make_linear([weight], [bias], "int4", max_m=8)
    assert isinstance(layer, Int8Linear)
    x = torch.randn(2, 48).to(torch.bfloat16)
    expected = x.float() @ weight.float().T + bias.float()
    assert (layer(x).float() - expected).abs().max() < 0.03 * expected.abs().max()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantization_needs_bf16_weights_and_a_supported_width(kind):
    """The CPU low-bit kernels take bf16 activations; float32 models stay dense (and exact)."""
    assert type(make_linear([torch.randn(32, 64)], [None], kind)) is DenseLinear
    assert type(make_linear([torch.randn(32, 40).to(torch.bfloat16)], [None], kind)) is DenseLinear


def test_bf16_weights_in_the_blocked_layout_give_the_same_bits_as_f_linear():
    torch.manual_seed(2)
    weight, bias = torch.randn(96, 64).to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
    layer = DenseLinear(weight, bias)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # oneDNN's bf16 reorder needs AVX512 (BW/VL/DQ)
        assert layer.packed is not None
    for rows in (1, 3, 8, 33):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, weight, bias))
    assert DenseLinear(weight.float()).packed is None  # float32 keeps F.linear (and HF's exact arithmetic)
