"""Starting and stopping tritonserver and the front door as background processes (each in its own process
group), and ``running_server``: a server on free ports for as long as a ``with`` block. Standard library
only; the integration tests' server fixture and the benchmarks use it::

    with running_server("model_repository", log_path="/tmp/t.log") as srv:
        srv.grpc_url ...
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from launcher.commands import check_ready_to_run, frontend_command, server_command
from launcher.paths import DEFAULT_HOST, DEFAULT_MODEL_REPOSITORY, REPO_ROOT, url_host
from launcher.readiness import free_port, wait_until_ready


def start_server(
    model_repository: Path | str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    log_path: Path | str,
    **kwargs,
) -> subprocess.Popen:
    """Start tritonserver in the background, its stdout+stderr going to ``log_path``.

    It runs in its own process group (a Ctrl-C in the terminal does not reach it directly; use
    :func:`stop_server`). Keyword arguments go to :func:`~launcher.commands.server_command`. The returned
    Popen has ``log_path`` and ``http_port`` attributes, used by :func:`~launcher.readiness.wait_until_ready`.
    """
    argv, env = server_command(model_repository, http_port, grpc_port, metrics_port, **kwargs)
    check_ready_to_run(argv)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=str(REPO_ROOT),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    proc.http_port = int(http_port)  # type: ignore[attr-defined]
    return proc


def start_frontend(grpc_url: str, port: int, log_path: Path | str | None = None, **kwargs) -> subprocess.Popen:
    """Start the front door in the background (its own process group, like :func:`start_server`; stop it with
    :func:`stop_server`). Output goes to ``log_path``, or to this process's stdout when None. Keyword arguments
    go to :func:`~launcher.commands.frontend_command`. The returned Popen has ``log_path`` and ``port``
    attributes."""
    argv = frontend_command(grpc_url, port, **kwargs)
    log = open(log_path, "ab") if log_path is not None else None
    try:
        proc = subprocess.Popen(
            argv,
            cwd=str(REPO_ROOT),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
        )
    finally:
        if log is not None:
            log.close()
    proc.log_path = log_path  # type: ignore[attr-defined]
    proc.port = int(port)  # type: ignore[attr-defined]
    return proc


class OutputTee:
    """Copies a process's output (a pipe) to `sink` line by line from a thread of its own, keeping the lines
    that say why a model failed to load (Triton's "failed to load" errors, with the model's message)."""

    MARKERS = (b"failed to load", b"Failed to initialize Python stub")

    def __init__(self, pipe, sink=None, keep: int = 20):
        self.errors: collections.deque[str] = collections.deque(maxlen=keep)
        self._pipe, self._sink = pipe, sink if sink is not None else sys.stdout.buffer
        self.thread = threading.Thread(target=self._run, name="output-tee", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for line in iter(self._pipe.readline, b""):
            with contextlib.suppress(OSError, ValueError):
                self._sink.write(line)
                self._sink.flush()
            if any(marker in line for marker in self.MARKERS):
                self.errors.append(line.decode("utf-8", "replace").rstrip())
        self._pipe.close()

    def load_errors(self) -> str:
        """The error lines seen so far, after the output has ended (waits up to 5 s for it)."""
        self.thread.join(timeout=5)
        return "\n".join(self.errors)


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> int | None:
    """Stop a process started here: SIGINT (graceful: tritonserver unloads its models), then SIGTERM, then
    SIGKILL of its group. Returns the exit code. Safe to call twice or on a process that already exited."""
    if proc.poll() is None:
        for sig, wait_s in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                if sig == signal.SIGINT:
                    proc.send_signal(sig)
                else:
                    _signal_group(proc, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    # Leftover python stubs in the server's process group (normally they exit with the server).
    _signal_group(proc, signal.SIGKILL)
    return proc.returncode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process's group (started as a group leader, so its pid is the group id; Linux does not reuse
    a pid while its group still has members)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


@dataclasses.dataclass
class RunningServer:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    host: str = DEFAULT_HOST

    @property
    def http_url(self) -> str:
        return f"{url_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{url_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{url_host(self.host)}:{self.metrics_port}/metrics"


@contextlib.contextmanager
def running_server(
    model_repository: Path | str = DEFAULT_MODEL_REPOSITORY,
    log_path: Path | str | None = None,
    *,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    ready_timeout_s: float = 300.0,
    stop_timeout_s: float = 30.0,
    **kwargs,
) -> Iterator[RunningServer]:
    """Start a server on free loopback ports, wait until ready, yield it, always stop it."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(fd)
    ports = [p if p is not None else free_port() for p in (http_port, grpc_port, metrics_port)]
    host = kwargs.get("host", DEFAULT_HOST)
    proc = start_server(model_repository, *ports, log_path, **kwargs)
    try:
        wait_until_ready(ports[0], proc, ready_timeout_s, host=host, metrics_port=ports[2])
        yield RunningServer(proc, *ports, Path(log_path), host)
    finally:
        stop_server(proc, stop_timeout_s)
