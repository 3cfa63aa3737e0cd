"""Linear layers of the fused model path, behind one small interface: `layer(x)` for x [M, in_features].

`DenseLinear` computes `F.linear` over weights laid out once at load: projections that read the same input
are concatenated into one matmul, and bf16 weights on the CPU are reordered into oneDNN's blocked layout
(the same results, bit for bit, and 1.3-3x faster at the small M of decoding: measured in
docs/benchmarks.md). The quantized kinds keep weight-only low-bit copies for the small-M steps that batch-1
decoding runs, where reading the weights bounds the step, and fall back to the dense weights for large M
(prefill chunks, big batches), where the dense bf16 GEMM is faster than de-quantizing.

`LowBitLinear` is the exact path: the model's own GGUF blocks (every type `gguf_formats.py` decodes) read by
our C++ kernel (`kernels/lowbit.cpp`) with fp32 activations and accumulation, so it computes the fp32 model up
to summation order while reading a seventh of its bytes.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from backend.model import kernels
from backend.model.weight_blocks import FORMATS, Q4_1_INT8, Packed

GROUP_SIZE = 32  # the GGUF Q4_1 / Q8_0 block: weights share a scale (and Q4_1 an offset) per 32 inputs


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.contiguous()
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed = _onednn_packed(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """bf16 CPU weights in oneDNN's blocked layout (for any M), or None where that is not available."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    except (RuntimeError, AttributeError):
        return None


class Int4Linear(DenseLinear):
    """4-bit weights in groups of 32 inputs, `w = (q - 8) * scale + zero` with q in 0..15, for rows <= max_m.

    A GGUF Q4_1 block is `d * q + m`: min/max quantization of such a block recovers its grid exactly
    (scale d, zero m + 8d); only the bf16 rounding of d and m remains."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_m: int):
        super().__init__(weight, bias)
        self.max_m = max_m
        out_features, in_features = weight.shape
        groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp_min(1e-12)
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
        self.int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out_features, in_features), 1)
        zero = low + 8 * scale
        self.scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_m:
            return super().__call__(x)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.int4, GROUP_SIZE, self.scales_and_zeros)
        return out if self.bias is None else out + self.bias


class Int8Linear(DenseLinear):
    """8-bit weights with one scale per output row (symmetric), for rows <= max_m."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_m: int):
        super().__init__(weight, bias)
        self.max_m = max_m
        w = weight.float()
        self.scales = (w.abs().amax(1) / 127).clamp_min(1e-12)
        self.int8 = (w / self.scales[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = self.scales.to(weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_m:
            return super().__call__(x)
        out = torch.ops.aten._weight_int8pack_mm(x, self.int8, self.scales)
        return out if self.bias is None else out + self.bias


class LowBitLinear(DenseLinear):
    """fp32 activations times weights in GGUF blocks, on the instruction set `isa` (`kernels.best_isa`). With a
    dense fp32 `weight` beside the blocks, steps of more than max_m rows (prefill chunks) take the dense GEMM;
    without one (a GGUF read straight from the file holds no dense copy) every step runs on the kernel, which
    de-quantizes each tile once per call for large steps. With `int8_activations` (quantization gguf_int8) Q4_1
    layers round each activation block to int8 first: not exact (docs/engine.md), at every step size."""

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        segments: list[Packed],
        isa: int,
        max_m: int,
        int8_activations: bool = False,
    ):
        rows = sum(p.rows for p in segments)
        if weight is None:
            self.weight, self.bias, self.packed, self.out_features = None, bias, None, rows
        else:
            super().__init__(weight, bias)
        if weight is not None and rows != weight.shape[0]:
            raise ValueError(f"packed blocks of {rows} rows for a weight of shape {tuple(weight.shape)}")
        self.in_features = segments[0].columns
        # Output rows in segments of one block format each (fused projections of mixed types: one call each).
        # int8 activations (kernels/lowbit_int8.cpp) for Q4_1 only; other formats (the Q8_0 LM head) stay exact.
        self.blocks = [p.data for p in segments]
        self.rows = [p.rows for p in segments]
        self.formats = [Q4_1_INT8 if int8_activations and p.format == "q4_1" else FORMATS[p.format] for p in segments]
        self.isa = isa
        # int8 activations on every step size: the dense fallback computes another model (fp32 activations), so a
        # sequence's output would depend on the batch it ran in
        self.max_m = sys.maxsize if weight is None or Q4_1_INT8 in self.formats else max_m
        self.kernel = kernels.load()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x) if x.shape[0] > self.max_m else self.on_kernel(x)

    def one_row_timings(self, repeats: int = 15) -> tuple[float, float]:
        """Median milliseconds of one row through this layer on the kernel and dense: what `quantization: half`
        measures at load to choose between them."""
        x = torch.randn(1, self.in_features)

        def median_ms(call) -> float:
            call(x)  # warm
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                call(x)
                times.append(time.perf_counter() - start)
            return sorted(times)[len(times) // 2] * 1000

        return median_ms(self.on_kernel), median_ms(super().__call__)

    def on_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on the low-bit kernel, whatever the rows."""
        outs = [
            self.kernel.lowbit_linear(x, *segment, self.isa) for segment in zip(self.blocks, self.rows, self.formats)
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out if self.bias is None else out + self.bias


def make_linear(
    weights: list[torch.Tensor | None],
    biases: list[torch.Tensor | None],
    quantization: str = "none",
    max_m: int = 8,
    blocks: list[Packed | None] | None = None,
    isa: int = 0,
) -> DenseLinear:
    """One linear layer computing the concatenation of `weights` (each [out_i, in]) applied to the same input.
    With `blocks` (one per weight, all present) and a kernel for this CPU (`isa` > 0), the low-bit kernel
    serves it (with the dense weights beside it where they are given, for large steps); otherwise `quantization`
    picks the kind."""
    on_kernel = bool(blocks) and isa and all(b is not None for b in blocks)
    widths = [b.rows for b in blocks] if on_kernel else [w.shape[0] for w in weights]
    bias = None
    if any(b is not None for b in biases):
        like = next(b for b in biases if b is not None)
        bias = torch.cat([b if b is not None else like.new_zeros(n) for n, b in zip(widths, biases)])
    dense = None if any(w is None for w in weights) else torch.cat(weights) if len(weights) > 1 else weights[0]
    if on_kernel and (dense is None or dense.dtype == torch.float32):
        segments = Packed.segments(blocks)
        return LowBitLinear(dense, bias, segments, isa, max_m, int8_activations=quantization == "gguf_int8")
    if dense is None:
        raise ValueError("a linear layer without dense weights needs blocks for every part and the low-bit kernel")
    in_features = dense.shape[1]
    if quantization == "int4" and in_features % GROUP_SIZE == 0 and dense.dtype == torch.bfloat16:
        return Int4Linear(dense, bias, max_m)
    if quantization in ("int4", "int8") and in_features % 16 == 0 and dense.dtype == torch.bfloat16:
        return Int8Linear(dense, bias, max_m)  # (the CPU kernel crashes on other input widths)
    return DenseLinear(dense, bias)
