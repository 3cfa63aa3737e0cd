"""Keeps tritonserver serving: restarts it with bounded back-off when it exits unexpectedly after it was serving,
when one of its Python stub processes has died, or when a model's engine thread has died (the model's
`llm_engine_alive` gauge reads 0, or the model unloaded itself on the engine's death and its gauge is gone).
Triton 2.51 does not restart a decoupled model's stub: without this, requests to such a model would fail or
hang until someone noticed. A server that fails before it was ever ready (a model's configuration error) is
not restarted: the launch ends with its exit code.

Standard library only, like the rest of the launcher. While the server is down its HTTP port is closed, so
`/v2/health/ready` fails for the whole gap; it answers 200 again once the restarted server has loaded its
models. Used by `llm-serve` (launcher/serve.py, the documented launch)::

    sup = Supervisor(start, stop, metrics_url="http://127.0.0.1:8002/metrics",
                     ready_url="http://127.0.0.1:8000/v2/health/ready")
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

from launcher.readiness import url_ok

_ENGINE_ALIVE_RE = re.compile(r"^llm_engine_alive\{([^}]*)\}\s+(\S+)\s*$", re.MULTILINE)


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


def engine_gauges(metrics_text: str) -> dict[str, bool]:
    """{label set: alive} of every `llm_engine_alive` gauge in a Prometheus scrape."""
    return {labels: float(value) != 0 for labels, value in _ENGINE_ALIVE_RE.findall(metrics_text)}


def dead_engines(metrics_text: str, seen_alive: set[str] = frozenset()) -> list[str]:
    """Label sets of the engines that are dead in a scrape: their gauge reads 0, or an engine of `seen_alive`
    has no gauge any more (its model unloaded itself when the engine died: model_repository/llm/1/model.py)."""
    gauges = engine_gauges(metrics_text)
    return sorted({labels for labels, alive in gauges.items() if not alive} | (set(seen_alive) - set(gauges)))


class Supervisor:
    """Runs the server that `start()` launches; restarts it after an unexpected exit or a dead engine.

    With `ready_url`, a server that exits with an error code by itself before that URL first answered 200
    failed to start: a model's configuration error, say. That is not restarted: `run()` returns its exit code
    at once (restarts are for a server that crashed after it was serving, or was killed by a signal). Without
    `ready_url` a server counts as serving from its start.

    `stop` stops a server gracefully; `stop_broken` (default: `stop`) stops one that lost a stub, which cannot
    finish gracefully.

    Back-off: `backoff_initial_s`, doubling per consecutive failure up to `backoff_max_s`; a server that ran
    `stable_after_s` without failing resets it. More than `max_restarts` consecutive failures (None: no limit;
    0: never restart) give up.
    """

    def __init__(
        self,
        start: Callable[[], subprocess.Popen],
        stop: Callable[[subprocess.Popen], int | None],
        *,
        stop_broken: Callable[[subprocess.Popen], int | None] | None = None,
        metrics_url: str | None = None,
        ready_url: str | None = None,
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
        self._stop_broken = stop_broken or stop
        self.metrics_url = metrics_url
        self.ready_url = ready_url
        self.health_interval_s = health_interval_s
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.stable_after_s = stable_after_s
        self.max_restarts = max_restarts
        self._log_file = log
        self._describe = describe  # e.g. the server log's tail
        self._stopping = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.restarts = 0  # in total, for tests and logs
        self.served = False  # whether the current server has answered ready_url (always, without one)
        self.checks = 0  # health checks made so far (tests wait on it rather than sleep)
        self._on_start = on_start  # called after every (re)start, e.g. to announce readiness

    def log(self, message: str) -> None:
        print(f"[supervisor {time.strftime('%H:%M:%S')}] {message}", file=self._log_file, flush=True)

    def stop(self) -> None:
        """Ask `run()` to stop the server and return (safe from a signal handler or another thread)."""
        self._stopping.set()

    def run(self) -> int:
        """Supervise until `stop()` (which stops the server); returns 0 then, the exit code of a server that
        failed to start, or the server's last exit code after `max_restarts` consecutive failures. On an
        exception (e.g. KeyboardInterrupt) the server is left to the caller (`self.proc`)."""
        failures = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            self.served = self.ready_url is None
            self.proc = self._start()
            self._on_start(self.proc)
            why = self._watch(self.proc)
            if self._stopping.is_set():
                break
            detail = self._describe(self.proc)
            if not self.served and (self.proc.returncode or 0) > 0:  # it gave up by itself, not killed by a signal
                self.log(
                    f"tritonserver {why} before it was ready: it failed to start, and would again, so it is not "
                    "restarted" + (f"; what failed:\n{detail}" if detail else "")
                )
                return self.proc.returncode or 1
            failures = 1 if time.monotonic() - started >= self.stable_after_s else failures + 1
            self.log(f"tritonserver {why} (consecutive failure {failures})")
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
        alive: set[str] = set()  # every engine seen alive since the start
        # A stop is acted on at once; until the server is first ready, readiness is polled 4x as often, so
        # that a server that crashes right after it got ready is not taken for one that never started.
        while not self._stopping.wait(self.health_interval_s if self.served else self.health_interval_s / 4):
            code = proc.poll()
            if code is not None:
                # Its Python stubs outlive a killed server (seen after a SIGKILL: an orphan holding the model's
                # memory for minutes); `stop` ends what is left of its process group.
                self._stop(proc)
                return f"exited unexpectedly ({describe_exit(code)})"
            if not self.served:
                self.served = url_ok(self.ready_url)
            current = stub_processes(proc.pid)
            gone = {pid: name for pid, name in stubs.items() if pid not in current}
            if gone and proc.poll() is None and self.served:  # while loading, a failed model's stub exits
                # Triton cannot finish that model's streams nor unload it gracefully: without a short stop it
                # waits out its exit timeout twice (measured: the stream in flight failed 35.9 s after the kill).
                self._stop_broken(proc)
                return (
                    "lost Python stub process(es) "
                    + ", ".join(f"{n} (pid {p})" for p, n in gone.items())
                    + "; Triton 2.51 does not restart a decoupled model's stub; stopped it"
                )
            stubs.update(current)
            text = self._scrape()  # None while not up yet, or busy: only an explicit 0 or a vanished engine counts
            dead = dead_engines(text, alive) if text is not None else []
            if dead:
                self._stop(proc)
                return f"has a model whose engine thread died ({', '.join(dead)}); stopped it"
            alive.update(labels for labels, up in engine_gauges(text or "").items() if up)
            self.checks += 1
        self._stop(proc)
        return "stopped on request"

    def _scrape(self) -> str | None:
        if not self.metrics_url:
            return None
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as resp:
                return resp.read().decode("utf-8", "replace")
        except OSError:
            return None
