"""The benchmark report: one process run on one machine, every ratio measured in that run.

    python benchmarks/bench.py [--out benchmarks/results] [--only 1,2,3,4,5] [--quick] [--threads N]

Sections (all run by default; `--only` picks some):

  1. The seed workload (the seed text continuous_batching_from_scratch.txt: 32 prompts with their own
     max_tokens, batch size 8): static batching with Hugging Face `generate` (padded batches of 8, left
     padding, each batch run to its longest request's max_tokens, as the seed does) against our engine
     through the live Triton server (a temporary model repository whose max_num_seqs is 8) with at most 8
     requests in flight. Wall-time ratio; the seed saw 1.69x, the target is >= 3x. Run on the 32 as listed
     and on the queue twice over, as the seed's logs show it ran (`--seed-repeats`, default 1,2).
  2. Output tokens/s at 1, 8 and 32 concurrent streams: our engine through Triton (gRPC streaming) against
     transformers' own continuous batching (`init_continuous_batching`), same model, prompts, dtype (fp32),
     greedy, each request exactly max_tokens long (ignore_eos / eos_token_id=-1).
  3. Triton path overhead: the same workloads through our engine in-process (no server) against through
     Triton. Target <= 10 %.
  4. Roofline: batch-1 decode tokens/s against weight bytes / measured memory read bandwidth, batch-32 decode
     tokens/s against 2 x parameters per token / measured matmul FLOP/s; a torch.profiler breakdown of one
     decode step (matmuls, attention with its KV gather, sampling, Python overhead) where we fall short.
  5. Cost as load grows: throughput and p50/p99 TTFT and ITL at 1, 2, 4, ..., 64 concurrent streams, past
     the server's max_num_seqs (32), plotted.

Writes <out>/README.md (tables, settings, machine), <out>/results.json and PNG plots. The machine's ceilings
(fp32 / bf16 matmul GFLOP/s, memory read GB/s) are measured in the same run at the run's thread count.
`--quick` is a smoke test (few prompts, short outputs), not a measurement. A full run should take about
10-15 minutes on 2 quiet cores (the report records the time it took); `--seed-repeats 1` and `--repeats 1`
shorten it by a few minutes. Run it on a quiet machine: torch threads that share a core with another busy
process slow down many times over (on a busy machine, `--threads 1` suffers much less).

llama.cpp (section 6 of the issue) is not compared here.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    DEFAULT_MODEL,
    PROMPTS,
    SEED_BATCH_SIZE,
    SEED_SPEEDUP,
    SEED_WORKLOAD,
    LoadResult,
    measure_ceilings,
    percentile,
    read_parameters,
    run_engine,
    run_engine_requests,
    run_triton,
    write_model_repository,
)

SECTIONS = {
    1: "Seed workload: static batching (HF generate) vs our engine through Triton",
    2: "Output tokens/s: our engine through Triton vs transformers continuous batching",
    3: "Triton path overhead: in-process engine vs through Triton",
    4: "Roofline: decode tokens/s against the machine's ceilings",
    5: "Cost as load grows",
}
GREEDY = {"temperature": 0.0, "ignore_eos": True}
MAIN_MODEL = "llm"  # the default configuration (max_num_seqs 32)
SEED_MODEL = "llm_seq8"  # max_num_seqs 8 for section 1


@dataclass
class Settings:
    threads: int
    max_tokens: int  # sections 2, 3, 5
    concurrency: list[int]  # sections 2, 3
    load_levels: list[int]  # section 5
    requests_per_stream: float  # sections 2, 3: a level sends max(min_requests, c * requests_per_stream)
    load_requests_per_stream: float  # section 5: max(load_min_requests, c * this)
    load_min_requests: int
    min_requests: int
    seed_requests: int  # section 1: the first n of the 32
    seed_token_scale: float  # section 1: max_tokens multiplied by this (quick mode shortens them)
    seed_repeats: list[int]  # section 1: the queue once (as listed), twice (as the seed's logs ran it), ...
    repeats: int  # section 3: runs per path and level (median)
    roofline_batch: int
    decode_steps: int  # section 4: timed decode steps
    profile_steps: int
    quick: bool


def make_settings(args) -> Settings:
    if args.quick:
        s = Settings(threads=args.threads, max_tokens=8, concurrency=[1, 4], load_levels=[1, 2, 4],
                     requests_per_stream=2, load_requests_per_stream=2, load_min_requests=2,
                     min_requests=2, seed_requests=16, seed_token_scale=1 / 16, seed_repeats=[1], repeats=1,
                     roofline_batch=8, decode_steps=4, profile_steps=2, quick=True)
    else:
        s = Settings(threads=args.threads, max_tokens=64, concurrency=[1, 8, 32],
                     load_levels=[1, 2, 4, 8, 16, 32, 64], requests_per_stream=2, load_requests_per_stream=1.5,
                     load_min_requests=8, min_requests=4, seed_requests=32,
                     seed_token_scale=1.0, seed_repeats=[1, 2], repeats=2, roofline_batch=32, decode_steps=16,
                     profile_steps=4, quick=False)
    for name in ("max_tokens", "repeats", "roofline_batch", "decode_steps"):
        if getattr(args, name, None):
            setattr(s, name, getattr(args, name))
    if args.concurrency:
        s.concurrency = _ints(args.concurrency)
    if args.load_levels:
        s.load_levels = _ints(args.load_levels)
    if args.seed_repeats:
        s.seed_repeats = _ints(args.seed_repeats)
    return s


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def throughput_requests(s: Settings, concurrency: int, load: bool = False) -> list[tuple[str, int]]:
    if load:
        n = max(s.load_min_requests, round(concurrency * s.load_requests_per_stream))
    else:
        n = max(s.min_requests, round(concurrency * s.requests_per_stream))
    return [(PROMPTS[i % len(PROMPTS)], s.max_tokens) for i in range(n)]


def seed_requests(s: Settings) -> list[tuple[str, int]]:
    return [(p, max(2, round(m * s.seed_token_scale))) for p, m in SEED_WORKLOAD[: s.seed_requests]]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ the machine


def machine_info(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = float("nan")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass
    import transformers

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host_cpu": cpu, "logical_cpus": os.cpu_count(), "memory_gib": round(mem_gib, 1),
        "torch_threads": threads, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "platform": platform.platform(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }


# ------------------------------------------------------------------------------------------------ the server


class Server:
    """tritonserver (scripts/serve.py) on free loopback ports with a temporary model repository: `llm` as
    configured in model_repository/llm, and `llm_seq8` with max_num_seqs 8; both at the run's thread count."""

    def __init__(self, threads: int, workdir: Path):
        import serve

        self.serve = serve
        common = {"num_threads": str(threads)}
        self.variants = {MAIN_MODEL: dict(common), SEED_MODEL: {**common, "max_num_seqs": "8"}}
        self.repository = write_model_repository(workdir / "model_repository", self.variants)
        self.log_path = workdir / "tritonserver.log"
        self.ports = [serve.free_port() for _ in range(3)]
        log(f"starting tritonserver (HTTP {self.ports[0]}, gRPC {self.ports[1]}; log {self.log_path})")
        self.proc = serve.start_server(self.repository, *self.ports, self.log_path)
        try:
            serve.wait_until_ready(self.ports[0], self.proc, timeout_s=600)
        except Exception:
            serve.stop_server(self.proc)
            raise
        self.grpc_url = f"127.0.0.1:{self.ports[1]}"
        for model in self.variants:  # warm-up
            run_triton(self.grpc_url, model, [(PROMPTS[0], 4)] * 2, GREEDY, 2)
        log("tritonserver ready")

    def run(self, model: str, requests: list[tuple[str, int]], concurrency: int) -> LoadResult:
        result = run_triton(self.grpc_url, model, requests, GREEDY, concurrency)
        if result.errors:
            raise RuntimeError(f"{len(result.errors)} request(s) failed through Triton: {result.errors[:3]}")
        return result

    def stop(self) -> None:
        code = self.serve.stop_server(self.proc)
        log(f"tritonserver stopped (exit code {code})")


def engine_parameters(threads: int) -> dict[str, str]:
    """The `llm` variant's parameters: what the in-process engine must use to compare with the server."""
    return {**read_parameters(), "num_threads": str(threads)}


# ----------------------------------------------------------------------------------------- Hugging Face paths


def load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, tok


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
            out = model.generate(**enc, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                                 pad_token_id=pad)
            times.append(time.perf_counter() - t)
            new = out.shape[1] - enc.input_ids.shape[1]
            if new != longest:
                raise RuntimeError(f"HF generate made {new} tokens, expected {longest}")
            generated += new * len(batch)
        wall = time.perf_counter() - start
    return {"wall_s": wall, "batch_s": times, "generated_tokens": generated,
            "useful_tokens": sum(m for _, m in requests), "steps": sum(max(m for _, m in b) for b in batches)}


class HFContinuous:
    """transformers' continuous batching (ContinuousBatchingManager), driven with at most `concurrency`
    requests in flight; the manager's limits match our engine's (32 sequences, 512 tokens per step)."""

    def __init__(self, model, tok, max_prompt_tokens: int, max_tokens: int, max_seqs: int = 32,
                 max_batch_tokens: int = 512):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.tok = tok
        page = 64
        blocks = max_seqs * (math.ceil((max_prompt_tokens + max_tokens) / page) + 1) + 8
        gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1,
                               pad_token_id=tok.eos_token_id)
        cbc = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens,
                                       max_requests_per_batch=max_seqs)
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


# ------------------------------------------------------------------------------------------------ the sections


class Bench:
    def __init__(self, args, settings: Settings, out: Path):
        self.args, self.s, self.out = args, settings, out
        self.model_dir = str(Path(args.model).resolve())
        self.results: dict = {"settings": asdict(settings), "sections": {}}
        self.report: list[str] = []
        self.plots: list[str] = []
        self.server: Server | None = None
        self._engine = None
        self._hf = None
        self.triton_runs: dict[int, list[LoadResult]] = {}  # sections 2 and 3 share these
        self.inproc_runs: dict[int, list] = {}  # RunResult

    # ---- shared resources
    def engine(self):
        if self._engine is None:
            from backend import EngineConfig, LLMEngine

            log("loading the in-process engine")
            params = engine_parameters(self.s.threads)
            params["model"] = self.model_dir
            self._engine = LLMEngine(EngineConfig.from_parameters(params))
            run_engine_requests(self._engine, [(PROMPTS[0], 4)] * 2, GREEDY, 2)  # warm-up
        return self._engine

    def hf(self):
        if self._hf is None:
            log("loading the Hugging Face model")
            self._hf = load_hf(self.model_dir)
        return self._hf

    def triton(self, c: int) -> LoadResult:
        r = self.server.run(MAIN_MODEL, throughput_requests(self.s, c), c)
        self.triton_runs.setdefault(c, []).append(r)
        return r

    def inproc(self, c: int):
        prompts = [p for p, _ in throughput_requests(self.s, c)]
        r = run_engine(self.engine(), prompts, {**GREEDY, "max_tokens": self.s.max_tokens}, c)
        self.inproc_runs.setdefault(c, []).append(r)
        return r

    def plot(self, fig, name: str) -> str:
        path = self.out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        import matplotlib.pyplot as plt

        plt.close(fig)
        self.plots.append(name)
        return name

    # ---- 0: ceilings
    def ceilings(self) -> dict:
        log("measuring the machine's ceilings")
        c = measure_ceilings(seconds=0.5 if self.s.quick else 2.0)
        self.results["ceilings"] = c
        return c

    # ---- 1
    def section1(self) -> list[str]:
        s = self.s
        model, tok = self.hf()
        rows, data, bounds = [], {}, []
        for repeat in s.seed_repeats:
            requests = seed_requests(s) * repeat
            label = f"{len(requests)} requests" + (f" (the queue x {repeat})" if repeat > 1 else "")
            log(f"1: {label}: static batching, HF generate, batches of {SEED_BATCH_SIZE}")
            static = run_hf_static(model, tok, requests, SEED_BATCH_SIZE)
            log(f"1: static {static['wall_s']:.1f} s; our engine through Triton, max_num_seqs 8, 8 in flight")
            ours = self.server.run(SEED_MODEL, requests, SEED_BATCH_SIZE)
            useful = static["useful_tokens"]
            if ours.output_tokens != useful:
                raise RuntimeError(f"our engine produced {ours.output_tokens} tokens, expected {useful}")
            ratio = static["wall_s"] / ours.wall_s
            sim = _continuous_schedule_steps([m for _, m in requests], SEED_BATCH_SIZE)
            data[repeat] = {
                "requests": len(requests), "useful_tokens": useful, "static": static, "ours": _load_summary(ours),
                "speedup": ratio, "schedule_only_bound": static["steps"] / sim, "continuous_steps": sim,
            }
            rows += [
                f"| {label} | static batching, HF `generate` | {static['wall_s']:.2f} | "
                f"{useful / static['wall_s']:.1f} | {static['generated_tokens']} | {static['steps']} | 1.00x |",
                f"| {label} | our engine through Triton | {ours.wall_s:.2f} | {useful / ours.wall_s:.1f} | "
                f"{ours.output_tokens} | {sim} (ideal) | **{ratio:.2f}x** ({'met' if ratio >= 3 else 'NOT met'}) |",
            ]
            bounds.append(f"{label}: {static['steps']} / {sim} = {static['steps'] / sim:.2f}x")
        self.results["sections"]["1"] = {"runs": data, "seed_speedup": SEED_SPEEDUP, "target": 3.0}
        scaled = "" if s.seed_token_scale == 1 else f", max_tokens x {s.seed_token_scale:g} (quick)"
        requests = seed_requests(s)
        longest = max(m for _, m in requests)
        lines = [
            f"The seed's {len(requests)} prompts with their max_tokens{scaled}, in the seed's order, batch size "
            f"{SEED_BATCH_SIZE}, greedy, fp32; each request generates exactly its max_tokens (useful tokens). Static: "
            "padded batches of 8 in queue order (left padding), each run to its longest request's max_tokens. "
            "Ours: the live server (`llm_seq8`: max_num_seqs 8) with 8 gRPC streams, each sending the next "
            "request of the queue when its last one ends. The seed's logs show 8 static batches and 64 "
            "completions, i.e. it ran the queue twice: the `x 2` row is the seed's own measurement.",
            "",
            "| workload | path | wall s | useful output tok/s | generated tokens | decode steps | "
            "speed-up (target >= 3x) |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"The seed saw {SEED_SPEEDUP:.2f}x. Scheduling alone bounds the gain: with a step cost that does not "
            "depend on the batch size, the speed-up would be static batch steps / steps of a perfect 8-slot FIFO "
            f"continuous schedule ({'; '.join(bounds)}); anything above that comes from cheaper steps (no padding, "
            "smaller batches in the tail, less per-step overhead than `generate`)."
            + (f" The longest request ({longest} tokens) is the last of the queue: it alone decodes for "
               f"{longest} steps after it starts, at batch 1 for most of them." if requests[-1][1] == longest else ""),
        ]
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 1.6 + 1.1 * len(data)))
        names, values, colors, labels = [], [], [], []
        for repeat, d in data.items():
            for path, wall, color in (("static (HF generate)", d["static"]["wall_s"], "#999999"),
                                      ("our engine (Triton)", d["ours"]["wall_s"], "#2a7ab0")):
                names.append(f"{d['requests']} req: {path}")
                values.append(wall)
                colors.append(color)
                labels.append(f"{wall:.1f} s" + (f" ({d['speedup']:.2f}x)" if color != "#999999" else ""))
        bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
        ax.bar_label(bars, labels=labels[::-1], padding=3)
        ax.set_xlabel("wall time, s (lower is better)")
        ax.set_title(f"Seed workload, batch 8 (the seed saw {SEED_SPEEDUP:.2f}x; target 3x)")
        ax.set_xlim(0, max(values) * 1.35)
        lines += ["", f"![section 1]({self.plot(fig, 'seed_static_vs_continuous.png')})"]
        return lines

    # ---- 2
    def section2(self) -> list[str]:
        s = self.s
        model, tok = self.hf()
        max_prompt = max(len(tok(p).input_ids) for p in PROMPTS)
        log("2: transformers continuous batching")
        hf = HFContinuous(model, tok, max_prompt, s.max_tokens)
        rows, data = [], {}
        try:
            for c in s.concurrency:
                requests = throughput_requests(s, c)
                log(f"2: {c} streams, {len(requests)} requests x {s.max_tokens} tokens: transformers CB")
                theirs = hf.run(requests, c)
                log(f"2: {c} streams: our engine through Triton")
                ours = self.triton(c)
                data[c] = {"ours": _load_summary(ours), "transformers_cb": _load_summary(theirs)}
                rows.append(
                    f"| {c} | {len(requests)} | {ours.tokens_per_s:.1f} | {theirs.tokens_per_s:.1f} | "
                    f"**{ours.tokens_per_s / theirs.tokens_per_s:.2f}x** | {_ms(percentile(ours.ttft_s, 50))} / "
                    f"{_ms(percentile(theirs.ttft_s, 50))} | {_ms(percentile(ours.itl_s, 50))} / "
                    f"{_ms(percentile(theirs.itl_s, 50))} |"
                )
        finally:
            hf.close()
        self.results["sections"]["2"] = data
        lines = [
            f"Prompts: benchmarks/common.py PROMPTS (8, cycled); every request {s.max_tokens} output tokens "
            "(ignore_eos; eos_token_id=-1 for transformers), greedy, fp32. transformers: "
            "`model.init_continuous_batching()` (ContinuousBatchingManager, sdpa attention, max_requests_per_batch "
            "32, max_batch_tokens 512: the same limits as our engine), fed from the same process with at most N "
            "requests in flight. Ours: gRPC streaming clients through tritonserver.",
            "",
            "| streams | requests | ours tok/s | transformers CB tok/s | ours / theirs | TTFT p50 ms (ours / theirs) "
            "| ITL p50 ms (ours / theirs) |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.4))
        _paired_bars(ax, s.concurrency, "Throughput, same model / prompts / dtype, greedy",
                     ("our engine (Triton)", "#2a7ab0", [data[c]["ours"]["tokens_per_s"] for c in s.concurrency]),
                     ("transformers CB", "#e08a2c",
                      [data[c]["transformers_cb"]["tokens_per_s"] for c in s.concurrency]))
        lines += ["", f"![section 2]({self.plot(fig, 'throughput_vs_transformers_cb.png')})"]
        return lines

    # ---- 3
    def section3(self) -> list[str]:
        s = self.s
        self.engine()
        for _ in range(s.repeats):  # interleaved, so drift hits both paths alike
            for c in s.concurrency:
                log(f"3: {c} streams: in-process engine")
                self.inproc(c)
                if len(self.triton_runs.get(c, [])) < s.repeats:
                    log(f"3: {c} streams: through Triton")
                    self.triton(c)
        rows, data = [], {}
        for c in s.concurrency:
            inproc = statistics.median(r.tokens_per_s for r in self.inproc_runs[c])
            triton = statistics.median(r.tokens_per_s for r in self.triton_runs[c])
            overhead = inproc / triton - 1
            ttft_in = statistics.median(percentile(r.ttft_s, 50) for r in self.inproc_runs[c])
            ttft_tr = statistics.median(percentile(r.ttft_s, 50) for r in self.triton_runs[c])
            data[c] = {"in_process_tok_s": inproc, "triton_tok_s": triton, "overhead": overhead,
                       "runs": len(self.inproc_runs[c]), "ttft_p50_in_process_s": ttft_in,
                       "ttft_p50_triton_s": ttft_tr}
            verdict = "met" if overhead <= 0.10 else "NOT met"
            rows.append(f"| {c} | {inproc:.1f} | {triton:.1f} | **{overhead * 100:+.1f} %** ({verdict}) | "
                        f"{_ms(ttft_in)} | {_ms(ttft_tr)} |")
        self.results["sections"]["3"] = data
        lines = [
            f"The workloads of section 2 ({s.max_tokens} tokens per request), our engine with the same parameters "
            "(model_repository/llm/config.pbtxt, same thread count) driven in-process by benchmarks/common.py "
            f"`run_engine`, against through tritonserver with gRPC streaming clients. Medians of "
            f"{s.repeats} interleaved run(s) per path. Overhead = in-process tok/s / Triton tok/s - 1 "
            "(target <= 10 %). The Triton side includes the client threads, which share the machine's cores.",
            "",
            "| streams | in-process tok/s | through Triton tok/s | Triton overhead | TTFT p50 ms in-process | "
            "TTFT p50 ms Triton |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        _paired_bars(ax, s.concurrency, "Triton path overhead",
                     ("in-process engine", "#6aa84f", [data[c]["in_process_tok_s"] for c in s.concurrency]),
                     ("through Triton", "#2a7ab0", [data[c]["triton_tok_s"] for c in s.concurrency]))
        for x, c in enumerate(s.concurrency):
            ax.annotate(f"{data[c]['overhead'] * 100:+.1f} %", (x + 0.2, data[c]["triton_tok_s"]),
                        ha="center", va="bottom", fontsize=8)
        lines += ["", f"![section 3]({self.plot(fig, 'triton_overhead.png')})"]
        return lines

    # ---- 4
    def section4(self) -> list[str]:
        s = self.s
        ceil = self.results["ceilings"]
        engine = self.engine()
        params = {id(p): p for p in engine.runner.model.parameters()}.values()  # tied weights once
        n_params = sum(p.numel() for p in params)
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        bw = ceil["mem_read_gbs"] * 1e9
        flops = ceil["matmul_fp32_gflops"] * 1e9
        rows, data = [], {}
        for batch in (1, s.roofline_batch):
            log(f"4: decode rate at batch {batch}")
            step_s, rate = decode_rate(engine, batch, s.decode_steps)
            linear_s = linear_layers_time(engine.runner.model, batch)
            mem_ceiling = batch * bw / weight_bytes  # weights read once per step
            compute_ceiling = flops / (2 * n_params)
            bound, ceiling = ("memory", mem_ceiling) if mem_ceiling < compute_ceiling else ("compute", compute_ceiling)
            data[batch] = {"decode_tok_s": rate, "step_ms": step_s * 1e3, "memory_ceiling_tok_s": mem_ceiling,
                           "compute_ceiling_tok_s": compute_ceiling, "bound": bound, "fraction": rate / ceiling,
                           "linear_only_ms": linear_s * 1e3, "linear_only_tok_s": batch / linear_s}
            rows.append(f"| {batch} | {rate:.1f} | {step_s * 1e3:.1f} | {mem_ceiling:.1f} | {compute_ceiling:.1f} | "
                        f"{bound} | **{rate / ceiling * 100:.0f} %** | {linear_s * 1e3:.1f} ms = "
                        f"{batch / linear_s:.1f} tok/s ({linear_s / step_s * 100:.0f} % of the step) |")
        lines = [
            f"Model: {n_params / 1e6:.1f} M parameters, {weight_bytes / 2**20:.0f} MiB of fp32 weights (tied "
            f"embedding counted once). Ceilings measured above: memory read {ceil['mem_read_gbs']:.1f} GB/s, "
            f"fp32 matmul {ceil['matmul_fp32_gflops']:.1f} GFLOP/s. Memory ceiling = batch x bandwidth / weight "
            "bytes (every step reads all weights once); compute ceiling = FLOP/s / (2 x parameters) per token. "
            "Decode rate: the in-process engine, every sequence decoding (prompt already in), greedy, median "
            f"step time over {s.decode_steps} steps. Linear layers alone: the model's own weights multiplied "
            "by a [batch, hidden] input with `F.linear`, layer after layer, nothing else (what this torch's BLAS "
            "gives at the model's shapes: the floor of a step without custom kernels).",
            "",
            "| batch | decode tok/s | step ms | memory ceiling tok/s | compute ceiling tok/s | binding | "
            "share of the binding ceiling | linear layers alone |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
        profiles = {}
        for batch in (1, s.roofline_batch):
            log(f"4: profiling decode steps at batch {batch}")
            profiles[batch] = profile_decode(engine, batch, s.profile_steps)
        self.results["sections"]["4"] = {"parameters": n_params, "weight_bytes": weight_bytes, "decode": data,
                                         "profile": profiles}
        lines += ["", f"Where a decode step's time goes (torch.profiler over {s.profile_steps} steps; self time "
                      "of the ops and of the Python between them, per step; the profiler itself adds some "
                      "overhead, so read the shares, not the absolute times):", "",
                  "| part of the step | " + " | ".join(f"batch {b}: ms / share" for b in profiles) + " |",
                  "|---|" + "---|" * len(profiles)]
        cats = list(dict.fromkeys(k for p in profiles.values() for k in p["categories"]))
        for cat in cats:
            cells = []
            for p in profiles.values():
                ms = p["categories"].get(cat, 0.0)
                cells.append(f"{ms:.2f} / {ms / p['step_ms'] * 100:.0f} %")
            lines.append(f"| {cat} | " + " | ".join(cells) + " |")
        lines.append("| **step (profiled)** | " + " | ".join(f"{p['step_ms']:.2f} / 100 %" for p in profiles.values())
                     + " |")
        lines += ["", _profile_summary(data, profiles)]
        import matplotlib.pyplot as plt

        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        intensity = [0.1 * 2 ** (k / 4) for k in range(0, 45)]  # FLOP per byte, 0.1 to ~240
        ax.loglog(intensity, [min(flops, bw * i) / 1e9 for i in intensity], color="k", label="roofline (measured)")
        for batch, d in data.items():
            ai = 2 * n_params * batch / weight_bytes
            ax.loglog([ai], [d["decode_tok_s"] * 2 * n_params / 1e9], "o", markersize=8,
                      label=f"batch {batch}: {d['decode_tok_s']:.0f} tok/s ({d['fraction'] * 100:.0f} %)")
        ax.set_xlabel("arithmetic intensity, FLOP / weight byte")
        ax.set_ylabel("GFLOP/s")
        ax.set_title("Decode against the measured roofline")
        ax.legend(fontsize=8)
        names = cats
        bottom = [0.0] * len(profiles)
        for cat in names:
            vals = [p["categories"].get(cat, 0.0) / p["step_ms"] * 100 for p in profiles.values()]
            ax2.bar([f"batch {b}" for b in profiles], vals, bottom=bottom, label=cat)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax2.set_ylabel("% of the decode step")
        ax2.set_title("Decode step breakdown (torch.profiler)")
        ax2.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        lines += ["", f"![section 4]({self.plot(fig, 'roofline.png')})"]
        return lines

    # ---- 5
    def section5(self) -> list[str]:
        s = self.s
        rows, data = [], {}
        for c in s.load_levels:
            requests = throughput_requests(s, c, load=True)
            log(f"5: {c} streams, {len(requests)} requests")
            r = self.server.run(MAIN_MODEL, requests, c)
            d = _load_summary(r)
            data[c] = d
            rows.append(f"| {c} | {len(requests)} | {d['tokens_per_s']:.1f} | {d['requests_per_s']:.2f} | "
                        f"{_ms(d['ttft_p50_s'])} | {_ms(d['ttft_p99_s'])} | {_ms(d['itl_p50_s'])} | "
                        f"{_ms(d['itl_p99_s'])} | {_ms(d['e2e_p50_s'])} |")
        self.results["sections"]["5"] = data
        max_seqs = int(engine_parameters(s.threads).get("max_num_seqs", 32))
        best = max(data, key=lambda c: data[c]["tokens_per_s"])
        lines = [
            f"Our engine through Triton (`llm`, max_num_seqs {max_seqs}), gRPC streaming clients, each stream "
            f"sending its next request as soon as the last one ended; {s.max_tokens} output tokens per request, "
            "prompts from benchmarks/common.py. ITL per GenAI-Perf: the gap between two responses divided by "
            "the tokens in the later one. Percentiles over every request (TTFT) or gap (ITL) of the level.",
            "",
            "| streams | requests | output tok/s | requests/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
            "| e2e p50 ms |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Peak throughput {data[best]['tokens_per_s']:.1f} tok/s at {best} streams."
            + (f" Past {max_seqs} streams (max_num_seqs) the extra requests wait in the queue: TTFT grows with "
               "the wait while throughput can grow no further." if max(data) > max_seqs else ""),
        ]
        import matplotlib.pyplot as plt

        xs = list(data)
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        axes[0].plot(xs, [data[c]["tokens_per_s"] for c in xs], "o-", color="#2a7ab0")
        axes[0].set_ylabel("output tokens/s")
        axes[0].set_title("Throughput")
        for key, label, ax in (("ttft", "TTFT", axes[1]), ("itl", "ITL", axes[2])):
            ax.plot(xs, [data[c][f"{key}_p50_s"] * 1e3 for c in xs], "o-", label="p50")
            ax.plot(xs, [data[c][f"{key}_p99_s"] * 1e3 for c in xs], "s--", label="p99")
            ax.set_ylabel("ms")
            ax.set_yscale("log")
            ax.set_title(label)
            ax.legend()
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(c) for c in xs])
            ax.set_xlabel("concurrent streams")
            if min(xs) <= max_seqs <= max(xs):
                ax.axvline(max_seqs, color="#bbbbbb", linestyle=":", linewidth=1, label="max_num_seqs")
        lines += ["", f"![section 5]({self.plot(fig, 'load_curve.png')})"]
        return lines


# ----------------------------------------------------------------------------------------- section 4 helpers


def _decode_setup(engine, batch: int, steps: int) -> list[str]:
    """Add `batch` greedy requests of steps + 1 tokens and run until each has its first token (prefill done)."""
    from backend import SamplingParams

    ids = []
    for i in range(batch):
        rid = f"decode-{time.perf_counter_ns()}-{i}"
        params = SamplingParams.from_dict({**GREEDY, "max_tokens": steps + 1})
        engine.add_request(engine.build_request(rid, PROMPTS[i % len(PROMPTS)], params, stream=True))
        ids.append(rid)
    started: set[str] = set()
    while len(started) < batch:
        for out in engine.step():
            if any(s.token_ids for s in out.samples):
                started.add(out.request_id)
    return ids


def linear_layers_time(model, batch: int, repeats: int = 5) -> float:
    """Median seconds of one pass of F.linear over every nn.Linear of the model (lm_head included) at `batch`
    rows: the matmul work of one decode step with nothing around it."""
    import torch.nn.functional as F

    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {}
    for m in layers:
        inputs.setdefault(m.in_features, torch.randn(batch, m.in_features, dtype=m.weight.dtype))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            for m in layers:
                F.linear(inputs[m.in_features], m.weight, m.bias)
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def decode_rate(engine, batch: int, steps: int) -> tuple[float, float]:
    """(median decode step seconds, decode tokens/s) with `batch` sequences decoding."""
    _decode_setup(engine, batch, steps)
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


_LABELS = {
    "llm.step": "engine step: the rest (input tensors, Python)",
    "llm.scheduler": "scheduler",
    "llm.forward": "model forward",
    "llm.metadata": "attention metadata (slots, block tables, masks)",
    "llm.attention": "attention (KV write, block gather, SDPA)",
    "llm.sampling": "sampling",
    "llm.append": "detokenize + stop checks",
    "llm.collect": "outputs",
}
_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"}


def profile_decode(engine, batch: int, steps: int) -> dict:
    """torch.profiler over `steps` decode steps at `batch`, each op's self time filed under the nearest
    enclosing part of the step (ranges added around the engine's functions for this run only)."""
    import backend.model_runner as model_runner
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import AttentionInterface

    from backend.paged_attention import ATTENTION_NAME, paged_attention_forward

    def wrap(label, fn):
        def wrapped(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        return wrapped

    model = engine.runner.model
    patches = [
        (engine, "step", engine.step), (engine.scheduler, "schedule", engine.scheduler.schedule),
        (model, "forward", model.forward), (engine.sampler, "sample", engine.sampler.sample),
        (engine, "_append_token", engine._append_token), (engine, "_collect", engine._collect),
        (model_runner, "build_metadata", model_runner.build_metadata),
    ]
    labels = ["llm.step", "llm.scheduler", "llm.forward", "llm.sampling", "llm.append", "llm.collect", "llm.metadata"]
    _decode_setup(engine, batch, steps + 1)
    for (obj, name, fn), label in zip(patches, labels):
        setattr(obj, name, wrap(label, fn))
    AttentionInterface.register(ATTENTION_NAME, wrap("llm.attention", paged_attention_forward))
    try:
        engine.step()  # one decode step unprofiled (warm)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
        while engine.has_work():
            engine.step()
    finally:
        for obj, name, fn in patches:
            if obj is model_runner:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)  # back to the class's method
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    totals: dict[str, float] = {}
    step_us = 0.0
    for e in prof.events():
        label = e.name if e.name in _LABELS else None
        parent = e.cpu_parent
        while label is None and parent is not None:
            if parent.name in _LABELS:
                label = parent.name
            parent = parent.cpu_parent
        if label is None:
            continue
        if e.name == "llm.step":
            step_us += e.cpu_time_total
        if label == "llm.forward" and e.name in _MATMULS:
            cat = "matmuls (linear layers, lm_head)"
        elif label == "llm.forward" and e.name == "llm.forward":
            cat = "model forward: Python (HF modules)"
        elif label == "llm.forward":
            cat = "model forward: other ops (norms, RoPE, activations, embedding)"
        else:
            cat = _LABELS[label]
        totals[cat] = totals.get(cat, 0.0) + e.self_cpu_time_total
    order = ["matmuls (linear layers, lm_head)", "attention (KV write, block gather, SDPA)",
             "model forward: other ops (norms, RoPE, activations, embedding)", "model forward: Python (HF modules)",
             "attention metadata (slots, block tables, masks)", "sampling", "detokenize + stop checks",
             "scheduler", "outputs", "engine step: the rest (input tensors, Python)"]
    categories = {k: totals[k] / steps / 1e3 for k in order if k in totals}
    categories.update({k: v / steps / 1e3 for k, v in totals.items() if k not in categories})
    return {"step_ms": step_us / steps / 1e3, "categories": categories}


def _profile_summary(data: dict, profiles: dict) -> str:
    parts = []
    for batch, d in data.items():
        p = profiles[batch]
        cats = sorted(p["categories"].items(), key=lambda kv: -kv[1])
        top = ", ".join(f"{k} {v / p['step_ms'] * 100:.0f} %" for k, v in cats[:3])
        matmul = p["categories"].get("matmuls (linear layers, lm_head)", 0.0) / p["step_ms"]
        linear = d["linear_only_ms"] / d["step_ms"]
        parts.append(
            f"Batch {batch} reaches {d['fraction'] * 100:.0f} % of its {d['bound']} ceiling; the step is "
            f"{matmul * 100:.0f} % matmuls, the largest parts being {top}. The model's linear layers alone, "
            f"with nothing around them, take {linear * 100:.0f} % of the step's time: "
            + ("most of the gap to the ceiling is the BLAS at these shapes (fp32 GEMV / small-M GEMM), not the "
               "engine around it." if linear >= 0.6 else "the engine around the matmuls (attention, Python) is a "
               "large part of the gap.")
        )
    return " ".join(parts)


# --------------------------------------------------------------------------------------------------- helpers


def _paired_bars(ax, concurrency, title: str, left: tuple, right: tuple) -> None:
    """Two bars (label, color, values) per concurrency level, output tokens/s."""
    xs = list(range(len(concurrency)))
    for offset, (label, color, values) in ((-0.2, left), (0.2, right)):
        ax.bar([x + offset for x in xs], values, 0.4, label=label, color=color)
    ax.set_xticks(xs, [str(c) for c in concurrency])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.legend()


def _ms(seconds: float) -> str:
    return "n/a" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.0f}" if seconds >= 0.1 \
        else f"{seconds * 1e3:.1f}"


def _load_summary(r: LoadResult) -> dict:
    return {
        "wall_s": r.wall_s, "requests": r.num_requests, "output_tokens": r.output_tokens,
        "tokens_per_s": r.tokens_per_s, "requests_per_s": r.requests_per_s,
        "ttft_p50_s": percentile(r.ttft_s, 50), "ttft_p99_s": percentile(r.ttft_s, 99),
        "itl_p50_s": percentile(r.itl_s, 50), "itl_p99_s": percentile(r.itl_s, 99),
        "e2e_p50_s": percentile(r.e2e_s, 50), "e2e_p99_s": percentile(r.e2e_s, 99),
    }


def _continuous_schedule_steps(max_tokens: list[int], slots: int) -> int:
    """Steps of an ideal FIFO continuous schedule with `slots` sequences (one token per sequence per step)."""
    import heapq

    free = [0] * slots
    for m in max_tokens:
        heapq.heappush(free, heapq.heappop(free) + m)
    return max(free)


def write_report(bench: Bench, info: dict, ceilings: dict | None, sections: dict[int, list[str]],
                 errors: dict[int, str], elapsed: float) -> Path:
    s = bench.s
    params = engine_parameters(s.threads)
    lines = [
        "# Benchmark report" + (" (QUICK smoke run: not a measurement)" if s.quick else ""),
        "",
        f"Generated by `python benchmarks/bench.py {' '.join(sys.argv[1:])}` on {info['date']} in "
        f"{elapsed / 60:.1f} min.",
        "",
        "## Machine and settings",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {info['host_cpu']}, {info['logical_cpus']} logical CPUs, {info['memory_gib']} GiB RAM |",
        f"| torch threads | {s.threads} (the in-process runs and the server's `num_threads`) |",
        f"| load average (1, 5, 15 min) | start {info['load_average_start']}, end {info['load_average_end']} |",
        f"| software | Python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
        f"{info['platform']} |",
        f"| model | {Path(bench.model_dir).name} ({os.path.relpath(bench.model_dir, REPO_ROOT)}) |",
        "| dtype | float32 everywhere; greedy; every request generates exactly its max_tokens |",
        f"| engine | model_repository/llm/config.pbtxt: max_num_seqs {params.get('max_num_seqs')}, "
        f"max_num_batched_tokens {params.get('max_num_batched_tokens')}, block_size {params.get('block_size')}, "
        f"kv_cache_memory_bytes {params.get('kv_cache_memory_bytes')}, prefix caching "
        f"{params.get('enable_prefix_caching')}; section 1 uses a copy with max_num_seqs 8 |",
        f"| workloads | max_tokens {s.max_tokens} (sections 2, 3, 5), streams {s.concurrency} (2, 3), "
        f"requests per level max({s.min_requests}, {s.requests_per_stream:g} x streams); load levels "
        f"{s.load_levels} (5), requests per level max({s.load_min_requests}, {s.load_requests_per_stream:g} x "
        f"streams); section 3 repeats {s.repeats}; section 1 queue repeats {s.seed_repeats} |",
        "",
        "Medians throughout; every ratio compares numbers measured in this run.",
        "",
    ]
    if ceilings:
        lines += [
            "## The machine's ceilings (measured in this run)",
            "",
            "| fp32 matmul GFLOP/s | bf16 matmul GFLOP/s | memory read GB/s |",
            "|---|---|---|",
            f"| {ceilings['matmul_fp32_gflops']:.1f} | {ceilings['matmul_bf16_gflops']:.1f} | "
            f"{ceilings['mem_read_gbs']:.1f} |",
            "",
            f"({s.threads} thread(s); 1024 x 1024 matmuls; summing a 256 MiB fp32 tensor.)",
            "",
        ]
    for n in sorted(set(sections) | set(errors)):
        lines += [f"## {n}. {SECTIONS[n]}", ""]
        if n in errors:
            lines += ["**FAILED**:", "", "```", errors[n].rstrip(), "```", ""]
        else:
            lines += sections[n] + [""]
    lines += [
        "## Notes",
        "",
        "- Seed workload: the 32 (prompt, max_tokens) pairs and batch size 8 are listed in full in the seed "
        "(section 8, `request_queue`) and copied verbatim into benchmarks/common.py SEED_WORKLOAD. The seed's "
        f"speed-up is its logged durations 88.22 s / 52.36 s = {SEED_SPEEDUP:.2f}x (quoted as 1.69x in the issue; "
        "its logs show 8 static batches and 64 completions, so it ran the queue twice: section 1 runs the 32 as "
        "listed and, by default, the queue twice). The seed's own static loop has a bug "
        "(`[p[0] for p in prompts]`); we do what it meant: each batch's own prompts.",
        "- Section 1 static batching forces every row of a batch to the batch's longest max_tokens "
        "(`min_new_tokens`), as the seed's `generate_batch(inputs, max_tokens=max_tokens)` does; useful tokens "
        "are the requested ones.",
        "- The client threads of the Triton runs share the machine's cores with the server.",
        "- llama.cpp (optional section 6) is not compared in this report.",
        "",
    ]
    path = bench.out / "README.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="",
                    help="results folder (default benchmarks/results; with --quick, benchmarks/results/quick)")
    ap.add_argument("--only", default="", help="sections to run, e.g. 1,2 (default: all)")
    ap.add_argument("--quick", action="store_true", help="smoke test: few prompts, short outputs")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for every path (default: torch's default, the number of cores)")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--max-tokens", type=int, default=0, help="output tokens per request in sections 2, 3, 5")
    ap.add_argument("--concurrency", default="", help="streams for sections 2 and 3 (default 1,8,32)")
    ap.add_argument("--load-levels", default="", help="streams for section 5 (default 1,2,4,8,16,32,64)")
    ap.add_argument("--seed-repeats", default="",
                    help="section 1: run the seed queue this many times over, e.g. 1,2 (default; the seed's logs "
                         "show it ran the queue twice)")
    ap.add_argument("--repeats", type=int, default=0, help="section 3 runs per path and level (default 2)")
    ap.add_argument("--roofline-batch", type=int, default=0, help="section 4's large batch (default 32)")
    ap.add_argument("--decode-steps", type=int, default=0, help="section 4's timed decode steps (default 16)")
    args = ap.parse_args(argv)

    only = sorted({int(x) for x in args.only.split(",") if x.strip()}) if args.only else sorted(SECTIONS)
    bad = [n for n in only if n not in SECTIONS]
    if bad:
        ap.error(f"--only: no section(s) {bad}; sections are {sorted(SECTIONS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    settings = make_settings(args)
    out = Path(args.out or REPO_ROOT / "benchmarks" / "results" / ("quick" if settings.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")

    started = time.perf_counter()
    info = machine_info(settings.threads)
    bench = Bench(args, settings, out)
    log(f"sections {only}, {settings.threads} thread(s), {'quick' if settings.quick else 'full'} run -> {out}")
    ceilings = bench.ceilings()
    log("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))
    sections: dict[int, list[str]] = {}
    errors: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="llm-bench-") as tmp:
        try:
            if set(only) & {1, 2, 3, 5}:
                try:
                    bench.server = Server(settings.threads, Path(tmp))
                except Exception:
                    errors.update({n: "tritonserver did not start:\n" + traceback.format_exc()
                                   for n in only if n in (1, 2, 3, 5)})
            for n in only:
                if n in errors:
                    continue
                log(f"section {n}: {SECTIONS[n]}")
                t = time.perf_counter()
                try:
                    sections[n] = getattr(bench, f"section{n}")()
                except Exception:
                    errors[n] = traceback.format_exc()
                    log(f"section {n} FAILED:\n{errors[n]}")
                    if bench.server is not None and bench.server.proc.poll() is not None:
                        errors[n] += "\ntritonserver log tail:\n" + bench.server.serve.log_tail(bench.server.log_path)
                log(f"section {n} done in {time.perf_counter() - t:.0f} s")
                gc.collect()
        finally:
            if bench.server is not None:
                bench.server.stop()
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    elapsed = time.perf_counter() - started
    bench.results.update({"machine": info, "errors": errors, "elapsed_s": elapsed})
    (out / "results.json").write_text(json.dumps(bench.results, indent=2, default=_json_default))
    path = write_report(bench, info, ceilings, sections, errors, elapsed)
    log(f"report: {path} ({elapsed / 60:.1f} min)")
    print(path.read_text())
    return 1 if errors else 0


def _json_default(o):
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
