"""Section 2: output tokens/s of our engine through Triton against transformers' own continuous batching, in
fp32 and in the served dtype, at 1, 8 and 32 concurrent streams."""

from __future__ import annotations

import math
import time

import torch

from backend.model.hardware import native_bf16
from benchmarks.core.common import PROMPTS, LoadResult
from benchmarks.core.context import Bench
from benchmarks.core.formatting import load_summary, versus_row
from benchmarks.core.plots import paired_bars
from benchmarks.core.progress import log
from benchmarks.core.settings import largest, throughput_requests
from benchmarks.core.targets import GOALS
from benchmarks.core.variants import FP32_MODEL, MAIN_MODEL, engine_parameters, resolved_dtype

TITLE = "Output tokens/s: our engine through Triton vs transformers continuous batching"


class HFContinuous:
    """transformers' continuous batching (ContinuousBatchingManager), driven with at most `concurrency`
    requests in flight; the manager's limits match our engine's (32 sequences, 512 tokens per step)."""

    def __init__(
        self, model, tok, max_prompt_tokens: int, max_tokens: int, max_seqs: int = 32, max_batch_tokens: int = 512
    ):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.tok = tok
        page = 64
        blocks = max_seqs * (math.ceil((max_prompt_tokens + max_tokens) / page) + 1) + 8
        gen = GenerationConfig(
            max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=tok.eos_token_id
        )
        cbc = ContinuousBatchingConfig(
            page_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_seqs
        )
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
        self.manager.start()
        self.counter = 0
        self.run([(PROMPTS[0], 2)] * 2, 2)  # warm-up

    def run(self, requests: list[tuple[str, int]], concurrency: int) -> LoadResult:
        pending = [(self.tok(p).input_ids, m) for p, m in requests]
        sent: dict[str, float] = {}
        ttft, itl, e2e, tokens = [], [], [], 0
        start = time.perf_counter()
        while pending or sent:
            while pending and len(sent) < concurrency:
                ids, m = pending.pop(0)
                rid = f"b{self.counter}"
                self.counter += 1
                sent[rid] = time.perf_counter()
                self.manager.add_request(ids, request_id=rid, max_new_tokens=m, record_timestamps=True)
            result = self.manager.get_result(timeout=5.0)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if not result.is_finished() or result.request_id not in sent:
                continue
            now = time.perf_counter()
            t0 = sent.pop(result.request_id)
            if result.error:
                raise RuntimeError(f"transformers continuous batching failed a request: {result.error}")
            stamps = result.timestamps or []
            if stamps:
                ttft.append(stamps[0] - t0)
                itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
            e2e.append(now - t0)
            tokens += len(result.generated_tokens)
        return LoadResult(time.perf_counter() - start, tokens, len(requests), ttft, itl, e2e)

    def close(self) -> None:
        self.manager.stop(block=True, timeout=30)
        self.manager.destroy()


def compared_configurations() -> list[tuple[str, str, str]]:
    """(row label, dtype, server variant) triples. P2 counts the served configuration (the default one) against
    transformers in the dtype it serves; the dense-weight fp32 variant (quantization none) against transformers
    fp32 shows the same arithmetic on both sides beside it."""
    served = resolved_dtype(MAIN_MODEL)
    return [(f"served, {served}", served, MAIN_MODEL), ("dense weights, float32", "float32", FP32_MODEL)]


def run(bench: Bench) -> list[str]:
    s = bench.s
    configurations = compared_configurations()
    runs = {label: {} for label, _, _ in configurations}  # label -> streams -> (ours, transformers')
    managers: dict[str, HFContinuous] = {}
    try:
        for c in s.concurrency:  # each level's runs back to back: the machine's speed drifts from minute to minute
            requests = throughput_requests(s, c)
            theirs = {}
            for label, dtype, variant in configurations:
                if dtype not in theirs:
                    log(f"2: {dtype}, {c} streams, {len(requests)} requests x {s.max_tokens} tokens: transformers CB")
                    theirs[dtype] = _manager(bench, managers, dtype).run(requests, c)
                log(f"2: {label}, {c} streams: our engine through Triton ({variant})")
                ours = bench.triton(c) if variant == MAIN_MODEL else bench.server.run(variant, requests, c)
                runs[label][c] = (ours, theirs[dtype])
    finally:
        for manager in managers.values():
            manager.close()
    rows, data = [], {label: {} for label in runs}
    for label, _, variant in configurations:
        for c, (ours, hf) in runs[label].items():
            ratio = ours.tokens_per_s / hf.tokens_per_s
            counts = variant == MAIN_MODEL and c == largest(s.concurrency, 32)
            verdict = bench.verdict("P2", ratio, f"{label}, {c} streams", counts=counts)
            rows.append(versus_row([label, c, ours.num_requests], ours, hf, verdict))
            data[label][c] = {"ours": load_summary(ours), "transformers_cb": load_summary(hf), "ratio": ratio}
    bench.results["sections"]["2"] = data
    lines = [
        f"Prompts: benchmarks/core/common.py PROMPTS (8, cycled); every request {s.max_tokens} output tokens "
        "(ignore_eos; eos_token_id=-1 for transformers), greedy. transformers: `model.init_continuous_batching()` "
        "(ContinuousBatchingManager, sdpa attention, max_requests_per_batch 32, max_batch_tokens 512: the same "
        "limits as our engine) on the model loaded in the row's dtype (the same fp32 checkpoint the server "
        "reads), fed from the same process with at most N requests in flight, run once per dtype and level, right "
        "before ours at that level (one run serves both of a dtype's rows). Ours: gRPC "
        f"streaming clients through tritonserver. The served rows run the served configuration (`{MAIN_MODEL}`: "
        f"{_served_description(bench)}), which P2 counts at {largest(s.concurrency, 32)} streams (target "
        f"{GOALS['P2'].text}); the dense rows run the `{FP32_MODEL}` variant (dtype float32, quantization none: "
        f"torch's fp32 GEMM over the de-quantized weights, as transformers computes).{_no_bf16_note()}",
        "",
        "| configuration | streams | requests | ours tok/s | transformers CB tok/s | ours / theirs | TTFT p50 ms "
        "(ours / theirs) | ITL p50 ms (ours / theirs) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        bench.plot(_figure(s.concurrency, data), "throughput_vs_transformers_cb.png"),
    ]
    return lines


def _manager(bench: Bench, managers: dict, dtype: str) -> HFContinuous:
    """transformers' continuous batching on the model in `dtype`, started at its first use."""
    model, tok = bench.hf(getattr(torch, dtype))  # (sets the process's torch threads to the peer's)
    if dtype not in managers:
        max_prompt = max(len(tok(p).input_ids) for p in PROMPTS)
        log(f"2: transformers continuous batching, {dtype}")
        managers[dtype] = HFContinuous(model, tok, max_prompt, bench.s.max_tokens)
    return managers[dtype]


def _no_bf16_note() -> str:
    if resolved_dtype() == "bfloat16":
        return ""
    _, why = native_bf16("cpu")
    return (
        f" No bfloat16 rows: {why}, so `dtype: auto` serves float32 here and bf16 on either side would be "
        "emulated (see the bf16 matmul ceiling above), which nobody would serve."
    )


def _served_description(bench: Bench) -> str:
    params = engine_parameters(bench.s.threads)
    return (
        f"dtype {params.get('dtype')} = {resolved_dtype()}, quantization {params.get('quantization')}, "
        f"model_impl {params.get('model_impl')}"
    )


def _figure(concurrency: list[int], data: dict):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data), figsize=(6 * len(data), 3.4), squeeze=False)
    for ax, (label, d) in zip(axes[0], data.items()):
        paired_bars(
            ax,
            concurrency,
            f"Throughput, {label}, same model / prompts, greedy",
            ("our engine (Triton)", "#2a7ab0", [d[c]["ours"]["tokens_per_s"] for c in concurrency]),
            ("transformers CB", "#e08a2c", [d[c]["transformers_cb"]["tokens_per_s"] for c in concurrency]),
        )
    return fig
