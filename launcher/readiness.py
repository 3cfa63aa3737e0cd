"""Is it up yet: free ports, health probes, and waiting for readiness with the log tail when a process dies
first. Standard library only."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from launcher.paths import DEFAULT_HOST, url_host


class ServerError(RuntimeError):
    """The server exited, or did not become ready in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (bind to port 0; the port may be taken again before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def url_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def is_ready(http_port: int, host: str = DEFAULT_HOST, timeout_s: float = 2.0) -> bool:
    """True when tritonserver's ``GET /v2/health/ready`` answers 200."""
    return url_ok(f"http://{url_host(host)}:{int(http_port)}/v2/health/ready", timeout_s)


def log_tail(log_path: Path | str | None, lines: int = 60) -> str:
    """The last ``lines`` lines of a log file (at most its last 64 KiB), or why it cannot be read."""
    if log_path is None:
        return "(no log file)"
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(cannot read {log_path}: {e})"
    return "\n".join(text.splitlines()[-lines:])


def wait_until_url_ok(
    url: str,
    proc: subprocess.Popen | None = None,
    timeout_s: float = 300.0,
    *,
    what: str = "tritonserver",
    log_path: Path | str | None = None,
    poll_s: float = 0.25,
) -> None:
    """Poll ``GET url`` until 200; :class:`ServerError` (with the log tail) at once if ``proc`` (``what``) exits,
    or after ``timeout_s`` (the process is left running: the caller stops it)."""
    log_path = log_path if log_path is not None else getattr(proc, "log_path", None)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServerError(
                f"{what} exited with code {proc.returncode} before becoming ready; "
                f"log tail ({log_path}):\n{log_tail(log_path)}"
            )
        if url_ok(url):
            return
        if time.monotonic() >= deadline:
            raise ServerError(
                f"{what} not ready at {url} after {timeout_s:.0f} s; log tail ({log_path}):\n{log_tail(log_path)}"
            )
        time.sleep(poll_s)


def wait_until_ready(
    http_port: int,
    proc: subprocess.Popen | None = None,
    timeout_s: float = 300.0,
    *,
    host: str = DEFAULT_HOST,
    log_path: Path | str | None = None,
    poll_s: float = 0.25,
    metrics_port: int | None = None,
) -> None:
    """Poll tritonserver's ``GET /v2/health/ready`` until 200, then its ``GET /metrics`` on ``metrics_port``
    when given: tritonserver opens its metrics port after the HTTP one, so a scrape right after "ready" can be
    refused (see :func:`wait_until_url_ok`)."""
    deadline = time.monotonic() + timeout_s
    url = f"http://{url_host(host)}:{int(http_port)}/v2/health/ready"
    wait_until_url_ok(url, proc, timeout_s, what="tritonserver", log_path=log_path, poll_s=poll_s)
    if metrics_port is not None:
        url = f"http://{url_host(host)}:{int(metrics_port)}/metrics"
        left = max(deadline - time.monotonic(), 30.0)
        wait_until_url_ok(url, proc, left, what="tritonserver's metrics", log_path=log_path, poll_s=poll_s)


def wait_until_frontend_ready(
    port: int, proc: subprocess.Popen | None = None, timeout_s: float = 120.0, *, host: str = DEFAULT_HOST
) -> None:
    """Poll the front door's ``/health/ready`` (200 once Triton reports its models ready)."""
    url = f"http://{url_host(host)}:{int(port)}/health/ready"
    wait_until_url_ok(url, proc, timeout_s, what="the front door")
