"""`llm-serve` (the documented launch: supervised tritonserver and the front door) as a subprocess, every endpoint on
a free port, for the tests that stop it, crash it or give it a broken model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

from launcher.paths import REPO_ROOT
from launcher.readiness import free_port, is_ready, url_ok


@dataclasses.dataclass
class Launch:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int
    output: Path  # everything llm-serve, tritonserver and the front door printed

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def tail(self, chars: int = 4000) -> str:
        return self.text()[-chars:]

    def wait_ready(self, timeout_s: float) -> float:
        """Wait until both tritonserver and the front door say ready; seconds waited. Fails with the output's tail
        if the launch exits or the time runs out."""
        started = time.monotonic()
        while not (is_ready(self.http_port) and url_ok(f"http://127.0.0.1:{self.openai_port}/health/ready")):
            assert self.proc.poll() is None, f"llm-serve exited ({self.proc.returncode}):\n{self.tail()}"
            assert time.monotonic() - started < timeout_s, f"not ready after {timeout_s} s:\n{self.tail()}"
            time.sleep(0.1)
        return time.monotonic() - started

    def wait_exit(self, timeout_s: float) -> int:
        """The launch's exit code; fails with the output's tail if it is still running after `timeout_s`."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"llm-serve still running after {timeout_s} s:\n{self.tail()}") from None


def start_launch(repository: Path, output: Path, *extra_args: str) -> Launch:
    """Start `python -m launcher.serve` over `repository`, its own process group, all four ports free."""
    http_port, grpc_port, metrics_port, openai_port = (free_port() for _ in range(4))
    with open(output, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launcher.serve",
                "--model-repository",
                str(repository),
                "--http-port",
                str(http_port),
                "--grpc-port",
                str(grpc_port),
                "--metrics-port",
                str(metrics_port),
                "--openai-port",
                str(openai_port),
                *extra_args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
    return Launch(proc, http_port, grpc_port, metrics_port, openai_port, output)
