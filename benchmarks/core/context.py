"""`Bench`, the context each section module's `run(bench)` gets: the run's settings and output folder, the live
server (benchmarks/core/server.py), the in-process engines and Hugging Face models, the runs several sections share,
and the measurements recorded against their targets."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.core.common import PROMPTS, LoadResult, measure_ceilings, run_engine_requests
from benchmarks.core.hf_model import load_hf
from benchmarks.core.progress import log
from benchmarks.core.settings import GREEDY, Settings, throughput_requests
from benchmarks.core.targets import GOALS
from benchmarks.core.variants import MAIN_MODEL, engine_parameters

if TYPE_CHECKING:
    from benchmarks.core.server import Server


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
            log(f"loading the in-process engine ({variant})")
            self._engines[variant] = self.new_engine(self.s.engine_threads, variant)
        torch.set_num_threads(self.s.threads)  # the process is shared with the Hugging Face runs
        return self._engines[variant]

    def new_engine(self, threads: int, variant: str = MAIN_MODEL):
        """A fresh, warmed-up in-process engine of a server variant at `threads` (0: the engine's own rule)."""
        from backend import EngineConfig, LLMEngine

        params = {**engine_parameters(threads, variant), "model": self.model_dir}
        engine = LLMEngine(EngineConfig.from_parameters(params))
        run_engine_requests(engine, [(PROMPTS[0], 4)] * 2, GREEDY, 2)  # warm-up
        return engine

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
