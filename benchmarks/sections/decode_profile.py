"""Where a decode step of the served engine goes: torch.profiler over a few decode steps, the time of each op
and of the Python between them put into categories (matmuls, attention, the forward's other ops, sampling, ...),
and the table the report shows for targets that a decode step bounds."""

from __future__ import annotations

import contextlib
import time
import types

from benchmarks.core.common import PROMPTS
from benchmarks.core.context import Bench
from benchmarks.core.progress import log
from benchmarks.core.settings import GREEDY
from benchmarks.core.targets import DECODE_PROFILE


def decode_setup(engine, batch: int, steps: int) -> None:
    """Add `batch` greedy requests of steps + 1 tokens and run until each has its first token (prefill done). The
    requests do not speculate: a decode step here is one token per sequence, what the step-time figures mean."""
    from backend import SamplingParams

    for i in range(batch):
        params = SamplingParams.from_dict({**GREEDY, "max_tokens": steps + 1, "num_speculative_tokens": 0})
        engine.add_request(
            engine.build_request(f"decode-{time.perf_counter_ns()}-{i}", PROMPTS[i % len(PROMPTS)], params, stream=True)
        )
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step() if any(s.token_ids for s in out.samples))


_LABELS = {
    "llm.step": "engine step: the rest (input tensors, Python)",
    "llm.scheduler": "scheduler",
    "llm.metadata": "attention metadata (slots, block tables, masks)",
    "llm.attention": "attention (KV write, block gather, SDPA; or our in-place kernel with RoPE)",
    "llm.lowbit": "matmuls (our low-bit kernel)",
    "llm.layer_ops": "model forward: our fused norm / SiLU ops",
    "llm.sampling": "sampling",
    "llm.append": "detokenize + stop checks",
    "llm.collect": "outputs",
}
MATMUL = "matmuls (linear layers, lm_head)"
LOWBIT_MATMUL = _LABELS["llm.lowbit"]
FORWARD_PYTHON = "model forward: Python"
FORWARD_OTHER = "model forward: other ops (norms, RoPE, activations, embedding)"
_MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
    "aten::linear",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::_weight_int8pack_mm",
    "mkldnn::_linear_pointwise",
}
_ORDER = [
    MATMUL,
    _LABELS["llm.lowbit"],
    _LABELS["llm.attention"],
    _LABELS["llm.layer_ops"],
    FORWARD_OTHER,
    FORWARD_PYTHON,
    _LABELS["llm.metadata"],
    _LABELS["llm.sampling"],
    _LABELS["llm.append"],
    _LABELS["llm.scheduler"],
    _LABELS["llm.collect"],
    _LABELS["llm.step"],
]


def _labelled_functions(engine) -> list[tuple[object, str, str]]:
    """(owner, attribute, label) of the functions a decode step runs through, labelled for the profiler (those
    this engine has: its output handling has lived on the engine and on an `outputs` object)."""
    import backend.model.fused_llama as fused_llama
    import backend.model.paged_attention as paged_attention
    import backend.model.runner as model_runner

    runner, outputs = engine.runner, getattr(engine, "outputs", None)
    candidates = [
        (engine, "step", "llm.step"),
        (engine.scheduler, "schedule", "llm.scheduler"),
        (runner.fused if runner.fused is not None else runner.model, "forward", "llm.forward"),
        (engine.sampler, "sample", "llm.sampling"),
        (outputs, "append", "llm.append"),
        (engine, "_append_token", "llm.append"),
        (engine, "_collect", "llm.collect"),
        (model_runner, "build_metadata", "llm.metadata"),
        # the fused forward calls its module's name; the HF path's attention hook calls paged_attention's
        (fused_llama, "paged_attention", "llm.attention"),
        (paged_attention, "paged_attention", "llm.attention"),
    ]
    ops = getattr(runner.fused, "ops", None)  # our C++ kernels: no aten ops inside, so labelled by name
    if ops is not None:
        candidates += [
            (ops, "lowbit_linear", "llm.lowbit"),
            (ops, "rope_paged_attention", "llm.attention"),
            (ops, "add_rms_norm", "llm.layer_ops"),
            (ops, "silu_mul", "llm.layer_ops"),
        ]
    return [(owner, name, label) for owner, name, label in candidates if hasattr(owner, name)]


@contextlib.contextmanager
def _record_functions(functions):
    """Wrap each function in a profiler range named by its label, for the duration of the block only."""
    from torch.profiler import record_function

    def wrap(fn, label):
        def wrapped(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)

        return wrapped

    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in functions]
    for (owner, name, fn), (_, _, label) in zip(originals, functions):
        setattr(owner, name, wrap(fn, label))
    try:
        yield
    finally:
        for owner, name, fn in reversed(originals):
            if isinstance(owner, types.ModuleType):
                setattr(owner, name, fn)
            else:
                delattr(owner, name)  # back to the class's method


def _category(event) -> str | None:
    """The part of the step an op's self time belongs to: its nearest labelled ancestor, and inside the model
    forward, whether it runs within a matmul op."""
    node, in_matmul = event, False
    while node is not None:
        if node.name == "llm.forward":
            return FORWARD_PYTHON if node is event else MATMUL if in_matmul else FORWARD_OTHER
        if node.name in _LABELS:
            return _LABELS[node.name]
        in_matmul = in_matmul or node.name in _MATMUL_OPS
        node = node.cpu_parent
    return None


@contextlib.contextmanager
def _python_layer_loop(engine):
    """The profiler cannot see inside the native decoder stack (kernels/decoder_stack.cpp), which makes the same
    calls as the fused forward's Python layer loop: profile that loop, so each op keeps its own row."""
    fused = engine.runner.fused
    saved = getattr(fused, "stack_rows", None)
    if saved is not None:
        fused.stack_rows = 0
    try:
        yield
    finally:
        if saved is not None:
            fused.stack_rows = saved


def profile_decode(engine, batch: int, steps: int) -> dict:
    """torch.profiler over `steps` decode steps at `batch`: ms per step in each part of the step."""
    from torch.profiler import ProfilerActivity, profile

    decode_setup(engine, batch, steps + 1)
    with _record_functions(_labelled_functions(engine)), _python_layer_loop(engine):
        engine.step()  # one decode step unprofiled (warm)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
        while engine.has_work():
            engine.step()
    totals: dict[str, float] = {}
    step_us = 0.0
    for event in prof.events():
        if event.name == "llm.step":
            step_us += event.cpu_time_total
        category = _category(event)
        if category is not None:
            totals[category] = totals.get(category, 0.0) + event.self_cpu_time_total
    ordered = [k for k in _ORDER if k in totals] + [k for k in totals if k not in _ORDER]
    return {"step_ms": step_us / steps / 1e3, "categories": {k: totals[k] / steps / 1e3 for k in ordered}}


def profile_table(profiles: dict[int, dict]) -> list[str]:
    lines = [
        "| part of the step | " + " | ".join(f"batch {b}: ms / share" for b in profiles) + " |",
        "|---|" + "---|" * len(profiles),
    ]
    for cat in dict.fromkeys(k for p in profiles.values() for k in p["categories"]):
        shares = [(p["categories"].get(cat, 0.0), p["step_ms"]) for p in profiles.values()]
        cells = [f"{ms:.2f} / {ms / step * 100:.0f} %" for ms, step in shares]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines.append(
        "| **step (profiled)** | " + " | ".join(f"{p['step_ms']:.2f} / 100 %" for p in profiles.values()) + " |"
    )
    return lines


def measure_profiles(bench: Bench) -> None:
    """Profile decode steps of the served engine at batch 1 and the roofline batch; the report's bound table."""
    engine = bench.engine()
    for batch in (1, bench.s.roofline_batch):
        log(f"4: profiling decode steps at batch {batch}")
        bench.profiles[batch] = profile_decode(engine, batch, bench.s.profile_steps)
    bench.bounds[DECODE_PROFILE] = [
        f"Where a decode step of the served engine ({engine.config.dtype}, quantization "
        f"{engine.config.quantization}, {engine.runner.impl} forward) goes (torch.profiler over "
        f"{bench.s.profile_steps} steps; self time of the ops and of the Python between them, per step; the "
        "profiler adds some overhead, so read the shares, not the absolute times; the decoder layers run as the "
        "Python loop, which the served step replaces with one native call making the same calls for up to "
        f"{getattr(engine.runner.fused, 'stack_rows', 0)} rows):",
        "",
        *profile_table(bench.profiles),
    ]
