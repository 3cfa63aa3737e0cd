"""Keeps tritonserver serving: restarts it with bounded back-off when it exits unexpectedly, when one of its
Python stub processes has died, or when a model's engine thread has died (the model's `llm_engine_alive`
gauge reads 0). Triton 2.51 offers a Python model no way to mark itself unready, and it does not restart a
decoupled model's stub: without this, requests to such a model would fail or hang until someone noticed.

Standard library only, like the rest of the launcher. While the server is down its HTTP port is closed, so
`/v2/health/ready` fails for the whole gap; it answers 200 again once the restarted server has loaded its
models. Used by `llm-serve` (launcher/serve.py, the documented launch)::

    sup = Supervisor(lambda: subprocess.Popen(argv, ...), http_port=8000, metrics_port=8002)
    sup.run()          # blocks until sup.stop() (from a signal handler or another thread)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import TextIO

_DEAD_ENGINE_RE = re.compile(r"^llm_engine_alive\{([^}]*)\}\s+0(?:\.0*)?\s*$", re.MULTILINE)


def describe_exit(code: int) -> str:
    """'exit code 1' or 'killed by signal 11 (SIGSEGV)'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-code} ({name})"
    return f"exit code {code}"


_INSTANCE_RE = re.compile(r".+_\d+_\d+$")  # <model>_<group>_<index>


def stub_processes(server_pid: int) -> dict[int, str]:
    """{pid: instance name} of the server's Python backend stubs that serve a model instance (Linux /proc;
    empty elsewhere). The short-lived stub that loads a model's config (named after the model) is left out."""
    stubs = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return stubs
    for entry in filter(str.isdigit, entries):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != server_pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode("utf-8", "replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue
        name = argv[8] if len(argv) > 8 else ""  # e.g. llm_0_0
        if argv[0].endswith("triton_python_backend_stub") and _INSTANCE_RE.match(name):
            stubs[int(entry)] = name
    return stubs


def dead_engines(metrics_text: str) -> list[str]:
    """Label sets of every `llm_engine_alive` gauge that reads 0 in a Prometheus scrape."""
    return _DEAD_ENGINE_RE.findall(metrics_text)


class Supervisor:
    """Runs the server that `start()` launches; restarts it after an unexpected exit or a dead engine.

    Back-off: `backoff_initial_s`, doubling per consecutive failure up to `backoff_max_s`; a server that ran
    `stable_after_s` without failing resets it. More than `max_restarts` consecutive failures (None: no limit;
    0: never restart) give up.
    """

    def __init__(
        self,
        start: Callable[[], subprocess.Popen],
        stop: Callable[[subprocess.Popen], int | None],
        *,
        metrics_url: str | None = None,
        health_interval_s: float = 1.0,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        stable_after_s: float = 60.0,
        max_restarts: int | None = None,
        log: TextIO = sys.stderr,
        describe: Callable[[subprocess.Popen], str] = lambda proc: "",
        on_start: Callable[[subprocess.Popen], None] = lambda proc: None,
    ):
        self._start, self._stop = start, stop
        self.metrics_url = metrics_url
        self.health_interval_s = health_interval_s
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.stable_after_s = stable_after_s
        self.max_restarts = max_restarts
        self._log_file = log
        self._describe = describe  # e.g. the server log's tail
        self._stopping = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.restarts = 0  # in total, for tests and logs
        self._on_start = on_start  # called after every (re)start, e.g. to announce readiness

    def log(self, message: str) -> None:
        print(f"[supervisor {time.strftime('%H:%M:%S')}] {message}", file=self._log_file, flush=True)

    def stop(self) -> None:
        """Ask `run()` to stop the server and return (safe from a signal handler or another thread)."""
        self._stopping.set()

    def run(self) -> int:
        """Supervise until `stop()` (which stops the server); returns 0 then, or the server's last exit code
        after `max_restarts` consecutive failures. On an exception (e.g. KeyboardInterrupt) the server is
        left to the caller (`self.proc`)."""
        failures = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            self.proc = self._start()
            self._on_start(self.proc)
            why = self._watch(self.proc)
            if self._stopping.is_set():
                break
            failures = 1 if time.monotonic() - started >= self.stable_after_s else failures + 1
            self.log(f"tritonserver {why} (consecutive failure {failures})")
            detail = self._describe(self.proc)
            if detail:
                self.log("server log tail:\n" + detail)
            if self.max_restarts is not None and failures > self.max_restarts:
                self.log(
                    f"not restarting: {failures - 1} consecutive restarts already (max_restarts {self.max_restarts})"
                )
                return self.proc.returncode or 1
            delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (failures - 1))
            self.log(f"restarting in {delay:.1f} s")
            if self._stopping.wait(delay):
                break
            self.restarts += 1
        return 0

    def _watch(self, proc: subprocess.Popen) -> str:
        """Wait until the server exits, a stub dies or a model's engine dies (then stop the server); says which."""
        stubs: dict[int, str] = {}  # every stub seen since the start: they appear while models load
        while not self._stopping.is_set():
            try:
                code = proc.wait(timeout=self.health_interval_s)
                # Its Python stubs outlive a killed server (seen after a SIGKILL: an orphan holding the model's
                # memory for minutes); `stop` ends what is left of its process group.
                self._stop(proc)
                return f"exited unexpectedly ({describe_exit(code)})"
            except subprocess.TimeoutExpired:
                pass
            current = stub_processes(proc.pid)
            gone = {pid: name for pid, name in stubs.items() if pid not in current}
            if gone and proc.poll() is None:
                self._stop(proc)
                return (
                    "lost Python stub process(es) "
                    + ", ".join(f"{n} (pid {p})" for p, n in gone.items())
                    + "; Triton 2.51 does not restart a decoupled model's stub; stopped it"
                )
            stubs.update(current)
            dead = self._dead_engines()
            if dead:
                self._stop(proc)
                return f"has a model whose engine thread died ({', '.join(dead)}); stopped it"
        self._stop(proc)
        return "stopped on request"

    def _dead_engines(self) -> list[str]:
        if not self.metrics_url:
            return []
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as resp:
                return dead_engines(resp.read().decode("utf-8", "replace"))
        except OSError:  # not up yet, or busy: only an explicit 0 counts
            return []
