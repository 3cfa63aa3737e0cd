"""The live tritonserver of a benchmark run: a temporary model repository of the run's variants at its thread
count, started through the launcher, warmed up, and closed-loop runs against it with the engine steps they took
(read from the server's metrics endpoint)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import launcher
from benchmarks.core import thread_cpu
from benchmarks.core.common import PROMPTS, LoadResult, run_triton
from benchmarks.core.progress import log
from benchmarks.core.settings import GREEDY
from benchmarks.core.variants import VARIANTS
from launcher.model_config import write_model_repository
from testkit import prometheus


class Server:
    """tritonserver (the launcher) on free loopback ports with a temporary model repository holding the
    `variants` (names of VARIANTS), each serving `model` (the run's --model) at the run's thread count, with
    `parameters` set on each; `on_start(proc)` is called once the process is started."""

    def __init__(
        self,
        threads: int,
        workdir: Path,
        variants: list[str],
        model: str,
        parameters: dict[str, str] | None = None,
        on_start=None,
    ):
        # a variant's own parameters win, then `parameters`
        overrides = {
            v: {"num_threads": str(threads), "model": model, **VARIANTS[v], **(parameters or {})} for v in variants
        }
        repository = write_model_repository(workdir / "model_repository", overrides)
        self.log_path = workdir / "tritonserver.log"
        self.ports = [launcher.free_port() for _ in range(3)]
        log(f"starting tritonserver with {variants} (gRPC {self.ports[1]}; log {self.log_path})")
        started = time.perf_counter()
        self.proc = launcher.start_server(repository, *self.ports, self.log_path)
        if on_start is not None:
            on_start(self.proc)
        try:
            launcher.wait_until_ready(self.ports[0], self.proc, timeout_s=600, metrics_port=self.ports[2])
            self.ready_s = time.perf_counter() - started  # launch to READY
            self.grpc_url = f"127.0.0.1:{self.ports[1]}"
            self.pids = thread_cpu.process_tree(self.proc.pid)  # tritonserver and its stubs
            for model in variants:  # warm-up
                run_triton(self.grpc_url, model, [(PROMPTS[0], 4)] * 2, GREEDY, 2)
        except BaseException:  # SIGTERM (bench.exit_on_sigterm) too: no server left running
            self.stop()
            raise
        log("tritonserver ready")

    def run(self, model: str, requests: list[tuple[str, int]], concurrency: int) -> LoadResult:
        """A closed-loop run, with the engine steps it took (from the server's metrics endpoint)."""
        before, cpu_before = self.engine_activity(model), thread_cpu.snapshot(self.pids)
        result = run_triton(self.grpc_url, model, requests, GREEDY, concurrency)
        result.thread_times = thread_cpu.difference(thread_cpu.snapshot(self.pids), cpu_before)
        if result.errors:
            raise RuntimeError(f"{len(result.errors)} request(s) failed through Triton: {result.errors[:3]}")
        time.sleep(0.3)  # the engine publishes its metrics every 100 ms
        after = self.engine_activity(model)
        result.engine_steps, result.step_sequences = (a - b for a, b in zip(after, before, strict=True))
        return result

    def engine_activity(self, model: str) -> tuple[float, float]:
        """(engine steps, sequences summed over them) so far for `model`; nan where the endpoint fails."""
        try:
            metrics = prometheus.scrape(f"http://127.0.0.1:{self.ports[2]}/metrics", timeout_s=5)
        except OSError:
            return math.nan, math.nan
        steps, sequences = (
            [*prometheus.samples(metrics, name, model=model), math.nan][0]
            for name in ("llm_engine_steps_total", "llm_step_num_sequences_sum")
        )
        return steps, sequences

    def log_tail(self) -> str:
        return launcher.log_tail(self.log_path)

    def stop(self) -> None:
        code = launcher.stop_server(self.proc)
        log(f"tritonserver stopped (exit code {code})")
