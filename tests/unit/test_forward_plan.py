"""backend/model/forward_plan.py: the runner's plan picks each forward path under its conditions, and each path
computes what its reference path computes over ragged steps (bit for bit where they make the same calls)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backend.model import forward_plan, kernels
from backend.model.forward_plan import ForwardPath, ForwardPlan
from backend.model.lora import load_adapter
from backend.model.runner import ForwardItem, ModelRunner
from testkit.lora_adapters import make_adapter
from tests.unit.paged_cases import BLOCK, NUM_BLOCKS, PROMPTS, ragged_step_items, scattered_tables

STACK_ROWS = 4  # max_lowbit_rows of the low-bit runners: the ragged steps' second step has more rows


@pytest.fixture(scope="module")
def adapter_path(tiny_llama, tmp_path_factory):
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("adapter") / "attn", rank=4, targets=("q_proj", "o_proj"))


@pytest.fixture(scope="module")
def per_step_rotary(tmp_path_factory) -> str:
    """A tiny Llama whose rotary frequencies change with the sequence length: no table, so no decoder stack."""
    from tests.unit.conftest import make_tiny_model

    scaling = {"rope_type": "dynamic", "factor": 2.0}
    return make_tiny_model(tmp_path_factory.mktemp("dynamic"), "llama", rope_scaling=scaling)


def plan_of(runner: ModelRunner, items: list[ForwardItem]) -> ForwardPlan:
    return runner.plan(runner.step_inputs(items))


def decodes(count: int, adapter=None) -> list[ForwardItem]:
    tables = scattered_tables(count, 3)
    return [ForwardItem([7], 5, table, 1, adapter if i == 0 else None) for i, table in enumerate(tables)]


def prefill(adapter=None) -> list[ForwardItem]:
    return [ForwardItem(PROMPTS[0][:18], 0, scattered_tables(1, 6)[0], 1, adapter)]


def test_each_path_is_picked_under_its_conditions(tiny_llama, tiny_model_factory, per_step_rotary, adapter_path):
    """Every outcome of the plan, with its reason and torch's thread count: one thread only where our kernels run
    every matmul of the pass (up to the stack's rows), the runner's threads elsewhere."""
    saved = torch.get_num_threads()
    try:
        hf = runner_of(tiny_llama, model_impl="hf", threads=2)
        unsupported = runner_of(tiny_model_factory("gemma2"), threads=2)
        dense = runner_of(tiny_llama, threads=2)
        bf16 = ModelRunner(tiny_llama, "bfloat16", BLOCK, NUM_BLOCKS, threads=2)
        low_bit = runner_of(tiny_llama, quantization="q8_0", max_lowbit_rows=STACK_ROWS, threads=2)
        dynamic = runner_of(per_step_rotary, quantization="q8_0", threads=2)
        adapter = load_adapter("attn", adapter_path, low_bit.model, 8)
        cases = [
            (hf, decodes(1), ForwardPath.HF_MODULES, forward_plan.NOT_FUSED, 2),
            (unsupported, decodes(1), ForwardPath.HF_MODULES, forward_plan.NOT_FUSED, 2),
            (bf16, decodes(1), ForwardPath.FUSED_TORCH, forward_plan.NO_LAYER_OPS, 2),
            (dense, prefill(), ForwardPath.FUSED_TORCH, forward_plan.LONG_QUERY, 2),
            (dense, decodes(1), ForwardPath.NATIVE_LOOP, forward_plan.NO_STACK, 2),
            (dynamic, decodes(1), ForwardPath.NATIVE_LOOP, forward_plan.NO_STACK, 2),
            (low_bit, prefill(), ForwardPath.FUSED_TORCH, forward_plan.LONG_QUERY, 2),
            (low_bit, prefill(adapter), ForwardPath.FUSED_TORCH, forward_plan.LONG_QUERY, 2),
            (low_bit, decodes(2, adapter), ForwardPath.NATIVE_LOOP, forward_plan.LORA_ROWS, 1),
            (low_bit, decodes(STACK_ROWS + 1), ForwardPath.NATIVE_LOOP, forward_plan.MANY_ROWS, 2),
            (low_bit, decodes(STACK_ROWS), ForwardPath.NATIVE_STACK, forward_plan.SHORT_STEP, 1),
        ]
        assert dense.fused.ops is not None and dense.fused.stack is None and dynamic.fused.stack is None
        assert bf16.fused.ops is None and low_bit.fused.stack_rows == STACK_ROWS
        for index, (runner, items, path, reason, threads) in enumerate(cases):
            assert plan_of(runner, items) == ForwardPlan(path, reason, threads), f"case {index}"
        with pytest.raises(ValueError, match="LoRA adapters need the fused forward"):
            plan_of(hf, decodes(1, load_adapter("attn", adapter_path, hf.model, 8)))
        dense.fused.ops = None  # no kernel build: the fused forward on torch ops even for short steps
        assert plan_of(dense, decodes(1)).path is ForwardPath.FUSED_TORCH
    finally:
        torch.set_num_threads(saved)
        kernels.set_threads(0)


def taking(runner: ModelRunner, instead: dict[ForwardPath, ForwardPath] | None = None) -> list[ForwardPath]:
    """The paths `runner`'s steps take from now on, listed as they run; a path in `instead` is replaced by its
    value there (the reference path computes the step instead)."""
    taken: list[ForwardPath] = []
    planned = runner.plan

    def plan(step):
        chosen = planned(step)
        if instead and chosen.path in instead:
            chosen = dataclasses.replace(chosen, path=instead[chosen.path], reason="the reference path, by the test")
        taken.append(chosen.path)
        return chosen

    runner.plan = plan
    return taken


def ragged_steps(runner: ModelRunner, adapter=None) -> list[tuple[list[ForwardItem], torch.Tensor]]:
    """paged_cases' three ragged steps, the first sequence under `adapter`: each step's items and logits."""
    steps = ragged_step_items()
    for items in steps:
        items[0].adapter = adapter
    return [(items, runner.forward(items)) for items in steps]


def runner_of(path: str, **options) -> ModelRunner:
    return ModelRunner(path, "float32", BLOCK, NUM_BLOCKS, **options)


def test_the_native_stack_is_the_python_loop_bit_for_bit(tiny_llama):
    """Over a prefill (torch ops), a step of more rows than the stack takes (the loop) and a short one."""
    subject, reference = (runner_of(tiny_llama, quantization="q8_0", max_lowbit_rows=STACK_ROWS) for _ in range(2))
    paths = taking(subject)
    reference_paths = taking(reference, {ForwardPath.NATIVE_STACK: ForwardPath.NATIVE_LOOP})
    for (_, got), (_, want) in zip(ragged_steps(subject), ragged_steps(reference)):
        assert torch.equal(got, want)
    assert paths == [ForwardPath.FUSED_TORCH, ForwardPath.NATIVE_LOOP, ForwardPath.NATIVE_STACK]
    assert ForwardPath.NATIVE_STACK not in reference_paths


@pytest.mark.parametrize("quantization", ["none", "q8_0"])
@pytest.mark.parametrize("with_adapter", [False, True])
def test_the_python_loop_is_the_fused_forward_on_torch_ops(tiny_llama, adapter_path, quantization, with_adapter):
    """Our layer ops against torch's, with dense and low-bit projections, with and without LoRA rows."""
    subject = runner_of(tiny_llama, quantization=quantization)
    reference = runner_of(tiny_llama, quantization=quantization)
    adapters = [load_adapter("attn", adapter_path, r.model, 8) if with_adapter else None for r in (subject, reference)]
    paths = taking(subject, {ForwardPath.NATIVE_STACK: ForwardPath.NATIVE_LOOP})
    reference_paths = taking(
        reference, {ForwardPath.NATIVE_STACK: ForwardPath.FUSED_TORCH, ForwardPath.NATIVE_LOOP: ForwardPath.FUSED_TORCH}
    )
    for (_, got), (_, want) in zip(ragged_steps(subject, adapters[0]), ragged_steps(reference, adapters[1])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert paths == [ForwardPath.FUSED_TORCH, ForwardPath.NATIVE_LOOP, ForwardPath.NATIVE_LOOP]
    assert set(reference_paths) == {ForwardPath.FUSED_TORCH}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_fused_forward_on_torch_ops_is_hugging_faces_modules(family, tiny_model_factory):
    """qwen3: with its query and key head norms."""
    path = tiny_model_factory(family)
    subject, reference = runner_of(path, model_impl="fused"), runner_of(path, model_impl="hf")
    paths = taking(subject, {ForwardPath.NATIVE_LOOP: ForwardPath.FUSED_TORCH})
    reference_paths = taking(reference)
    for (_, got), (_, want) in zip(ragged_steps(subject), ragged_steps(reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert paths == [ForwardPath.FUSED_TORCH] * 3 and reference_paths == [ForwardPath.HF_MODULES] * 3


def test_hugging_faces_modules_on_paged_attention_are_their_own_forward(tiny_llama, hf_model_cache):
    """The reference of the others against transformers' forward over each sequence's whole text, uncached."""
    subject = runner_of(tiny_llama, model_impl="hf")
    paths = taking(subject)
    texts: list[list[int]] = [[], [], []]
    for items, logits in ragged_steps(subject):
        row = 0
        for text, item in zip(texts, items):
            text.extend(item.token_ids)
            if item.num_logits:
                with torch.no_grad():
                    want = hf_model_cache(tiny_llama)(torch.tensor([text])).logits[0, -item.num_logits :]
                torch.testing.assert_close(logits[row : row + item.num_logits], want, rtol=1e-4, atol=1e-4)
            row += item.num_logits
    assert paths == [ForwardPath.HF_MODULES] * 3
