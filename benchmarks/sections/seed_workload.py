"""Section 1: the seed workload, static batching with Hugging Face `generate` against our engine through
Triton, both in the served dtype."""

from __future__ import annotations

import heapq
import time

import torch

from benchmarks.core.common import SEED_BATCH_SIZE, SEED_SPEEDUP
from benchmarks.core.context import Bench
from benchmarks.core.formatting import load_summary
from benchmarks.core.progress import log
from benchmarks.core.settings import seed_requests
from benchmarks.core.targets import GOALS
from benchmarks.core.variants import SEED_MODEL, resolved_dtype

TITLE = "Seed workload: static batching (HF generate) vs our engine through Triton"


def run_hf_static(model, tok, requests: list[tuple[str, int]], batch_size: int) -> dict:
    """The seed's synchronous batching: padded batches in queue order, each run to its longest max_tokens."""
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    pad = tok.pad_token_id
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    times, generated = [], 0
    with torch.inference_mode():
        enc = tok([requests[0][0]], return_tensors="pt")
        model.generate(**enc, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=pad)  # warm-up
        start = time.perf_counter()
        for batch in batches:
            longest = max(m for _, m in batch)
            t = time.perf_counter()
            enc = tok([p for p, _ in batch], return_tensors="pt", padding=True)
            out = model.generate(
                **enc, max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=pad
            )
            times.append(time.perf_counter() - t)
            new = out.shape[1] - enc.input_ids.shape[1]
            if new != longest:
                raise RuntimeError(f"HF generate made {new} tokens, expected {longest}")
            generated += new * len(batch)
        wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "batch_s": times,
        "generated_tokens": generated,
        "useful_tokens": sum(m for _, m in requests),
        "steps": sum(max(m for _, m in b) for b in batches),
    }


def continuous_schedule_steps(max_tokens: list[int], slots: int) -> int:
    """Steps of an ideal FIFO continuous schedule with `slots` sequences (one token per sequence per step)."""
    free = [0] * slots
    for m in max_tokens:
        heapq.heappush(free, heapq.heappop(free) + m)
    return max(free)


def run(bench: Bench) -> list[str]:
    s = bench.s
    dtype = resolved_dtype(SEED_MODEL)
    model, tok = bench.hf(getattr(torch, dtype))
    rows, data, bounds = [], {}, []
    for repeat in s.seed_repeats:
        requests = seed_requests(s) * repeat
        label = f"{len(requests)} requests" + (f" (the queue x {repeat})" if repeat > 1 else "")
        log(f"1: {label}: static batching, HF generate ({dtype}), batches of {SEED_BATCH_SIZE}")
        static = run_hf_static(model, tok, requests, SEED_BATCH_SIZE)
        log(f"1: static {static['wall_s']:.1f} s; our engine through Triton, max_num_seqs 8, 8 in flight")
        ours = bench.server.run(SEED_MODEL, requests, SEED_BATCH_SIZE)
        useful = static["useful_tokens"]
        if ours.output_tokens != useful:
            raise RuntimeError(f"our engine produced {ours.output_tokens} tokens, expected {useful}")
        ratio = static["wall_s"] / ours.wall_s
        ideal = continuous_schedule_steps([m for _, m in requests], SEED_BATCH_SIZE)
        data[repeat] = {
            "requests": len(requests),
            "useful_tokens": useful,
            "static": static,
            "ours": load_summary(ours),
            "speedup": ratio,
            "schedule_only_bound": static["steps"] / ideal,
            "continuous_steps": ideal,
        }
        # the seed's own measurement ran the queue twice: P1 is the last (largest) repeat
        verdict = bench.verdict("P1", ratio, label, counts=repeat == max(s.seed_repeats))
        rows += [
            f"| {label} | static batching, HF `generate` | {static['wall_s']:.2f} | "
            f"{useful / static['wall_s']:.1f} | {static['generated_tokens']} | {static['steps']} | 1.00x |",
            f"| {label} | our engine through Triton | {ours.wall_s:.2f} | {useful / ours.wall_s:.1f} | "
            f"{ours.output_tokens} | {ideal} (ideal) | {verdict} |",
        ]
        bounds.append(f"{label}: {static['steps']} / {ideal} = {static['steps'] / ideal:.2f}x")
    bench.results["sections"]["1"] = {
        "dtype": dtype,
        "runs": data,
        "seed_speedup": SEED_SPEEDUP,
        "target": GOALS["P1"].threshold,
    }
    scaled = "" if s.seed_token_scale == 1 else f", max_tokens x {s.seed_token_scale:g} (quick)"
    requests = seed_requests(s)
    longest = max(m for _, m in requests)
    lines = [
        f"The seed's {len(requests)} prompts with their max_tokens{scaled}, in the seed's order, batch size "
        f"{SEED_BATCH_SIZE}, greedy, both sides in {dtype} (the served dtype: HF `generate` on the model loaded "
        f"in {dtype}; ours the served configuration); each request generates exactly its max_tokens (useful "
        "tokens). Static: padded batches of 8 in queue order (left padding), each run to its longest request's "
        "max_tokens. Ours: the live server (`llm_seq8`: the served configuration with max_num_seqs 8) with 8 gRPC "
        "streams, each sending the next request of the queue when its last one ends. The seed's logs show 8 "
        "static batches and 64 completions, i.e. it ran the queue twice: the `x 2` row is the seed's own "
        "measurement and P1's.",
        "",
        f"| workload | path | wall s | useful output tok/s | generated tokens | decode steps | "
        f"speed-up (P1 target {GOALS['P1'].text}) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"The seed saw {SEED_SPEEDUP:.2f}x. Scheduling alone bounds the gain: with a step cost that does not "
        "depend on the batch size, the speed-up would be static batch steps / steps of a perfect 8-slot FIFO "
        f"continuous schedule ({'; '.join(bounds)}); anything above that comes from cheaper steps (no padding, "
        "smaller batches in the tail, less per-step overhead than `generate`)."
        + (
            f" The longest request ({longest} tokens) is the last of the queue: it alone decodes for "
            f"{longest} steps after it starts, at batch 1 for most of them."
            if requests[-1][1] == longest
            else ""
        ),
        "",
        bench.plot(_figure(data), "seed_static_vs_continuous.png"),
    ]
    return lines


def _figure(data: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 1.6 + 1.1 * len(data)))
    names, values, colors, labels = [], [], [], []
    for d in data.values():
        for path, wall, color in (
            ("static (HF generate)", d["static"]["wall_s"], "#999999"),
            ("our engine (Triton)", d["ours"]["wall_s"], "#2a7ab0"),
        ):
            names.append(f"{d['requests']} req: {path}")
            values.append(wall)
            colors.append(color)
            labels.append(f"{wall:.1f} s" + (f" ({d['speedup']:.2f}x)" if color != "#999999" else ""))
    bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
    ax.bar_label(bars, labels=labels[::-1], padding=3)
    ax.set_xlabel("wall time, s (lower is better)")
    ax.set_title(f"Seed workload, batch 8 (the seed saw {SEED_SPEEDUP:.2f}x; target {GOALS['P1'].text})")
    ax.set_xlim(0, max(values) * 1.35)
    return fig
