"""Shared pieces of the benchmark programs: the machine's ceilings, workloads and in-process engine runs."""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works in simple terms.",
    "List five tips for writing clean Python code.",
    "What are the main causes of the French Revolution?",
    "Describe the water cycle step by step.",
    "Give me a recipe for a simple tomato soup.",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
]


def machine_description() -> str:
    return f"{platform.node() and 'CPU'} {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def median(values):
    return statistics.median(values) if values else float("nan")


@dataclass
class RunResult:
    wall_s: float
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def run_engine(engine, prompts: list[str], params: dict, concurrency: int) -> RunResult:
    """Feed `prompts` to an in-process engine keeping `concurrency` requests in flight; greedy by default."""
    from backend import SamplingParams

    pending = list(enumerate(prompts))
    in_flight = 0
    arrival, first, last = {}, {}, {}
    itl: list[float] = []
    output_tokens = 0
    start = time.perf_counter()
    while pending or engine.has_work():
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            request = engine.build_request(f"r{i}", prompt, SamplingParams.from_dict(params), stream=True)
            engine.add_request(request)
            arrival[request.request_id] = time.perf_counter()
            in_flight += 1
        for out in engine.step():
            now = time.perf_counter()
            tokens = sum(len(s.token_ids) for s in out.samples)
            if tokens:
                rid = out.request_id
                if rid not in first:
                    first[rid] = now
                else:
                    itl.append((now - last[rid]) / tokens)
                last[rid] = now
                output_tokens += tokens
            if out.finished:
                in_flight -= 1
    wall = time.perf_counter() - start
    return RunResult(wall, output_tokens, [first[r] - arrival[r] for r in first], itl)
