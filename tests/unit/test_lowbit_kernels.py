"""The C++ low-bit kernels (backend/model/kernels/lowbit.cpp) against the dense fp32 matmul on the same
de-quantized weights: every instruction set this CPU runs, M = 1..64, odd widths, every record format."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from backend.model import kernels
from backend.model.linear import DenseLinear, LowBitLinear, make_linear
from backend.model.runner import LOWBIT_ROWS
from backend.model.weight_blocks import FORMATS, HALVES, K_SCALES, RECORDS, Blocks, HalfWeights, quantize_q8_0

# Relative to the output's scale: fp32 sums of up to a few thousand products in another order.
TOLERANCE = 2e-6


def random_blocks(format: str, rows: int, cols: int, seed: int = 0) -> Blocks | HalfWeights:
    """Blocks of `format` with every q its bits allow (K-quants: every integer scale and min too); 16-bit weights
    with fp16's subnormals and signed zeros among them."""
    g = torch.Generator().manual_seed(seed)
    if format in HALVES:
        values = torch.randn(rows, cols, generator=g) * 0.05
        values[::3, ::5] *= 1e-5  # fp16 subnormals (bf16 keeps them normal)
        values[1::4, ::7] = -0.0
        return HalfWeights(format, values.to(HALVES[format][1]))
    _, bits, with_m = RECORDS[format]
    nb = cols // 32
    if bits == 4:
        q = torch.randint(0, 16, (rows, nb, 32), generator=g, dtype=torch.uint8)
    elif format in ("q5_1", "q5_k"):
        q = torch.randint(0, 32, (rows, nb, 32), generator=g, dtype=torch.int8)
    elif format == "q6_k":
        q = torch.randint(-32, 32, (rows, nb, 32), generator=g, dtype=torch.int8)
    else:
        q = torch.randint(-128, 128, (rows, nb, 32), generator=g, dtype=torch.int8)
    if format not in K_SCALES:
        d = (torch.rand(rows, nb, generator=g) * 0.02 + 1e-3).to(torch.float16)
        m = (-(torch.rand(rows, nb, generator=g)) * 0.1).to(torch.float16) if with_m else None
        return Blocks(format, d, m, q)
    supers, (per_block, dtype) = nb // 8, K_SCALES[format]
    low, high = (0, 64) if dtype == torch.uint8 else (-128, 128)
    d = (torch.rand(rows, supers, generator=g) * 2e-4 + 1e-5).to(torch.float16)
    m = (torch.rand(rows, supers, generator=g) * 2e-3).to(torch.float16) if with_m else None
    scales = torch.randint(low, high, (rows, supers, 8 * per_block), generator=g, dtype=dtype)
    mins = torch.randint(low, high, (rows, supers, 8), generator=g, dtype=dtype) if with_m else None
    return Blocks(format, d, m, q, scales, mins)


def width(format: str, cols: int) -> int:
    """`cols` rounded up to what `format` takes: K-quants come in super-blocks of 256 inputs."""
    return -(-cols // 256) * 256 if format in K_SCALES else cols


@pytest.fixture(scope="module")
def module(built_kernels):
    return built_kernels


def isas() -> list[int]:
    """Every instruction set this CPU runs (AVX2 is also exercised on an AVX-512 CPU), and AVX-512's source on AVX2
    instructions (the kernel's test-only copy, with its 16 lanes and row blocking), so that a CPU without AVX-512
    still tests that copy's code."""
    best = kernels.best_isa()
    return [isa for isa in (1, 2) if isa <= best] + [kernels.load().isa_names().index("wide_on_avx2")]


def test_python_names_the_instruction_sets_as_the_kernels_do(module):
    """kernels.ISA_NAMES (what LLM_KERNEL_ISA takes and the load log says) is isa.h's enum, by number, less the
    test-only copies that follow the served ones."""
    names = module.isa_names()
    assert names[: len(kernels.ISA_NAMES)] == [kernels.ISA_NAMES[i] for i in range(len(kernels.ISA_NAMES))]
    assert names[len(kernels.ISA_NAMES) :] == ["wide_on_avx2"]
    assert module.best_isa() in kernels.ISA_NAMES


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def test_this_cpu_runs_a_kernel(module):
    assert kernels.best_isa() >= 1, "every x86 machine the project runs on has AVX2 + FMA + F16C"


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("rows,cols", [(16, 32), (40, 96), (7, 64), (960, 576), (33, 1536)])
def test_kernel_equals_dense_fp32_for_every_batch_size(module, format, rows, cols):
    cols = width(format, cols)
    blocks = random_blocks(format, rows, cols, seed=rows + cols)
    packed, dense = blocks.pack(), blocks.dequantize()
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(1))
    want_all = x @ dense.T
    for isa in isas():
        for m in range(1, 65):
            got = module.lowbit_linear(x[:m], packed, rows, FORMATS[format], isa)
            assert got.shape == (m, rows)
            err = relative_error(got, want_all[:m])
            assert err < TOLERANCE, f"isa {isa} M={m}: relative error {err:.2e}"


@pytest.mark.parametrize("format", FORMATS)
def test_kernel_equals_dense_fp32_up_to_the_largest_step_it_serves(module, format):
    """Past M = 64, up to the largest default `max_lowbit_rows` (a prefill chunk of a short prompt)."""
    largest, cols = max(LOWBIT_ROWS.values()), width(format, 576)
    blocks = random_blocks(format, 960, cols, seed=11)
    packed, dense = blocks.pack(), blocks.dequantize()
    x = torch.randn(largest, cols, generator=torch.Generator().manual_seed(3))
    want_all = x @ dense.T
    for isa in isas():
        for m in (65, largest - 1, largest):
            err = relative_error(module.lowbit_linear(x[:m], packed, 960, FORMATS[format], isa), want_all[:m])
            assert err < TOLERANCE, f"isa {isa} M={m}: relative error {err:.2e}"


@pytest.mark.parametrize("format", FORMATS)
def test_kernel_is_as_close_to_the_exact_product_as_torch_fp32(module, format):
    """The kernel regroups the sum (d * sum(q * x) + m * sum(x) per block, docs/engine.md): its distance to the
    exact (float64) product of the de-quantized weights stays of the size of torch's own fp32 matmul's."""
    blocks = random_blocks(format, 960, 1536, seed=7)
    packed, dense = blocks.pack(), blocks.dequantize()
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ dense.double().T
    torch_error = ((x @ dense.T).double() - exact).abs().max().item()
    for isa in isas():
        for m in (1, 3, 4, 8, 9, 64):
            got = module.lowbit_linear(x[:m], packed, 960, FORMATS[format], isa).double()
            error = (got - exact[:m]).abs().max().item()
            assert error <= 4 * torch_error, f"isa {isa} M={m}: {error:.2e} against torch fp32's {torch_error:.2e}"


def test_kernel_is_not_just_close_by_luck(module):
    """A wrong weight (one q changed) must show: the comparison above can fail."""
    blocks = random_blocks("q4_1", 16, 64)
    x = torch.randn(3, 64)
    want = x @ blocks.dequantize().T
    blocks.q[5, 1, 7] = (blocks.q[5, 1, 7] + 3) % 16
    got = module.lowbit_linear(x, blocks.pack(), 16, FORMATS["q4_1"], kernels.best_isa())
    assert relative_error(got, want) > 1e-4


def test_kernel_refuses_mismatched_inputs(module):
    blocks = random_blocks("q8_0", 16, 64)
    with pytest.raises(RuntimeError, match="packed holds"):
        module.lowbit_linear(torch.randn(2, 64), blocks.pack()[:-1].contiguous(), 16, 1, 1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        module.lowbit_linear(torch.randn(2, 48), blocks.pack(), 16, 1, 1)
    with pytest.raises(RuntimeError, match="float32"):
        module.lowbit_linear(torch.randn(2, 64, dtype=torch.bfloat16), blocks.pack(), 16, 1, 1)


def longest_python_pause_during(call) -> float:
    """The longest stretch of `call` in which a spinning Python thread made no progress, as a share of the call's
    time: about 1 where the call holds the GIL throughout; a scheduler slice (a few ms) where it releases it, even
    on a loaded machine."""
    stamps, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        while not stamps:
            time.sleep(0.001)
        started = time.perf_counter()
        call()
        ended = time.perf_counter()
    finally:
        stop.set()
        spinner.join()
    inside = [started] + [t for t in stamps if started < t < ended] + [ended]
    return max(b - a for a, b in zip(inside, inside[1:])) / (ended - started)


def test_kernel_calls_release_the_gil(module):
    """The server's Python threads run while the engine is in a kernel; a call that held the GIL would stall
    them (and they it) for its whole duration."""
    blocks = random_blocks("q8_0", 4096, 2048)
    packed, x = blocks.pack(), torch.randn(256, 2048)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pause = longest_python_pause_during(
            lambda: module.lowbit_linear(x, packed, 4096, FORMATS["q8_0"], kernels.best_isa())
        )
    finally:
        torch.set_num_threads(threads)
    assert pause < 0.5, f"a Python thread stood still for {pause:.0%} of a kernel call: it holds the GIL"


def test_the_build_key_names_the_build_that_loaded(module):
    """torch's extension loader appends to the flag lists it is given; ours must stay as they were, or the key
    (and the folder `python -m backend.model.kernels` names) changes after a load."""
    assert Path(module.__file__).parent == kernels.cache_dir() / kernels.build_key()


def test_dequantize_is_the_reference_formula():
    blocks = random_blocks("q4_1", 4, 64)
    want = blocks.d.float()[..., None] * blocks.q.float() + blocks.m.float()[..., None]
    assert torch.equal(blocks.dequantize(), want.reshape(4, 64))


def test_half_weights_take_the_16_bit_format_that_holds_a_weight_exactly():
    weight = torch.randn(16, 64)
    assert HalfWeights.of(weight.bfloat16().float()).format == "bf16"
    fp16 = weight.half().float()  # 11 significant bits: not bf16's 8
    assert HalfWeights.of(fp16).format == "f16"
    assert torch.equal(HalfWeights.of(fp16).dequantize(), fp16)
    assert HalfWeights.of(weight) is None


def test_quantize_q8_0_round_trips_its_own_grid():
    weight = torch.randn(24, 96)
    blocks = quantize_q8_0(weight)
    again = quantize_q8_0(blocks.dequantize())
    assert torch.equal(again.dequantize(), blocks.dequantize())
    assert relative_error(blocks.dequantize(), weight) < 1e-2


def test_low_bit_linear_uses_the_kernel_for_small_batches_and_dense_beyond(module):
    blocks = random_blocks("q4_1", 48, 128)
    weight = blocks.dequantize()
    layer = make_linear(
        [weight[:16], weight[16:]],
        [None, None],
        "none",
        4,
        [blocks_slice(blocks, 0, 16), blocks_slice(blocks, 16, 48)],
        kernels.best_isa(),
    )
    assert isinstance(layer, LowBitLinear)
    for m in (1, 4, 5, 40):
        x = torch.randn(m, 128)
        assert relative_error(layer(x), x @ weight.T) < TOLERANCE


def test_forced_fallback_is_the_dense_path():
    """A CPU without a kernel (isa 0) gets the dense fp32 layer: the pure-torch path."""
    blocks = random_blocks("q4_1", 16, 64)
    layer = make_linear([blocks.dequantize()], [None], "none", 8, [blocks.packed()], isa=0)
    assert type(layer) is DenseLinear


def test_forced_instruction_set(monkeypatch):
    monkeypatch.setenv("LLM_KERNEL_ISA", "none")
    assert kernels.best_isa() == 0
    monkeypatch.setenv("LLM_KERNEL_ISA", "avx2")
    assert kernels.best_isa() == 1
    monkeypatch.setenv("LLM_KERNEL_ISA", "sse")
    with pytest.raises(ValueError, match="LLM_KERNEL_ISA"):
        kernels.best_isa()


def blocks_slice(blocks: Blocks, start: int, stop: int):
    return blocks.rows(torch.arange(start, stop)).packed()


@pytest.mark.parametrize("format", FORMATS)
def test_rows_looked_up_are_the_reference_de_quantization_bit_for_bit(module, format):
    """What the token embedding reads from blocks (kernels.lowbit_rows): every row, any order, exactly."""
    rows, cols = 37, width(format, 96)
    blocks = random_blocks(format, rows, cols, seed=5)
    ids = torch.tensor([36, 0, 17, 16, 15, 36, 1])
    got = module.lowbit_rows(blocks.pack(), rows, cols, FORMATS[format], ids)
    assert torch.equal(got, blocks.dequantize()[ids])
    with pytest.raises(RuntimeError, match="outside"):
        module.lowbit_rows(blocks.pack(), rows, cols, FORMATS[format], torch.tensor([rows]))
