"""backend/model/kernels/lowbit_int8.cpp: `quantization: gguf_int8`, Q4_1 weights times activations rounded to
int8 per block of 32. Not the fp32 product: the kernel is held to its own definition (the rounded activations'
integer products, computed here in float64) and, loosely, to the exact product."""

from __future__ import annotations

import pytest
import torch

from backend.model import kernels
from backend.model.weight_blocks import Q4_1_INT8
from tests.conftest import machine_lacks
from tests.unit.test_lowbit_kernels import random_blocks

pytestmark = pytest.mark.skipif(kernels.best_isa() < 1, reason=machine_lacks("AVX2, which int8 activations need"))


def reference(x: torch.Tensor, blocks) -> torch.Tensor:
    """d * dx * sum(q * qx) + m * sum(x) per block, qx = round(x * 127 / max|x|) (fp32, as the kernel rounds)."""
    rows, cols = x.shape
    xb = x.view(rows, cols // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    qx = torch.round(xb * inverse).double()  # [M, B, 32]
    dx = (amax / 127.0).double()[..., 0]  # [M, B]
    q = blocks.q.double()  # [N, B, 32]
    integer = torch.einsum("mbk,nbk->mnb", qx, q)
    d, m = blocks.d.double(), blocks.m.double()  # [N, B]
    return (integer * d[None] * dx[:, None] + m[None] * xb.double().sum(-1)[:, None]).sum(-1)


@pytest.mark.parametrize("rows,cols,m", [(40, 576, 1), (48, 576, 2), (1000, 576, 7), (64, 1536, 32)])
def test_int8_kernel_computes_its_definition(rows, cols, m):
    module = kernels.load()
    blocks = random_blocks("q4_1", rows, cols, seed=rows)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(cols))
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    got = module.lowbit_linear(x, blocks.pack(), rows, Q4_1_INT8, kernels.best_isa()).double()
    want = reference(x, blocks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    exact = x.double() @ blocks.dequantize().double().T
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()  # the int8 rounding, not a wrong product


@pytest.mark.skipif(not kernels.load().int8_vnni(2), reason=machine_lacks("AVX-512 VNNI"))
@pytest.mark.parametrize("m", [1, 3, 4, 5, 33])
def test_vnni_copy_equals_the_avx2_copy_bit_for_bit(m):
    """The same integers summed exactly, then the same float operations per output: `vpdpbusd` on instruction set
    2 (AVX-512) gives the AVX2 maddubs copy's (instruction set 1) results exactly, a partial last tile included."""
    module = kernels.load()
    rows, cols = 1000, 1536
    blocks = random_blocks("q4_1", rows, cols, seed=m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)) * 3
    packed = blocks.pack()
    vnni = module.lowbit_linear(x, packed, rows, Q4_1_INT8, 2)
    avx2 = module.lowbit_linear(x, packed, rows, Q4_1_INT8, 1)
    assert torch.equal(vnni, avx2)
    assert kernels.int8_products(2) == "AVX-512 VNNI" and kernels.int8_products(1) == "AVX2 maddubs"


def test_gguf_int8_serves_the_q4_1_layers_with_int8_activations_and_keeps_the_head_exact():
    """The served model under `quantization: gguf_int8`: every Q4_1 projection on the int8 kernel (the load log
    says so), the Q8_0 LM head on the exact kernel, and a decode step's logits close to the exact path's."""
    from backend.model.runner import ForwardItem, ModelRunner
    from backend.model.weight_blocks import FORMATS
    from launcher.paths import MODEL_DIR

    fast = ModelRunner(str(MODEL_DIR), "float32", 16, 8, quantization="gguf_int8")
    exact = ModelRunner(str(MODEL_DIR), "float32", 16, 8, quantization="gguf")
    layers = fast.fused.linear_layers()
    assert all(lin.formats == [Q4_1_INT8] for lin in layers[:-1]) and layers[-1].formats == [FORMATS["q8_0"]]
    assert f"{len(layers) - 1} of them with activations rounded to int8" in fast.kernel
    assert f"multiplied with {kernels.int8_products(kernels.best_isa())}" in fast.kernel
    assert "int8" not in exact.kernel
    # every step size on the int8 kernel (the dense fallback would be another model); the stack as configured
    assert all(lin.max_m > 4096 for lin in layers[:-1]) and fast.fused.stack_rows == fast.max_lowbit_rows
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 3575, 30, 731, 3458, 314]
    steps = [[ForwardItem(prompt[:-1], 0, [0], 0)], [ForwardItem(prompt[-1:], len(prompt) - 1, [0], 1)]]
    got, want = ([runner.forward(step) for step in steps][-1][0] for runner in (fast, exact))
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99
    assert not torch.equal(got, want)  # the int8 path really ran
