"""`make bench-sizes`: speed and memory at the sizes people serve, against llama.cpp on the same file.

For each size and kind (`benchmarks/tools/shaped_models.py`: Llama-3.2-1B-, 3B- and Llama-3.1-8B-shaped random weights,
quantized by llama.cpp's llama-quantize), the default served configuration with `model` set to the file, through
tritonserver, against `llama-bench` and `llama-server` (`-c 8192 -np 32`, as report section 6) on the same file:

- launch to READY (tritonserver started until its health endpoint says ready), and llama-server's the same way;
- resident memory: peak and steady (after the runs) of the whole process tree (tritonserver and its stubs),
  sampled every 50 ms, against llama-server's peak (VmHWM) and steady;
- batch-1 decode tok/s (one request at a time) against llama-bench `-p 0` and llama-server at one stream;
- 8 and 32 closed-loop streams against llama-server;
- time to first token of a long prompt and decode speed at that context (the prompt in llama-server's own slot of
  the same context).

Writes benchmarks/results/sizes/README.md and results.json, with the machine and its CPU flags.

    python -m benchmarks.tools.model_sizes [--sizes 1b:Q4_K_M,8b:Q4_K_M] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.core import llama_cpp_build, thread_cpu
from benchmarks.core.common import PROMPTS, LoadResult
from benchmarks.core.machine import machine_info
from benchmarks.core.progress import log
from benchmarks.core.server import Server
from benchmarks.core.variants import MAIN_MODEL
from benchmarks.sections.vs_llama_cpp import LlamaCpp, LlamaServer, decode_tokens_per_s
from benchmarks.tools import shaped_models
from launcher.paths import REPO_ROOT

DEFAULT_SIZES = "1b:Q4_K_M,1b:Q8_0,3b:Q4_K_M,8b:Q4_K_M"
LONG_PROMPT_WORDS = 2200  # about 3,000 tokens of SmolLM2's tokenizer
# Both hold the same tokens of KV cache: llama-server `-c 8192 -kvu` (one pool shared by its 32 slots, as ours is)
# and ours sized for 8192 tokens in its KV cache dtype.
CONTEXT = 8192


@dataclass
class Workload:
    decode_tokens: int = 64  # per batch-1 request
    decode_requests: int = 3
    stream_tokens: int = 32
    requests_per_stream: int = 2
    streams: tuple[int, ...] = (8, 32)
    long_prompt_words: int = LONG_PROMPT_WORDS
    long_decode_tokens: int = 16


def workload(size: str) -> Workload:
    """Smaller runs where a step is slower, so that every size finishes in minutes."""
    if size == "8b":  # the long prompt shorter: its fp32 prefill alone would take minutes
        return Workload(
            decode_tokens=32, decode_requests=2, stream_tokens=16, requests_per_stream=1, long_prompt_words=750
        )
    if size == "tiny":
        return Workload(
            decode_tokens=8,
            decode_requests=1,
            stream_tokens=4,
            requests_per_stream=1,
            streams=(2,),
            long_prompt_words=200,
            long_decode_tokens=4,
        )
    return Workload()


def long_prompt(words: int) -> str:
    text = " ".join(PROMPTS).split()
    return " ".join(text[i % len(text)] for i in range(words))


class TreeMemory:
    """Resident memory of a process and its descendants, summed, sampled every `period_s` on a thread of its own."""

    def __init__(self, period_s: float = 0.05):
        self.period_s, self.peak, self.pid = period_s, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, pid: int) -> None:
        self.pid = pid
        self._thread.start()

    def now(self) -> int:
        return sum(_status(pid, "VmRSS") for pid in thread_cpu.process_tree(self.pid))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, self.now())

    def stop(self) -> None:
        self._stop.set()


def _status(pid: int, key: str) -> int:
    """A /proc/PID/status memory field in bytes (0 where the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _runs(run, work: Workload) -> dict:
    """The workload through `run(requests, concurrency) -> LoadResult`: figures by name."""
    out = {}
    single = [run([(PROMPTS[i % len(PROMPTS)], work.decode_tokens)], 1) for i in range(work.decode_requests)]
    out["batch1_tok_s"] = statistics.median(decode_tokens_per_s(r, work.decode_tokens) for r in single)
    for c in work.streams:
        requests = [(PROMPTS[i % len(PROMPTS)], work.stream_tokens) for i in range(c * work.requests_per_stream)]
        result = run(requests, c)
        out[f"streams_{c}_tok_s"] = result.tokens_per_s
    long = run([(long_prompt(work.long_prompt_words), work.long_decode_tokens)], 1)
    out["long_ttft_s"] = long.ttft_s[0]
    out["long_decode_tok_s"] = decode_tokens_per_s(long, work.long_decode_tokens)
    return out


def _checked(result: LoadResult, who: str) -> LoadResult:
    if result.errors:
        raise RuntimeError(f"{who}: {len(result.errors)} request(s) failed: {result.errors[:2]}")
    return result


def kv_cache_parameters(gguf: Path, context: int) -> dict[str, str]:
    """Our KV cache sized for `context` tokens of this model (the served default dtype)."""
    from backend.model import model_source
    from backend.model.runner import DTYPES, ModelRunner

    shape = ModelRunner.read_shape(str(model_source.resolve(gguf)))
    return {"kv_cache_memory_bytes": str(context * shape.kv_bytes_per_token(DTYPES["float32"]))}


def measure_ours(gguf: Path, threads: int, workdir: Path, work: Workload, context: int) -> dict:
    memory = TreeMemory()
    parameters = kv_cache_parameters(gguf, context)
    server = Server(threads, workdir, [MAIN_MODEL], str(gguf), parameters, lambda proc: memory.watch(proc.pid))
    try:
        peak_load = memory.peak
        figures = _runs(lambda requests, c: _checked(server.run(MAIN_MODEL, requests, c), "ours"), work)
        steady = memory.now()
    finally:
        memory.stop()
        server.stop()
    return {
        **figures,
        "ready_s": server.ready_s,
        "peak_load_bytes": peak_load,
        "peak_bytes": memory.peak,
        "steady_bytes": steady,
        **parameters,
    }


def measure_llama(llama: LlamaCpp, threads: int, workdir: Path, work: Workload, context: int) -> dict:
    bench = llama.bench_decode(threads, work.decode_tokens, max(2, work.decode_requests))
    started = time.perf_counter()
    server = LlamaServer(llama, threads, workdir / "llama-server.log", ("-kvu",), context=context)
    note = ""
    ready_s = time.perf_counter() - started  # (includes its two warm-up requests)
    try:
        figures = _runs(lambda requests, c: _checked(server.run(requests, c), "llama-server"), work)
        peak, steady = _status(server.proc.pid, "VmHWM"), _status(server.proc.pid, "VmRSS")
    finally:
        server.stop()
    return {
        **figures,
        "llama_bench_tok_s": bench["tokens_per_s"],
        "ready_s": ready_s,
        "peak_bytes": peak,
        "steady_bytes": steady,
        "build": bench["build"],
        "note": note,
    }


def _streams(ours: dict, theirs: dict, c: int) -> str:
    key = f"streams_{c}_tok_s"
    if key not in ours:
        return "-"
    return f"{ours[key]:.1f} / {theirs[key]:.1f} ({ours[key] / theirs[key]:.2f}x)"


def report(results: list[dict], machine: dict) -> str:
    mib = 2**20
    lines = [
        "# Model sizes: ours through Triton against llama.cpp on the same file",
        "",
        f"Generated by `python -m benchmarks.tools.model_sizes` on {machine['date']}. Machine: {machine['host_cpu']}, "
        f"{machine['logical_cpus']} logical CPUs, {machine['memory_gib']} GiB; "
        f"CPU flags {' '.join(machine['cpu_flags'])}; "
        f"our kernel: {machine['kernel_isa']}; torch {machine['torch']}; load average at the start "
        f"{machine['load_average_start']}.",
        "",
        "Random weights of each shape (benchmarks/tools/shaped_models.py), quantized by llama.cpp's llama-quantize. "
        "Ours: the "
        f"default served configuration with `model` set to the file and a KV cache of {CONTEXT} tokens (fp32: twice "
        f"llama.cpp's f16 bytes). llama.cpp: llama-bench `-p 0` and llama-server `-c {CONTEXT} -np 32 -kvu` (one KV "
        "pool shared by the slots, as ours is), every core. Memory: the whole process tree's resident bytes.",
        "",
        "| model | file MiB | READY s (ours / llama-server) | peak MiB (ours / theirs, x) | steady MiB (ours / theirs) "
        "| batch 1 tok/s (ours / llama-server / llama-bench, x server) | 8 streams (x) | 32 streams (x) "
        "| long prompt TTFT s (ours / theirs) | decode at that context tok/s (ours / theirs) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        o, t = r["ours"], r["llama"]

        lines.append(
            f"| {r['size']} {r['kind']} | {r['file_bytes'] / mib:.0f} | {o['ready_s']:.1f} / {t['ready_s']:.1f} "
            f"| {o['peak_bytes'] / mib:.0f} / {t['peak_bytes'] / mib:.0f} ({o['peak_bytes'] / t['peak_bytes']:.2f}x) "
            f"| {o['steady_bytes'] / mib:.0f} / {t['steady_bytes'] / mib:.0f} "
            f"| {o['batch1_tok_s']:.1f} / {t['batch1_tok_s']:.1f} / {t['llama_bench_tok_s']:.1f} "
            f"({o['batch1_tok_s'] / t['batch1_tok_s']:.2f}x) | {_streams(o, t, 8)} | {_streams(o, t, 32)} "
            f"| {o['long_ttft_s']:.2f} / {t['long_ttft_s']:.2f} "
            f"| {o['long_decode_tok_s']:.1f} / {t['long_decode_tok_s']:.1f} |"
        )
    notes = sorted({r["llama"]["note"] for r in results if r["llama"]["note"]})
    return "\n".join(lines + [""] + notes) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sizes", default=DEFAULT_SIZES, help="size:kind pairs (sizes: " + ", ".join(shaped_models.SHAPES) + ")"
    )
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "sizes"))
    ap.add_argument("--threads", type=int, default=0, help="threads for both (0: every core)")
    ap.add_argument("--llama-cpp-dir", default=llama_cpp_build.default_bin_dir())
    args = ap.parse_args(argv)
    import os

    threads = args.threads or len(os.sched_getaffinity(0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info(threads)
    results = []
    for pair in args.sizes.split(","):
        size, kind = pair.split(":")
        log(f"sizes: {size} {kind}: the file")
        gguf = shaped_models.model_file(size, kind, Path(args.llama_cpp_dir))
        llama = LlamaCpp.find(args.llama_cpp_dir, str(gguf))
        if isinstance(llama, str):
            raise SystemExit(f"llama.cpp: {llama}")
        work = workload(size)
        workdir = out / "runs" / f"{size}-{kind}"
        workdir.mkdir(parents=True, exist_ok=True)
        log(f"sizes: {size} {kind}: ours through Triton")
        ours = measure_ours(gguf, threads, workdir, work, CONTEXT)
        log(f"sizes: {size} {kind}: llama.cpp")
        theirs = measure_llama(llama, threads, workdir, work, CONTEXT)
        results.append({"size": size, "kind": kind, "file_bytes": gguf.stat().st_size, "ours": ours, "llama": theirs})
        (out / "results.json").write_text(json.dumps({"machine": machine, "results": results}, indent=1) + "\n")
        (out / "README.md").write_text(report(results, machine))
    print((out / "README.md").read_text())


if __name__ == "__main__":
    main()
