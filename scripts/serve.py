"""Launch the real Triton Inference Server bundled in the ``nvidia-pytriton`` wheel (no Docker).

Importable (tests use it) and a CLI that also starts the OpenAI-compatible front door (``python -m
frontend``) beside the server, both stopped by one Ctrl-C; tritonserver is restarted with bounded back-off when
it exits unexpectedly or a model's engine dies (scripts/supervisor.py)::

    python scripts/serve.py [--model-repository model_repository]
                            [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
                            [--openai-port 9000] [--openai-host ADDR] [--no-frontend]

Port defaults also come from the environment variables HTTP_PORT / GRPC_PORT / METRICS_PORT / OPENAI_PORT.
The server's model-repository, model-config, shared-memory, trace and logging APIs are restricted to requests
carrying the header ``llm-admin-key: $LLM_ADMIN_KEY`` (--no-restrict-apis); --no-restart and --max-restarts N
tune the supervisor.
The virtual environment used is ``$LLM_VENV`` (default: ``.venv`` in the repository root); it must
have been built from the system Python whose ``libpython3.11`` the Triton python stub embeds
(``make venv``), and the backend directory must have been assembled (``make triton``).

Only the standard library is imported here, so any Python 3 can run this file.

Library use::

    import serve
    port = serve.free_port()
    proc = serve.start_server("model_repository", port, serve.free_port(), serve.free_port(), "/tmp/t.log")
    try:
        serve.wait_until_ready(port, proc, timeout_s=300)
        ...
    finally:
        serve.stop_server(proc)

or ``with serve.running_server("model_repository", log_path=...) as srv: srv.http_port ...``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

from supervisor import Supervisor

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("LLM_VENV") or (REPO_ROOT / ".venv"))
if not VENV.is_absolute():
    VENV = (REPO_ROOT / VENV).resolve()
BACKEND_DIR = REPO_ROOT / ".triton" / "backends"
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_HOST = "127.0.0.1"  # where the server binds and where readiness is polled
MODEL_NAME = "llm"
# Triton APIs that change or expose the server beyond inference; the launch restricts them to requests that
# carry the header `llm-admin-key: $LLM_ADMIN_KEY` (a random key when the variable is unset: only the front door,
# started from the same launch, knows it; it reads the model's settings with it).
RESTRICTED_APIS = ("model-repository", "model-config", "shared-memory", "trace", "logging")
ADMIN_HEADER = "llm-admin-key"

_TRITON_REL = Path("pytriton") / "tritonserver" / "bin" / "tritonserver"
_LIBS_REL = Path("nvidia_pytriton.libs")


class ServerError(RuntimeError):
    """The server exited, or did not become ready in time."""


def site_packages(venv: Path | str | None = None) -> Path:
    """The site-packages directory of ``venv`` that holds nvidia-pytriton's ``tritonserver``.

    Looks at ``lib*/python3*/site-packages`` first (no subprocess); falls back to asking the venv's
    interpreter. Raises FileNotFoundError with a hint when nothing fits.
    """
    venv = Path(venv) if venv is not None else VENV
    candidates = sorted(venv.glob("lib*/python3*/site-packages"))
    for sp in candidates:
        if (sp / _TRITON_REL).is_file():
            return sp
    py = venv / "bin" / "python"
    if py.exists():
        try:
            out = subprocess.run(
                [str(py), "-c", "import sysconfig, json; p = sysconfig.get_paths();"
                 " print(json.dumps([p['purelib'], p['platlib']]))"],
                capture_output=True, text=True, timeout=60, check=True,
            ).stdout
            for sp in map(Path, json.loads(out)):
                if (sp / _TRITON_REL).is_file():
                    return sp
        except (subprocess.SubprocessError, OSError, ValueError):
            pass
    raise FileNotFoundError(
        f"no pytriton/tritonserver/bin/tritonserver in the virtual environment {venv} "
        f"(looked in {[str(c) for c in candidates] or 'lib*/python3*/site-packages'}); run `make venv` "
        "or point LLM_VENV at a venv with nvidia-pytriton installed"
    )


def server_command(
    model_repository: Path | str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    *,
    host: str = DEFAULT_HOST,
    venv: Path | str | None = None,
    backend_dir: Path | str | None = None,
    exit_timeout_s: int = 10,
    log_verbose: int = 0,
    restrict_apis: bool = True,
    extra_args: tuple[str, ...] | list[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run tritonserver for ``model_repository``.

    The environment prepends ``<site-packages>/nvidia_pytriton.libs`` to LD_LIBRARY_PATH (the
    binary's shared libraries), puts the venv's ``bin/`` first on PATH (the python stub finds the
    venv's packages through the ``python`` on PATH), and puts the repository root on PYTHONPATH (so
    a model can ``import backend``). With ``restrict_apis`` the APIs of RESTRICTED_APIS answer only requests
    that carry the ``llm-admin-key`` header with the value of ``$LLM_ADMIN_KEY``.
    """
    venv = Path(venv) if venv is not None else VENV
    sp = site_packages(venv)
    backend_dir = Path(backend_dir) if backend_dir is not None else BACKEND_DIR
    argv = [
        str(sp / _TRITON_REL),
        "--model-repository", str(Path(model_repository).resolve()),
        "--backend-directory", str(backend_dir.resolve()),
        "--http-address", host,
        "--http-port", str(int(http_port)),
        "--grpc-address", host,
        "--grpc-port", str(int(grpc_port)),
        "--metrics-address", host,
        "--metrics-port", str(int(metrics_port)),
        "--log-verbose", str(int(log_verbose)),
        "--exit-timeout-secs", str(int(exit_timeout_s)),
        *(restriction_args() if restrict_apis else []),
        *extra_args,
    ]
    env = dict(os.environ)
    env.pop("PYTHONHOME", None)  # would point the embedded interpreter at another stdlib
    env["LD_LIBRARY_PATH"] = _prepend(str(sp / _LIBS_REL), env.get("LD_LIBRARY_PATH"))
    env["PATH"] = _prepend(str(venv / "bin"), env.get("PATH") or os.defpath)
    env["PYTHONPATH"] = _prepend(str(REPO_ROOT), env.get("PYTHONPATH"))
    env["VIRTUAL_ENV"] = str(venv)
    return argv, env


def restriction_args() -> list[str]:
    if not os.environ.get("LLM_ADMIN_KEY"):  # a random key per launch, which the front door started after inherits
        os.environ["LLM_ADMIN_KEY"] = secrets.token_urlsafe(24)
    key = os.environ["LLM_ADMIN_KEY"]
    restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={key}"
    return [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]


def _prepend(item: str, pathlist: Optional[str]) -> str:
    parts = [p for p in (pathlist or "").split(os.pathsep) if p and p != item]
    return os.pathsep.join([item, *parts])


def _check_ready_to_run(argv: list[str]) -> None:
    stub = Path(argv[argv.index("--backend-directory") + 1]) / "python" / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"{stub} is missing: run `make triton` to assemble the backend directory")
    repo = Path(argv[argv.index("--model-repository") + 1])
    if not repo.is_dir():
        raise FileNotFoundError(f"model repository {repo} does not exist")


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
    :func:`stop_server`). Keyword arguments go to :func:`server_command`. The returned Popen has
    ``log_path`` and ``http_port`` attributes, used by :func:`wait_until_ready`.
    """
    argv, env = server_command(model_repository, http_port, grpc_port, metrics_port, **kwargs)
    _check_ready_to_run(argv)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, env=env, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    proc.http_port = int(http_port)  # type: ignore[attr-defined]
    return proc


def log_tail(log_path: Path | str | None, lines: int = 60) -> str:
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


def is_ready(http_port: int, host: str = DEFAULT_HOST, timeout_s: float = 2.0) -> bool:
    """True when ``GET /v2/health/ready`` answers 200."""
    return url_ok(f"http://{_url_host(host)}:{int(http_port)}/v2/health/ready", timeout_s)


def url_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def wait_until_ready(
    http_port: int,
    proc: Optional[subprocess.Popen] = None,
    timeout_s: float = 300.0,
    *,
    host: str = DEFAULT_HOST,
    log_path: Path | str | None = None,
    poll_s: float = 0.25,
) -> None:
    """Poll ``GET /v2/health/ready`` until 200.

    Raises :class:`ServerError` (with the log tail) at once if ``proc`` exits, or after
    ``timeout_s``; the server is left running on timeout (the caller stops it).
    """
    url = f"http://{_url_host(host)}:{int(http_port)}/v2/health/ready"
    wait_until_url_ok(url, proc, timeout_s, what="tritonserver", log_path=log_path, poll_s=poll_s)


def wait_until_url_ok(
    url: str,
    proc: Optional[subprocess.Popen] = None,
    timeout_s: float = 300.0,
    *,
    what: str = "tritonserver",
    log_path: Path | str | None = None,
    poll_s: float = 0.25,
) -> None:
    """Poll ``GET url`` until 200; :class:`ServerError` if ``proc`` (``what``) exits first or on timeout."""
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
                f"{what} not ready at {url} after {timeout_s:.0f} s; "
                f"log tail ({log_path}):\n{log_tail(log_path)}"
            )
        time.sleep(poll_s)


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> Optional[int]:
    """Stop tritonserver: SIGINT (graceful, unloads models), then SIGTERM, then SIGKILL of its group.

    Returns the exit code. Safe to call twice or on a process that already exited.
    """
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
    """Signal the server's process group (start_server makes the server a group leader, so its
    pid is the group id; Linux does not reuse a pid while its group still has members)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (bind to port 0; the port may be taken again before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def frontend_command(
    grpc_url: str,
    port: int,
    *,
    host: str = DEFAULT_HOST,
    metrics_url: str = "",
    models: tuple[str, ...] | list[str] = (MODEL_NAME,),
    model_dir: Path | str | None = None,
    venv: Path | str | None = None,
    extra_args: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """argv that runs the OpenAI-compatible front door (``python -m frontend``) against the Triton server at
    ``grpc_url`` (its metrics page ``metrics_url`` is appended to the front door's /metrics)."""
    venv = Path(venv) if venv is not None else VENV
    argv = [str(venv / "bin" / "python"), "-m", "frontend", "--triton-grpc", grpc_url,
            "--triton-metrics", metrics_url, "--host", host, "--port", str(int(port))]
    if model_dir is not None:
        argv += ["--model-dir", str(model_dir)]
    for name in models:
        argv += ["--served-model-name", name]
    return argv + list(extra_args)


def start_frontend(grpc_url: str, port: int, log_path: Path | str | None = None, **kwargs) -> subprocess.Popen:
    """Start the front door in the background (its own process group, like :func:`start_server`; stop it with
    :func:`stop_server`). Output goes to ``log_path``, or to this process's stdout when None. Keyword arguments
    go to :func:`frontend_command`. The returned Popen has ``log_path`` and ``port`` attributes."""
    argv = frontend_command(grpc_url, port, **kwargs)
    log = open(log_path, "ab") if log_path is not None else None
    try:
        proc = subprocess.Popen(argv, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT if log else None, start_new_session=True)
    finally:
        if log is not None:
            log.close()
    proc.log_path = log_path  # type: ignore[attr-defined]
    proc.port = int(port)  # type: ignore[attr-defined]
    return proc


def wait_until_frontend_ready(port: int, proc: Optional[subprocess.Popen] = None, timeout_s: float = 120.0,
                              *, host: str = DEFAULT_HOST) -> None:
    """Poll the front door's ``/health/ready`` (200 once Triton reports its models ready)."""
    url = f"http://{_url_host(host)}:{int(port)}/health/ready"
    wait_until_url_ok(url, proc, timeout_s, what="the front door")


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
        return f"{_url_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{_url_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.metrics_port}/metrics"


@contextlib.contextmanager
def running_server(
    model_repository: Path | str = DEFAULT_MODEL_REPOSITORY,
    log_path: Path | str | None = None,
    *,
    http_port: Optional[int] = None,
    grpc_port: Optional[int] = None,
    metrics_port: Optional[int] = None,
    ready_timeout_s: float = 300.0,
    stop_timeout_s: float = 30.0,
    **kwargs,
) -> Iterator[RunningServer]:
    """Start a server on free loopback ports, wait until ready, yield it, always stop it."""
    if log_path is None:
        import tempfile
        fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(fd)
        log_path = name
    ports = [p if p is not None else free_port() for p in (http_port, grpc_port, metrics_port)]
    proc = start_server(model_repository, *ports, log_path, **kwargs)
    try:
        wait_until_ready(ports[0], proc, ready_timeout_s, host=kwargs.get("host", DEFAULT_HOST))
        yield RunningServer(proc, *ports, Path(log_path), kwargs.get("host", DEFAULT_HOST))
    finally:
        stop_server(proc, stop_timeout_s)


def usage_text(http_port: int, grpc_port: int, metrics_port: int, host: str = DEFAULT_HOST) -> str:
    h = _url_host(host)
    body = '{"text_input":"The capital of France is","max_tokens":16,"stream":true}'
    body_ns = '{"text_input":"The capital of France is","max_tokens":16}'
    return "\n".join([
        "",
        f"=== tritonserver is READY (HTTP {h}:{http_port}, gRPC {h}:{grpc_port}, "
        f"metrics http://{h}:{metrics_port}/metrics) ===",
        "Streaming (server-sent events):",
        f"  curl -sN -X POST http://{h}:{http_port}/v2/models/{MODEL_NAME}/generate_stream -d '{body}'",
        "One response:",
        f"  curl -s -X POST http://{h}:{http_port}/v2/models/{MODEL_NAME}/generate -d '{body_ns}'",
        "Client (gRPC streaming):",
        f"  .venv/bin/python -m client --url {h}:{grpc_port} \"The capital of France is\"   (--help for options)",
        "Stop with Ctrl-C.",
        "",
    ])


def frontend_usage_text(port: int, host: str = DEFAULT_HOST, api_key: bool = False) -> str:
    """How to call the front door; with an API key, the examples read it from $LLM_API_KEY (never print it)."""
    h = _url_host(host)
    chat = ('{"model":"%s","messages":[{"role":"user","content":"Name three colours."}],"max_tokens":32,'
            '"stream":true}' % MODEL_NAME)
    auth = " -H \"Authorization: Bearer $LLM_API_KEY\"" if api_key else ""
    key = "os.environ['LLM_API_KEY']" if api_key else "'-'"
    return "\n".join([
        f"=== OpenAI-compatible front door is READY: http://{h}:{port}/v1 (web page: http://{h}:{port}/) ===",
        f"  curl -sN http://{h}:{port}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d '{chat}'",
        f"  .venv/bin/python -c \"import os, openai; "
        f"c = openai.OpenAI(base_url='http://{h}:{port}/v1', api_key={key}); "
        f"print(c.chat.completions.create(model='{MODEL_NAME}', messages=[{{'role': 'user', 'content': 'Hi'}}], "
        "max_tokens=32).choices[0].message.content)\"",
        "",
    ])


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Run tritonserver (from nvidia-pytriton) and the OpenAI-compatible "
                                             "front door in the foreground; Ctrl-C stops both.")
    ap.add_argument("--model-repository", default=os.environ.get("MODEL_REPOSITORY", "model_repository"))
    ap.add_argument("--http-port", type=int, default=_env_int("HTTP_PORT", 8000))
    ap.add_argument("--grpc-port", type=int, default=_env_int("GRPC_PORT", 8001))
    ap.add_argument("--metrics-port", type=int, default=_env_int("METRICS_PORT", 8002))
    ap.add_argument("--openai-port", type=int, default=_env_int("OPENAI_PORT", 9000),
                    help="the OpenAI-compatible front door's port (default $OPENAI_PORT or 9000)")
    ap.add_argument("--no-frontend", action="store_true", help="run tritonserver alone")
    ap.add_argument("--host", default=os.environ.get("TRITON_HOST", DEFAULT_HOST),
                    help="bind address for all endpoints (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    ap.add_argument("--openai-host", default=os.environ.get("OPENAI_HOST") or None,
                    help="bind address of the front door alone (default: --host), e.g. 0.0.0.0 in a container "
                         "whose Triton ports stay on loopback")
    ap.add_argument("--log-verbose", type=int, default=0)
    ap.add_argument("--exit-timeout-secs", type=int, default=10)
    ap.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds to wait for READY before giving up (the server keeps running)")
    ap.add_argument("--print-command", action="store_true", help="print the command and exit")
    ap.add_argument("--no-restart", action="store_true",
                    help="do not restart tritonserver when it exits unexpectedly or a model's engine dies")
    ap.add_argument("--max-restarts", type=int, default=None,
                    help="give up after this many consecutive restarts (default: never give up)")
    ap.add_argument("--no-restrict-apis", action="store_true",
                    help="leave Triton's model-repository/model-config/shared-memory/trace/logging APIs open")
    args, extra = ap.parse_known_args(argv)

    repo = Path(args.model_repository)
    if not repo.is_absolute() and not repo.exists() and (REPO_ROOT / repo).exists():
        repo = REPO_ROOT / repo
    try:
        cmd, env = server_command(
            repo, args.http_port, args.grpc_port, args.metrics_port, host=args.host,
            exit_timeout_s=args.exit_timeout_secs, log_verbose=args.log_verbose,
            restrict_apis=not args.no_restrict_apis, extra_args=extra,
        )
        if args.print_command:
            print(_shown(cmd))
            for k in ("LD_LIBRARY_PATH", "PATH", "PYTHONPATH"):
                print(f"{k}={env[k]}")
            return 0
        _check_ready_to_run(cmd)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    h = _url_host(args.host)
    frontend = None if args.no_frontend else start_frontend(
        f"{h}:{args.grpc_port}", args.openai_port, host=args.openai_host or args.host,
        metrics_url=f"http://{h}:{args.metrics_port}/metrics")

    def announce(proc: subprocess.Popen) -> None:  # after every (re)start of tritonserver
        try:
            wait_until_ready(args.http_port, proc, args.ready_timeout, host=args.host)
            print(usage_text(args.http_port, args.grpc_port, args.metrics_port, args.host), flush=True)
            if frontend is not None:
                wait_until_frontend_ready(args.openai_port, frontend, args.ready_timeout, host=args.host)
                print(frontend_usage_text(args.openai_port, args.host, bool(os.environ.get("LLM_API_KEY"))),
                      flush=True)
        except ServerError as e:
            if proc.poll() is None:
                print(f"\n[serve.py] {str(e).splitlines()[0]}", file=sys.stderr, flush=True)

    def launch() -> subprocess.Popen:
        print("+ " + _shown(cmd), flush=True)
        # Own process group: a terminal Ctrl-C reaches only us, and we stop the server exactly once.
        proc = subprocess.Popen(cmd, env=env, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
                                start_new_session=True)
        threading.Thread(target=announce, args=(proc,), daemon=True).start()
        return proc

    supervisor = Supervisor(
        launch, lambda proc: stop_server(proc, timeout_s=args.exit_timeout_secs + 20),
        metrics_url=f"http://{h}:{args.metrics_port}/metrics",
        max_restarts=0 if args.no_restart else args.max_restarts,
    )
    return supervise(supervisor, frontend, args.exit_timeout_secs)


def supervise(supervisor: Supervisor, frontend: Optional[subprocess.Popen], exit_timeout_s: int) -> int:
    """Run the supervisor (tritonserver, restarted when it fails) beside the front door until Ctrl-C (or
    SIGTERM/SIGHUP), the front door exiting, or the supervisor giving up; then stop both, the front door first.
    Returns 0 after Ctrl-C, else the exit status of what ended it."""
    def on_term(signum, frame):  # make / systemd / kill: stop the children like Ctrl-C does
        raise KeyboardInterrupt

    # Explicit, so Ctrl-C works even when SIGINT was inherited as ignored (e.g. started from a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", supervisor.run()), daemon=True)
    thread.start()
    code = 0
    try:
        while thread.is_alive():
            if frontend is not None and frontend.poll() is not None:
                print(f"\n[serve.py] the front door exited with code {frontend.returncode}; stopping the server",
                      file=sys.stderr, flush=True)
                code = frontend.returncode if frontend.returncode and frontend.returncode > 0 else 1
                break
            thread.join(0.2)
        else:
            code = result.get("code", 1)
    except KeyboardInterrupt:
        print("\n[serve.py] stopping (SIGINT) ...", file=sys.stderr, flush=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if frontend is not None and frontend.poll() is None:
        print(f"[serve.py] the front door exited with code {stop_server(frontend, timeout_s=exit_timeout_s + 20)}",
              file=sys.stderr, flush=True)
    supervisor.stop()  # stops tritonserver from the supervisor's thread
    thread.join(exit_timeout_s + 30)
    if supervisor.proc is not None and supervisor.proc.poll() is None:
        stop_server(supervisor.proc)
    if supervisor.proc is not None:
        print(f"[serve.py] tritonserver exited with code {supervisor.proc.returncode}", file=sys.stderr, flush=True)
    return code


def _shown(cmd: list[str]) -> str:
    """The command line with the admin key masked."""
    return re.sub(rf"({ADMIN_HEADER}=)\S+", r"\1***", " ".join(cmd))


if __name__ == "__main__":
    sys.exit(main())
