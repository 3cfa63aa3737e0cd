"""Section 4: decode tokens/s against the machine's ceilings, for the bytes the served engine actually reads per
step, and a torch.profiler breakdown of a decode step (benchmarks/sections/decode_profile.py: the table that shows what
bounds a missed target)."""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.core.common import measure_ceilings
from benchmarks.core.context import Bench
from benchmarks.core.progress import log
from benchmarks.core.targets import DECODE_PROFILE, GOALS
from benchmarks.sections.decode_profile import LOWBIT_MATMUL, MATMUL, decode_setup, measure_profiles

TITLE = "Roofline: decode tokens/s against the machine's ceilings"


# ------------------------------------------------------------------------------------------------ what a step reads


def engine_linears(engine) -> list:
    """The linear layers one decode step runs, LM head last: the fused path's layer objects (backend/model/linear.py),
    or Hugging Face's nn.Linear modules on the generic path. Each has `.weight` and is called on [M, in]."""
    fused = engine.runner.fused
    if fused is None:
        return [m for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear)]
    return fused.linear_layers()


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def linear_bytes(layer, batch: int) -> int:
    """Bytes one call at `batch` rows reads: the low-bit copy where the layer uses it, else the dense weight.
    (An Int4Linear or LowBitLinear keeps a dense copy too, for larger M; a small-M call reads only the low-bit
    one.)"""
    small = batch <= getattr(layer, "max_m", 0)
    if small and hasattr(layer, "blocks"):
        return _nbytes(*layer.blocks, layer.bias)
    if small and hasattr(layer, "int4"):
        return _nbytes(layer.int4, layer.scales_and_zeros, layer.bias)
    if small and hasattr(layer, "int8"):
        return _nbytes(layer.int8, layer.scales, layer.bias)
    return _nbytes(layer.weight, layer.bias)


def bytes_per_step(engine, batch: int) -> dict[str, int]:
    """Weight bytes a decode step at `batch` reads, by part (the tied embedding once, as the LM head)."""
    linears = engine_linears(engine)
    fused = engine.runner.fused
    if fused is None:
        params = {id(p): p for p in engine.runner.model.parameters()}.values()
        return {"all weights (Hugging Face modules)": _nbytes(*params)}
    norms = [fused.final_norm] + [n for layer in fused.layers for n in (layer.input_norm, layer.post_norm)]
    return {
        "decoder linear layers": sum(linear_bytes(lin, batch) for lin in linears[:-1]),
        "LM head": linear_bytes(linears[-1], batch),
        "norms and embedding rows": _nbytes(*norms) + batch * fused.embed.nbytes // fused.embed.vocab_size,
    }


def describe_bytes(engine, batch: int) -> str:
    layer = engine_linears(engine)[0]
    if batch <= getattr(layer, "max_m", 0) and hasattr(layer, "blocks"):
        kind = "the GGUF's own blocks, Q4_1 (4.5 bits per weight; the LM head Q8_0, 8.5 bits)"
    elif batch <= getattr(layer, "max_m", 0) and hasattr(layer, "int4"):
        kind = "int4: 0.5 byte per weight + a scale and a zero per 32 weights"
    elif batch <= getattr(layer, "max_m", 0) and hasattr(layer, "int8"):
        kind = "int8: 1 byte per weight + a scale per row"
    else:
        kind = f"dense {layer.weight.dtype}".replace("torch.", "")
    parts = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in bytes_per_step(engine, batch).items())
    return f"batch {batch}: {parts} (decoder layers {kind})"


# ------------------------------------------------------------------------------------------------ timing


def decode_rate(engine, batch: int, steps: int) -> tuple[float, float]:
    """(median decode step seconds, decode tokens/s) with `batch` sequences decoding."""
    decode_setup(engine, batch, steps)
    times = []
    while engine.has_work():
        t = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - t
        if sum(len(s.token_ids) for o in outs for s in o.samples) == batch:  # a full decode step
            times.append(elapsed)
    if not times:
        raise RuntimeError(f"no decode step ran all {batch} sequences")
    step = statistics.median(times)
    return step, batch / step


ROUND_FIGURES = ("step_s", "rate", "memory", "compute")


def ceiling_rounds(
    engine, batch: int, steps: int, rounds: int, matmul: str, weight_bytes: int, matmul_params: int, threads: int
):
    """`rounds` of: the machine's ceilings on `threads` (0.25 s each), then `steps` decode steps at `batch`. Per
    round the step's median seconds, its tokens/s, and both ceilings in tokens/s (memory: batch x bandwidth / bytes
    read per step; compute: FLOP/s / (2 x matmul weights) per token). A shared machine's speed drifts by 15-20 %
    from one minute to the next (docs/benchmarks.md), so a share is computed within a round, never across them."""
    out = []
    for _ in range(rounds):
        torch.set_num_threads(threads)  # the engine's step leaves torch on one thread where our kernels ran it
        ceilings = measure_ceilings(seconds=0.25, matmuls=(matmul,))
        step_s, rate = decode_rate(engine, batch, steps)
        out.append(
            {
                "step_s": step_s,
                "rate": rate,
                "memory": batch * ceilings["mem_read_gbs"] * 1e9 / weight_bytes,
                "compute": ceilings[f"matmul_{matmul}_gflops"] * 1e9 / (2 * matmul_params),
            }
        )
    return out


def linear_layers_time(engine, batch: int, repeats: int = 5) -> float:
    """Median seconds of one pass over the step's linear layers (the engine's own kernels, LM head included)
    at `batch` rows, nothing else: the matmul floor of a decode step."""
    layers = engine_linears(engine)
    dtype = layers[0].weight.dtype
    inputs = {w: torch.randn(batch, w, dtype=dtype) for w in {lin.weight.shape[1] for lin in layers}}
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            for lin in layers:
                lin(inputs[lin.weight.shape[1]])
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


# ------------------------------------------------------------------------------------------------ the section


def run(bench: Bench) -> list[str]:
    s = bench.s
    ceil = bench.results["ceilings"]
    engine = bench.engine()
    dtype = engine.config.dtype
    matmul = "bf16" if dtype == "bfloat16" else "fp32"
    gflops_key = f"matmul_{matmul}_gflops"
    matmul_params = sum(lin.weight.numel() for lin in engine_linears(engine))
    rows, data = [], {}
    for batch in (1, s.roofline_batch):
        log(f"4: decode rate at batch {batch}, {s.roofline_rounds} rounds")
        weight_bytes = sum(bytes_per_step(engine, batch).values())
        rounds = ceiling_rounds(
            engine, batch, s.decode_steps, s.roofline_rounds, matmul, weight_bytes, matmul_params, s.threads
        )
        linear_s = linear_layers_time(engine, batch)
        step_s, rate, memory, compute = (statistics.median(r[k] for r in rounds) for k in ROUND_FIGURES)
        bound = "memory" if memory < compute else "compute"
        memory_share = statistics.median(r["rate"] / r["memory"] for r in rounds)
        compute_share = statistics.median(r["rate"] / r["compute"] for r in rounds)
        data[batch] = {
            "decode_tok_s": rate,
            "step_ms": step_s * 1e3,
            "bytes_per_step": weight_bytes,
            "bytes_by_part": bytes_per_step(engine, batch),
            "memory_ceiling_tok_s": memory,
            "compute_ceiling_tok_s": compute,
            "bound": bound,
            "fraction": memory_share if bound == "memory" else compute_share,
            "rounds": rounds,
            "linear_only_ms": linear_s * 1e3,
            "linear_only_tok_s": batch / linear_s,
        }
        goal, share = ("P5", memory_share) if batch == 1 else ("P6", compute_share)
        rows.append(
            f"| {batch} | {rate:.1f} | {step_s * 1e3:.1f} | {weight_bytes / 2**20:.1f} | {memory:.1f} | "
            f"{compute:.1f} | {bound} | {bench.target(goal, share, f'batch {batch}')}{_spread(rounds, goal)} | "
            f"{linear_s * 1e3:.1f} "
            f"ms = {batch / linear_s:.1f} tok/s ({linear_s / step_s * 100:.0f} % of the step) |"
        )
    measure_profiles(bench)
    bench.results["sections"]["4"] = {
        "dtype": dtype,
        "quantization": engine.config.quantization,
        "matmul_parameters": matmul_params,
        "decode": data,
        "profile": bench.profiles,
    }
    return [
        f"The served engine: {dtype}, quantization {engine.config.quantization}, {engine.runner.impl} forward; "
        f"{matmul_params / 1e6:.1f} M weights in its matmuls. Weight bytes read per decode step, from the "
        f"engine's own layer objects: {describe_bytes(engine, 1)}; {describe_bytes(engine, s.roofline_batch)}. "
        f"Ceilings measured above: memory read {ceil['mem_read_gbs']:.1f} GB/s, {dtype} matmul "
        f"{ceil[gflops_key]:.1f} GFLOP/s; here each batch runs {s.roofline_rounds} rounds of both ceilings "
        f"(0.25 s each) then {s.decode_steps} decode steps, and every share is the median of the rounds' shares, "
        "each ceiling and rate from the same seconds (the other columns: medians of the rounds). Memory ceiling = "
        "batch x bandwidth / bytes read per step; compute "
        "ceiling = FLOP/s / (2 x matmul weights) per token. P5: batch 1 against the memory ceiling (target "
        f"{GOALS['P5'].text}); P6: batch {s.roofline_batch} against the compute ceiling (target "
        f"{GOALS['P6'].text}). Decode rate: the in-process engine, every sequence decoding (prompt already in), "
        f"greedy, median step time of a round's steps. Linear layers alone: the engine's own linear "
        "layer objects called on a [batch, in_features] input, layer after layer, nothing else (the matmul floor "
        "of a step with these kernels).",
        "",
        "| batch | decode tok/s | step ms | weight MiB read per step | memory ceiling tok/s | compute ceiling "
        "tok/s | binding | share of the P5 / P6 ceiling | linear layers alone |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *bench.bounds[DECODE_PROFILE],
        "",
        _profile_summary(data, bench.profiles),
        "",
        bench.plot(_figure(data, bench.profiles, matmul_params), "roofline.png"),
    ]


def _spread(rounds: list[dict], goal: str) -> str:
    """The rounds' shares, lowest and highest, where there are several."""
    if len(rounds) < 2:
        return ""
    shares = [r["rate"] / r["memory" if goal == "P5" else "compute"] * 100 for r in rounds]
    return f", rounds {min(shares):.0f}-{max(shares):.0f} %"


def _profile_summary(data: dict, profiles: dict) -> str:
    parts = []
    for batch, d in data.items():
        p = profiles[batch]
        top = ", ".join(
            f"{k} {v / p['step_ms'] * 100:.0f} %" for k, v in sorted(p["categories"].items(), key=lambda kv: -kv[1])[:3]
        )
        matmul = sum(p["categories"].get(name, 0.0) for name in (MATMUL, LOWBIT_MATMUL)) / p["step_ms"]
        linear = d["linear_only_ms"] / d["step_ms"]
        parts.append(
            f"Batch {batch} reaches {d['fraction'] * 100:.0f} % of its {d['bound']} ceiling; the step is "
            f"{matmul * 100:.0f} % matmuls, the largest parts being {top}. The linear layers alone, with nothing "
            f"around them, take {linear * 100:.0f} % of the step's time: "
            + (
                "most of the gap to the ceiling is the matmul kernels at these shapes, not the engine around them."
                if linear >= 0.6
                else "the engine around the matmuls (attention, Python) is a large part of the gap."
            )
        )
    return " ".join(parts)


def _figure(data: dict, profiles: dict, matmul_params: int):
    import matplotlib.pyplot as plt

    bw = statistics.median(r["memory"] * d["bytes_per_step"] / b for b, d in data.items() for r in d["rounds"])
    flops = statistics.median(r["compute"] * 2 * matmul_params for d in data.values() for r in d["rounds"])

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    intensity = [0.1 * 2 ** (k / 4) for k in range(0, 45)]  # FLOP per byte, 0.1 to ~240
    ax.loglog(intensity, [min(flops, bw * i) / 1e9 for i in intensity], color="k", label="roofline (measured)")
    for batch, d in data.items():
        label = f"batch {batch}: {d['decode_tok_s']:.0f} tok/s ({d['fraction'] * 100:.0f} %)"
        ax.loglog(
            [2 * matmul_params * batch / d["bytes_per_step"]],
            [d["decode_tok_s"] * 2 * matmul_params / 1e9],
            "o",
            markersize=8,
            label=label,
        )
    ax.set_xlabel("arithmetic intensity, FLOP / weight byte read")
    ax.set_ylabel("GFLOP/s")
    ax.set_title("Decode against the measured roofline")
    ax.legend(fontsize=8)
    bottom = [0.0] * len(profiles)
    for cat in dict.fromkeys(k for p in profiles.values() for k in p["categories"]):
        vals = [p["categories"].get(cat, 0.0) / p["step_ms"] * 100 for p in profiles.values()]
        ax2.bar([f"batch {b}" for b in profiles], vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_ylabel("% of the decode step")
    ax2.set_title("Decode step breakdown (torch.profiler)")
    ax2.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return fig
