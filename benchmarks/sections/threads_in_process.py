"""Section 9: thread by thread, in process: our engine's decode rate against llama.cpp's on the same GGUF, at each
thread count from one to every core, with no server on either side. It shows how each side scales with cores, and
it runs where no Triton server does (a machine to compare CPUs on)."""

from __future__ import annotations

import gc

import torch

from benchmarks.core import llama_cpp_build
from benchmarks.core.context import Bench
from benchmarks.core.progress import log
from benchmarks.sections.roofline import decode_rate, linear_layers_time
from benchmarks.sections.vs_llama_cpp import LlamaCpp

TITLE = "Thread by thread, in process: our decode rate against llama.cpp's (no server)"
PROMPT_TOKENS = 32  # llama-batched-bench -npp: each sequence's prompt before it decodes


def thread_counts(cores: int) -> list[int]:
    """1, 2, half the cores and every core (those that exist)."""
    return sorted({n for n in (1, 2, cores // 2, cores) if 1 <= n <= cores})


def ours(bench: Bench, threads: int, batches: list[int]) -> dict:
    """The served configuration at `threads`: decode tok/s at each batch (every sequence decoding) and the batch-1
    linear layers alone."""
    engine = bench.new_engine(threads)
    try:
        row = {"config": f"{engine.config.dtype}, quantization {engine.config.quantization}"}
        row["decode_tok_s"] = {b: decode_rate(engine, b, bench.s.decode_steps)[1] for b in batches}
        row["linear_b1_ms"] = linear_layers_time(engine, 1) * 1e3
        return row
    finally:
        del engine
        gc.collect()


def run(bench: Bench) -> list[str]:
    s = bench.s
    batches = s.concurrency
    llama = LlamaCpp.find(bench.args.llama_cpp_dir, bench.args.gguf, llama_cpp_build.IN_PROCESS_PROGRAMS)
    rows: dict[int, dict] = {}
    try:
        for n in thread_counts(s.peer_threads):
            log(f"9: {n} thread(s)")
            row = rows[n] = {"ours": ours(bench, n, batches)}
            if not isinstance(llama, str):
                row["llama_bench"] = llama.bench_decode(n, s.decode_tokens, s.llama_bench_repetitions)["tokens_per_s"]
                row["llama_batched"] = llama.batched_decode(n, batches, PROMPT_TOKENS, s.decode_tokens)
    finally:
        torch.set_num_threads(s.threads)
    bench.results["sections"]["9"] = {"batches": batches, "threads": rows} | (
        {"llama_cpp": llama} if isinstance(llama, str) else {}
    )
    head = ["threads", "ours: batch 1", "llama-bench", "ratio"]
    for b in batches[1:]:
        head += [f"ours: batch {b}", f"llama-batched-bench, {b}", "ratio"]
    lines = [
        f"Decode tok/s in process, at each thread count: ours the served configuration "
        f"({next(iter(rows.values()))['ours']['config'] if rows else '-'}), the median step with every sequence "
        f"decoding; llama.cpp's `llama-bench -p 0 -n {s.decode_tokens}` at batch 1 and `llama-batched-bench -npp "
        f"{PROMPT_TOKENS} -ntg {s.decode_tokens}` (its decode rate, S_TG) with that many sequences. Neither side "
        "has a server in the way, so this runs where Triton does not, and shows how each scales with cores.",
        *([f"llama.cpp not run: {llama}."] if isinstance(llama, str) else []),
        "",
        "| " + " | ".join(head + ["our linear layers alone, batch 1"]) + " |",
        "|" + "---|" * (len(head) + 1),
    ]
    for n, row in rows.items():
        ours_rate = row["ours"]["decode_tok_s"]
        cells = [str(n), f"{ours_rate[batches[0]]:.1f}", *_versus(ours_rate[batches[0]], row.get("llama_bench"))]
        for b in batches[1:]:
            theirs = (row.get("llama_batched") or {}).get(b)
            cells += [f"{ours_rate[b]:.1f}", *_versus(ours_rate[b], theirs)]
        lines.append("| " + " | ".join(cells + [f"{row['ours']['linear_b1_ms']:.2f} ms"]) + " |")
    return lines


def _versus(ours_rate: float, theirs: float | None) -> list[str]:
    if theirs is None:
        return ["-", "-"]
    return [f"{theirs:.1f}", f"**{ours_rate / theirs:.2f}x**"]
