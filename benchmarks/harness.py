"""What every comparison of the benchmark report shares: settings, the models, the targets, and `Bench`, the
context each section module's `run(bench)` gets (the live server is benchmarks/server.py, the machine
benchmarks/machine.py)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.common import (
    PROMPTS,
    SEED_WORKLOAD,
    LoadResult,
    measure_ceilings,
    run_engine_requests,
)
from launcher.model_config import read_parameters
from testkit.stats import percentile

if TYPE_CHECKING:
    from benchmarks.server import Server


GREEDY = {"temperature": 0.0, "ignore_eos": True}
MAIN_MODEL = "llm"  # the served configuration, model_repository/llm/config.pbtxt as it stands
SEED_MODEL = "llm_seq8"  # section 1: max_num_seqs 8
FP32_MODEL = "llm_fp32"  # section 2's fp32 rows
BF16_INT4_MODEL = "llm_bf16_int4"  # section 7: the bf16 + int4 path the default takes on AMX CPUs
THREADS_MODELS = {1: "llm_threads1", 2: "llm_threads2"}  # section 7: the served configuration at 1 / 2 threads
VARIANTS = {
    MAIN_MODEL: {},
    SEED_MODEL: {"max_num_seqs": "8"},
    FP32_MODEL: {"dtype": "float32", "quantization": "none"},
    BF16_INT4_MODEL: {"dtype": "bfloat16", "quantization": "int4"},
    **{name: {"num_threads": str(n)} for n, name in THREADS_MODELS.items()},
}


# ------------------------------------------------------------------------------------------------ settings


@dataclass
class Settings:
    threads: int  # our engine's torch threads (in process and in the server): its serving default
    engine_threads: int  # what the engine is configured with (`num_threads`): 0, its own per-step rule, unless
    # --threads fixes it
    peer_threads: int  # Hugging Face's and llama.cpp's: each peer at its own best, every core
    max_tokens: int  # sections 2, 3, 5, 6
    concurrency: list[int]  # sections 2, 3, 6
    load_levels: list[int]  # section 5
    requests_per_stream: float  # sections 2, 3, 6: a level sends max(min_requests, streams x this)
    load_requests_per_stream: float  # section 5: max(load_min_requests, streams x this)
    load_min_requests: int
    min_requests: int
    seed_requests: int  # section 1: the first n of the 32
    seed_token_scale: float  # section 1: max_tokens multiplied by this (quick mode shortens them)
    seed_repeats: list[int]  # section 1: the queue once (as listed), twice (as the seed's logs ran it), ...
    repeats: int  # section 3: runs per path and level (median)
    roofline_batch: int
    decode_steps: int  # section 4: timed decode steps
    profile_steps: int
    decode_tokens: int  # section 6: llama-bench -n, and our batch-1 requests' length
    decode_requests: int  # section 6: our batch-1 requests through Triton
    llama_bench_repetitions: int
    quick: bool


def make_settings(args) -> Settings:
    if args.quick:
        s = Settings(
            threads=args.threads,
            engine_threads=args.engine_threads,
            peer_threads=args.peer_threads,
            max_tokens=8,
            concurrency=[1, 4],
            load_levels=[1, 2, 4],
            requests_per_stream=2,
            load_requests_per_stream=2,
            load_min_requests=2,
            min_requests=2,
            seed_requests=16,
            seed_token_scale=1 / 16,
            seed_repeats=[1],
            repeats=1,
            roofline_batch=8,
            decode_steps=4,
            profile_steps=2,
            decode_tokens=16,
            decode_requests=1,
            llama_bench_repetitions=1,
            quick=True,
        )
    else:
        s = Settings(
            threads=args.threads,
            engine_threads=args.engine_threads,
            peer_threads=args.peer_threads,
            max_tokens=64,
            concurrency=[1, 8, 32],
            load_levels=[1, 2, 4, 8, 16, 32, 64],
            requests_per_stream=2,
            load_requests_per_stream=1.5,
            load_min_requests=8,
            min_requests=4,
            seed_requests=32,
            seed_token_scale=1.0,
            seed_repeats=[1, 2],
            repeats=2,
            roofline_batch=32,
            decode_steps=16,
            profile_steps=4,
            decode_tokens=128,
            decode_requests=3,
            llama_bench_repetitions=5,
            quick=False,
        )
    for name in ("max_tokens", "repeats", "roofline_batch", "decode_steps"):
        if getattr(args, name, None):
            setattr(s, name, getattr(args, name))
    for name in ("concurrency", "load_levels", "seed_repeats"):
        if getattr(args, name, None):
            setattr(s, name, ints(getattr(args, name)))
    return s


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def throughput_requests(s: Settings, concurrency: int, load: bool = False) -> list[tuple[str, int]]:
    """The (prompt, max_tokens) requests of one concurrency level: PROMPTS cycled, each s.max_tokens long."""
    if load:
        n = max(s.load_min_requests, round(concurrency * s.load_requests_per_stream))
    else:
        n = max(s.min_requests, round(concurrency * s.requests_per_stream))
    return [(PROMPTS[i % len(PROMPTS)], s.max_tokens) for i in range(n)]


def seed_requests(s: Settings) -> list[tuple[str, int]]:
    return [(p, max(2, round(m * s.seed_token_scale))) for p, m in SEED_WORKLOAD[: s.seed_requests]]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ targets


@dataclass(frozen=True)
class Goal:
    """A target of the issue: `value` (a ratio, or a share for percent goals) against `threshold`."""

    section: int
    what: str
    threshold: float
    at_most: bool = False
    percent: bool = False
    bound: str = ""  # which table of the report shows what bounds it (a key of Bench.bounds)

    def met(self, value: float) -> bool:
        return value <= self.threshold if self.at_most else value >= self.threshold

    def show(self, value: float) -> str:
        return f"{value * 100:+.1f} %" if self.at_most else f"{value * 100:.0f} %" if self.percent else f"{value:.2f}x"

    @property
    def text(self) -> str:
        amount = f"{self.threshold * 100:g} %" if self.percent else f"{self.threshold:g}x"
        return ("<= " if self.at_most else ">= ") + amount


DECODE_PROFILE = "Decode step profile (section 4)"
TRITON_STEPS = "Engine steps in-process vs through Triton (section 3)"
# The targets of the speed issue of 2026-11-25 (faster than llama.cpp at every batch size); the report of
# 2026-11-26 05:14 UTC still judged against the earlier ones (P8 0.5x, P9 1x, P2 2x, P5 50 %, P6 40 %, P7 10 %).
GOALS = {
    "P2": Goal(2, "output tok/s, ours through Triton / transformers continuous batching", 3.0, bound=DECODE_PROFILE),
    "P7": Goal(
        3,
        "Triton path overhead (in-process tok/s / Triton tok/s - 1)",
        0.05,
        at_most=True,
        percent=True,
        bound=TRITON_STEPS,
    ),
    "P8": Goal(6, "batch-1 decode tok/s, ours through Triton / llama-bench", 1.3, bound=DECODE_PROFILE),
    "P1": Goal(
        1, "seed workload wall time, static HF generate / ours (the queue run twice)", 2.5, bound=DECODE_PROFILE
    ),
    "P5": Goal(
        4, "batch-1 decode, share of the memory ceiling (bytes read per step)", 0.6, percent=True, bound=DECODE_PROFILE
    ),
    "P6": Goal(4, "large-batch decode, share of the compute ceiling", 0.5, percent=True, bound=DECODE_PROFILE),
    "P9": Goal(6, "output tok/s at 32 streams, ours through Triton / llama-server", 1.5, bound=DECODE_PROFILE),
}
SUMMARY_ORDER = ("P2", "P7", "P8", "P1", "P5", "P6", "P9")


def engine_parameters(threads: int, variant: str = MAIN_MODEL) -> dict[str, str]:
    """A server variant's parameters: what an in-process engine uses to run the same configuration."""
    return {**read_parameters(), "num_threads": str(threads), **VARIANTS[variant]}


def resolved_dtype(variant: str = MAIN_MODEL) -> str:
    """The dtype a variant runs in on this machine (`auto` resolved as the engine resolves it)."""
    from backend.model.hardware import resolve_for_model

    params = engine_parameters(0, variant)
    return resolve_for_model(
        params["model"], params.get("dtype", "auto"), params.get("quantization", "auto"), params.get("device", "cpu")
    )[0]


# ------------------------------------------------------------------------------------------------ the context


def load_hf(model_dir: str, dtype: torch.dtype):
    """(model, tokenizer) of Hugging Face transformers, sdpa attention, in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()
    return model, tok


class Bench:
    """The shared state of one run: settings, output folder, the server, the in-process engines and Hugging
    Face models (loaded once, on first use), measured runs that several sections share, targets, results."""

    def __init__(self, args, settings: Settings, out: Path):
        self.args, self.s, self.out = args, settings, out
        self.workdir = out  # where server logs go; bench.py points it at the run's temporary folder
        self.model_dir = str(Path(args.model).resolve())
        self.results: dict = {"settings": asdict(settings), "sections": {}, "targets": []}
        self.server: Server | None = None
        self.plots: list[str] = []
        self.bounds: dict[str, list[str]] = {}  # a Goal.bound -> the report lines that show it
        self.profiles: dict[int, dict] = {}  # decode step profiles by batch size (decode_profile.profile_decode)
        self.triton_runs: dict[int, list[LoadResult]] = {}  # MAIN_MODEL, throughput workloads, by streams
        self.inproc_runs: dict[int, list[LoadResult]] = {}
        self._engines: dict[str, object] = {}
        self._hf: dict[torch.dtype, tuple] = {}

    def engine(self, variant: str = MAIN_MODEL):
        """The in-process engine of a server variant (the same parameters and thread count)."""
        if variant not in self._engines:
            from backend import EngineConfig, LLMEngine

            log(f"loading the in-process engine ({variant})")
            params = {**engine_parameters(self.s.engine_threads, variant), "model": self.model_dir}
            engine = LLMEngine(EngineConfig.from_parameters(params))
            run_engine_requests(engine, [(PROMPTS[0], 4)] * 2, GREEDY, 2)  # warm-up
            self._engines[variant] = engine
        torch.set_num_threads(self.s.threads)  # the process is shared with the Hugging Face runs
        return self._engines[variant]

    def hf(self, dtype: torch.dtype):
        if dtype not in self._hf:
            log(f"loading the Hugging Face model ({dtype})")
            self._hf[dtype] = load_hf(self.model_dir, dtype)
        torch.set_num_threads(self.s.peer_threads)
        return self._hf[dtype]

    def triton(self, concurrency: int) -> LoadResult:
        """The served configuration through Triton on the throughput workload of `concurrency` streams."""
        r = self.server.run(MAIN_MODEL, throughput_requests(self.s, concurrency), concurrency)
        self.triton_runs.setdefault(concurrency, []).append(r)
        return r

    def inproc(self, concurrency: int) -> LoadResult:
        """The same workload, the served configuration in-process, with the engine steps it took."""
        engine = self.engine()
        steps, history = engine.num_steps, engine.metrics.histograms["llm_step_num_sequences"]
        start = len(history)
        r = run_engine_requests(engine, throughput_requests(self.s, concurrency), GREEDY, concurrency)
        r.engine_steps, r.step_sequences = engine.num_steps - steps, sum(history[start:])
        self.inproc_runs.setdefault(concurrency, []).append(r)
        return r

    def ceilings(self) -> dict:
        log("measuring the machine's ceilings")
        self.results["ceilings"] = measure_ceilings(seconds=0.5 if self.s.quick else 2.0)
        return self.results["ceilings"]

    def target(self, goal_id: str, value: float, condition: str = "") -> str:
        """Record a measurement against its goal; returns the verdict text for the section's own table."""
        goal = GOALS[goal_id]
        met = goal.met(value)
        self.results["targets"].append(
            {
                "id": goal_id,
                "condition": condition,
                "value": value,
                "measured": goal.show(value),
                "target": goal.text,
                "met": met,
            }
        )
        return f"**{goal.show(value)}** ({'met' if met else 'NOT met'})"

    def verdict(self, goal_id: str, value: float, condition: str, counts: bool = True) -> str:
        """`target` where this measurement is the goal's (`counts`), else just the value, for a table cell."""
        return self.target(goal_id, value, condition) if counts else f"**{GOALS[goal_id].show(value)}**"

    def plot(self, fig, name: str) -> str:
        """Save a matplotlib figure into the results folder; returns the report's image line."""
        import matplotlib.pyplot as plt

        fig.tight_layout()
        fig.savefig(self.out / name, dpi=110)
        plt.close(fig)
        self.plots.append(name)
        return f"![{Path(name).stem}]({name})"


# ------------------------------------------------------------------------------------------------ formatting


def paired_bars(ax, concurrency, title: str, left: tuple, right: tuple) -> None:
    """Two bars (label, color, values) per concurrency level, output tokens/s."""
    xs = list(range(len(concurrency)))
    for offset, (label, color, values) in ((-0.2, left), (0.2, right)):
        ax.bar([x + offset for x in xs], values, 0.4, label=label, color=color)
    ax.set_xticks(xs, [str(c) for c in concurrency])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=8)


def ms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    return f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def load_summary(r: LoadResult) -> dict:
    """A run's throughput and latency percentiles, as results.json keeps them."""
    return {
        "wall_s": r.wall_s,
        "requests": r.num_requests,
        "output_tokens": r.output_tokens,
        "tokens_per_s": r.tokens_per_s,
        "requests_per_s": r.requests_per_s,
        "ttft_p50_s": percentile(r.ttft_s, 50),
        "ttft_p99_s": percentile(r.ttft_s, 99),
        "itl_p50_s": percentile(r.itl_s, 50),
        "itl_p99_s": percentile(r.itl_s, 99),
        "e2e_p50_s": percentile(r.e2e_s, 50),
        "e2e_p99_s": percentile(r.e2e_s, 99),
        "engine_steps": r.engine_steps,
        "step_sequences": r.step_sequences,
    }


def versus_row(first_cells: list, ours: LoadResult, theirs: LoadResult, verdict: str) -> str:
    """A table row comparing two runs of one workload: the first cells, ours and their tok/s, the verdict, and
    p50 TTFT and ITL as ours / theirs."""
    pairs = [
        f"{ms(percentile(getattr(ours, k), 50))} / {ms(percentile(getattr(theirs, k), 50))}"
        for k in ("ttft_s", "itl_s")
    ]
    cells = [*first_cells, f"{ours.tokens_per_s:.1f}", f"{theirs.tokens_per_s:.1f}", verdict, *pairs]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def largest(levels: list[int], wanted: int) -> int:
    """`wanted` if it is among `levels`, else the largest level (a quick run has no 32 streams)."""
    return wanted if wanted in levels else max(levels)
