"""Which of the four forward paths computes a step, decided once per step (`plan_forward`), with the reason.

The paths compute the same model; each is held to the one it replaces (tests/unit/test_forward_plan.py):

- `HF_MODULES`: Hugging Face's own modules with our paged attention plugged in. Every model family; the reference
  of the fused forward.
- `FUSED_TORCH`: the fused Llama-family forward on torch ops (SDPA over the gathered blocks), for steps with a
  query longer than 16 tokens (a prefill chunk: SDPA is faster there) and for models without our layer ops (not
  fp32 on the CPU, or no kernel build). Within float rounding of `HF_MODULES`.
- `NATIVE_LOOP`: the fused forward's Python loop over our C++ layer ops (`FusedLlama._forward_loop`), for steps
  of short queries in fp32 on the CPU that the native stack does not take: rows under a LoRA adapter (their
  deltas are added between the projections, from Python), more rows than the stack takes (`max_lowbit_rows`), a
  model whose projections are not all on one low-bit kernel (dense fp32 weights, a mix) or whose rotary table is
  computed per step. Within float rounding of `FUSED_TORCH`.
- `NATIVE_STACK`: the whole pass in one call of `kernels/decoder_stack.cpp`, the calls `NATIVE_LOOP` makes, so
  the same bits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ForwardPath(enum.Enum):
    HF_MODULES = "Hugging Face's modules"
    FUSED_TORCH = "the fused forward on torch ops"
    NATIVE_LOOP = "the fused forward's Python loop over our layer ops"
    NATIVE_STACK = "the native decoder stack, one call"


@dataclass(frozen=True)
class ForwardPlan:
    """A step's path, why it was picked, and how many threads torch's own (OpenMP) pool gets for the pass."""

    path: ForwardPath
    reason: str
    torch_threads: int


NOT_FUSED = "no fused forward for this model (model_impl hf, or not a Llama-family model it computes exactly)"
NO_LAYER_OPS = "no layer ops (a model not in fp32 on the CPU, or no kernel build)"
LONG_QUERY = "a query longer than 16 tokens (a prefill chunk): SDPA is faster there"
LORA_ROWS = "rows under a LoRA adapter: their deltas are added between the projections"
NO_STACK = "no decoder stack (a projection not on the low-bit kernel, or rotary tables computed per step)"
MANY_ROWS = "more rows than the decoder stack takes (max_lowbit_rows)"
SHORT_STEP = "a short step with every projection and the LM head on the low-bit kernel"


def plan_forward(fused, rows: int, short_queries: bool, lora: bool, threads: int) -> ForwardPlan:
    """The path of a step of `rows` rows: `fused` is the runner's `FusedLlama` (None: the model has none),
    `short_queries` whether the step's attention metadata holds block tables (every query short, on the CPU), `lora`
    whether any row runs under an adapter. torch's pool gets `threads` where torch computes a pass's matmuls, one
    thread where our kernels carry them all (two pools' idle workers polling on the same cores held up each
    other's ops: a batch-1 step 10.1 ms against 16 ms, docs/benchmarks.md)."""
    if fused is None:
        if lora:
            raise ValueError("LoRA adapters need the fused forward (Llama-family models)")
        return ForwardPlan(ForwardPath.HF_MODULES, NOT_FUSED, threads)
    torch_threads = 1 if rows <= fused.stack_rows else threads
    if fused.ops is None:
        return ForwardPlan(ForwardPath.FUSED_TORCH, NO_LAYER_OPS, torch_threads)
    if not short_queries:
        return ForwardPlan(ForwardPath.FUSED_TORCH, LONG_QUERY, torch_threads)
    if lora:
        return ForwardPlan(ForwardPath.NATIVE_LOOP, LORA_ROWS, torch_threads)
    if fused.stack is None:
        return ForwardPlan(ForwardPath.NATIVE_LOOP, NO_STACK, torch_threads)
    if rows > fused.stack_rows:
        return ForwardPlan(ForwardPath.NATIVE_LOOP, MANY_ROWS, torch_threads)
    return ForwardPlan(ForwardPath.NATIVE_STACK, SHORT_STEP, torch_threads)
