"""The report of one run, benchmarks/results/README.md: the targets first (with the tables that show what bounds a
missed one), then the machine, its ceilings, each section's tables, and notes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.core.common import SEED_SPEEDUP
from benchmarks.core.context import Bench
from benchmarks.core.targets import GOALS, SUMMARY_ORDER
from benchmarks.core.variants import engine_parameters, resolved_dtype
from launcher.paths import REPO_ROOT


def summary(bench: Bench, info: dict, errors: dict[int, str]) -> list[str]:
    """The table of every target row: measured, target, verdict, and where the report shows what bounds it."""
    rows, missed_bounds = [], []
    for goal_id in SUMMARY_ORDER:
        goal = GOALS[goal_id]
        measured = [t for t in bench.results["targets"] if t["id"] == goal_id]
        for t in measured:
            bound = "" if t["met"] else goal.bound
            if bound and bound not in missed_bounds:
                missed_bounds.append(bound)
            rows.append(
                f"| {goal_id} | {goal.what} | {t['condition']} | {t['measured']} | {t['target']} | "
                f"{'met' if t['met'] else '**NOT met**'} | {bound} |"
            )
        if not measured:
            rows.append(
                f"| {goal_id} | {goal.what} | | {_not_measured(bench, goal.section, errors)} | {goal.text} | | |"
            )
    lines = [
        "## Targets",
        "",
        f"Machine: {info['host_cpu']}, {info['logical_cpus']} logical CPUs, {info['memory_gib']} GiB RAM, "
        f"CPU flags {' '.join(info.get('cpu_flags', [])) or 'unknown'} (our low-bit kernel: "
        f"{info.get('kernel_isa', 'n/a')}), our engine {bench.s.engine_threads or 'its default'} torch thread(s), "
        f"the peers {bench.s.peer_threads}; run on {info['date']}.",
        "",
        "| target | what | measured at | measured | target | verdict | what bounds it (below) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    if missed_bounds:
        lines += ["### What bounds the missed targets", ""]
        for bound in missed_bounds:
            lines += [f"**{bound}**", ""]
            lines += bench.bounds.get(bound, ["(not measured in this run)"]) + [""]
    return lines


def _not_measured(bench: Bench, section: int, errors: dict[int, str]) -> str:
    if section in errors:
        return f"section {section} failed"
    skipped = bench.results["sections"].get(str(section), {}).get("skipped")
    if skipped:
        return f"skipped: {skipped}"
    return "not run" if str(section) not in bench.results["sections"] else "not reached at this setting"


def machine_and_settings(bench: Bench, info: dict) -> list[str]:
    s = bench.s
    params = engine_parameters(s.engine_threads)
    return [
        "## Machine and settings",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {info['host_cpu']}, {info['logical_cpus']} logical CPUs, {info['memory_gib']} GiB RAM |",
        f"| CPU flags | {' '.join(info.get('cpu_flags', []))}; "
        f"our low-bit kernel runs {info.get('kernel_isa', 'n/a')} |",
        f"| threads | ours: `num_threads` {s.engine_threads or DEFAULT_THREADS}; Hugging Face and llama.cpp "
        f"(`-t`) {s.peer_threads} (every core): each at its own best |",
        f"| load average (1, 5, 15 min) | start {info['load_average_start']}, end {info['load_average_end']} |",
        f"| software | Python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
        f"{info['platform']} |",
        f"| model | {Path(bench.model_dir).name} ({os.path.relpath(os.path.abspath(bench.args.model), REPO_ROOT)}) |",
        f"| served configuration | model_repository/llm/config.pbtxt: dtype {params.get('dtype')} (= "
        f"{resolved_dtype()} here), quantization {params.get('quantization')}, model_impl "
        f"{params.get('model_impl')}, max_num_seqs {params.get('max_num_seqs')}, max_num_batched_tokens "
        f"{params.get('max_num_batched_tokens')}, block_size {params.get('block_size')}, kv_cache_memory_bytes "
        f"{params.get('kv_cache_memory_bytes')}, prefix caching {params.get('enable_prefix_caching')}; section 1 "
        "uses a copy with max_num_seqs 8, section 2's fp32 rows a copy with dtype float32, quantization none |",
        "| sampling | greedy; every request generates exactly its max_tokens |",
        f"| workloads | max_tokens {s.max_tokens} (sections 2, 3, 5, 6), streams {s.concurrency} (2, 3, 6), "
        f"requests per level max({s.min_requests}, {s.requests_per_stream:g} x streams); load levels "
        f"{s.load_levels} (5), requests per level max({s.load_min_requests}, {s.load_requests_per_stream:g} x "
        f"streams); section 3 repeats {s.repeats}; section 1 queue repeats {s.seed_repeats}; section 6 batch-1 "
        f"decode {s.decode_rounds} rounds of {s.decode_tokens} tokens (llama-bench, then ours) |",
        "",
        "Medians throughout; every ratio compares numbers measured in this run.",
        "",
    ]


def ceilings_table(ceilings: dict, threads: int) -> list[str]:
    return [
        "## The machine's ceilings (measured in this run)",
        "",
        "| fp32 matmul GFLOP/s | bf16 matmul GFLOP/s | memory read GB/s |",
        "|---|---|---|",
        f"| {ceilings['matmul_fp32_gflops']:.1f} | {ceilings['matmul_bf16_gflops']:.1f} | "
        f"{ceilings['mem_read_gbs']:.1f} |",
        "",
        f"({threads} thread(s); 1024 x 1024 matmuls; summing a 256 MiB fp32 tensor.)",
        "",
    ]


NOTES = [
    "## Notes",
    "",
    "- Seed workload: the 32 (prompt, max_tokens) pairs and batch size 8 are listed in full in the seed "
    "(section 8, `request_queue`) and copied verbatim into benchmarks/core/common.py SEED_WORKLOAD. The seed's "
    f"speed-up is its logged durations 88.22 s / 52.36 s = {SEED_SPEEDUP:.2f}x (quoted as 1.69x in the issue; "
    "its logs show 8 static batches and 64 completions, so it ran the queue twice: section 1 runs the 32 as "
    "listed and, by default, the queue twice). The seed's own static loop has a bug (`[p[0] for p in prompts]`); "
    "we do what it meant: each batch's own prompts.",
    "- Section 1 static batching forces every row of a batch to the batch's longest max_tokens "
    "(`min_new_tokens`), as the seed's `generate_batch(inputs, max_tokens=max_tokens)` does; useful tokens "
    "are the requested ones.",
    "- The client threads of the Triton and llama-server runs share the machine's cores with the servers.",
    "- llama.cpp (section 6) runs only where its binaries are given (`--llama-cpp-dir`); every server of the run "
    "listens on loopback only.",
    "",
]


DEFAULT_THREADS = "0 (its default: every core, every step)"


def write_report(
    bench: Bench,
    info: dict,
    titles: dict[int, str],
    sections: dict[int, list[str]],
    errors: dict[int, str],
    elapsed: float,
) -> Path:
    lines = [
        "# Benchmark report" + (" (QUICK smoke run: not a measurement)" if bench.s.quick else ""),
        "",
        f"Generated by `llm-bench {_command_line(sys.argv[1:])}` on {info['date']} in {elapsed / 60:.1f} min.",
        "",
        *summary(bench, info, errors),
        *machine_and_settings(bench, info),
        *(ceilings_table(bench.results["ceilings"], bench.s.peer_threads) if "ceilings" in bench.results else []),
    ]
    for n in sorted(set(sections) | set(errors)):
        lines += [f"## {n}. {titles[n]}", ""]
        if n in errors:
            lines += ["**FAILED**:", "", "```", errors[n].rstrip(), "```", ""]
        else:
            lines += sections[n] + [""]
    path = bench.out / "README.md"
    path.write_text("\n".join(lines + NOTES))
    return path


def _command_line(args: list[str]) -> str:
    """The run's arguments with local paths cut to their last part: the report says what ran, not where."""
    return " ".join(Path(a).name if "/" in a and Path(a).is_absolute() else a for a in args)
