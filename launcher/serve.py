"""``llm-serve``: the documented launch. Runs tritonserver (from the nvidia-pytriton wheel, no Docker) and the
OpenAI-compatible front door (``python -m frontend``) in the foreground, both stopped by one Ctrl-C;
tritonserver is restarted with bounded back-off when it exits unexpectedly or a model's engine dies
(launcher/supervisor.py)::

    llm-serve [--model-repository model_repository]
              [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
              [--openai-port 9000] [--openai-host ADDR] [--reasoning-parser auto] [--no-frontend]

Port defaults also come from the environment variables HTTP_PORT / GRPC_PORT / METRICS_PORT / OPENAI_PORT.
The server's model-repository, model-config, shared-memory, trace and logging APIs are restricted to requests
carrying the header ``llm-admin-key: $LLM_ADMIN_KEY`` (--no-restrict-apis); --no-restart and --max-restarts N
tune the supervisor. The virtual environment used is ``$LLM_VENV`` (default: ``.venv`` in the checkout); it
must have been built from the system Python whose ``libpython3.11`` the Triton python stub embeds
(``make venv``), and the backend directory must have been assembled (``make triton``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from launcher.commands import check_ready_to_run, server_command, shown
from launcher.model_config import served_model_folder
from launcher.paths import DEFAULT_HOST, MODEL_NAME, REPO_ROOT, resolve_model_repository, url_host
from launcher.processes import OutputTee, start_frontend, stop_server
from launcher.readiness import ServerError, wait_until_frontend_ready, wait_until_ready
from launcher.supervisor import Supervisor


def usage_text(http_port: int, grpc_port: int, metrics_port: int, host: str = DEFAULT_HOST) -> str:
    h = url_host(host)
    body = '{"text_input":"The capital of France is","max_tokens":16,"stream":true}'
    body_ns = '{"text_input":"The capital of France is","max_tokens":16}'
    return "\n".join(
        [
            "",
            f"=== tritonserver is READY (HTTP {h}:{http_port}, gRPC {h}:{grpc_port}, "
            f"metrics http://{h}:{metrics_port}/metrics) ===",
            "Streaming (server-sent events):",
            f"  curl -sN -X POST http://{h}:{http_port}/v2/models/{MODEL_NAME}/generate_stream -d '{body}'",
            "One response:",
            f"  curl -s -X POST http://{h}:{http_port}/v2/models/{MODEL_NAME}/generate -d '{body_ns}'",
            "Client (gRPC streaming):",
            f'  .venv/bin/llm-client --url {h}:{grpc_port} "The capital of France is"   (--help for options)',
            "Stop with Ctrl-C.",
            "",
        ]
    )


def frontend_usage_text(port: int, host: str = DEFAULT_HOST, api_key: bool = False) -> str:
    """How to call the front door; with an API key, the examples read it from $LLM_API_KEY (never print it)."""
    h = url_host(host)
    chat = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 32,
            "stream": True,
        },
        separators=(",", ":"),
    )
    auth = ' -H "Authorization: Bearer $LLM_API_KEY"' if api_key else ""
    key = "os.environ['LLM_API_KEY']" if api_key else "'-'"
    return "\n".join(
        [
            f"=== OpenAI-compatible front door is READY: http://{h}:{port}/v1 (web page: http://{h}:{port}/) ===",
            f"  curl -sN http://{h}:{port}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d '{chat}'",
            f'  .venv/bin/python -c "import os, openai; '
            f"c = openai.OpenAI(base_url='http://{h}:{port}/v1', api_key={key}); "
            f"print(c.chat.completions.create(model='{MODEL_NAME}', messages=[{{'role': 'user', 'content': 'Hi'}}], "
            'max_tokens=32).choices[0].message.content)"',
            "",
        ]
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Run tritonserver (from nvidia-pytriton) and the OpenAI-compatible "
        "front door in the foreground; Ctrl-C stops both."
    )
    ap.add_argument("--model-repository", default=os.environ.get("MODEL_REPOSITORY", "model_repository"))
    ap.add_argument("--http-port", type=int, default=_env_int("HTTP_PORT", 8000))
    ap.add_argument("--grpc-port", type=int, default=_env_int("GRPC_PORT", 8001))
    ap.add_argument("--metrics-port", type=int, default=_env_int("METRICS_PORT", 8002))
    ap.add_argument(
        "--openai-port",
        type=int,
        default=_env_int("OPENAI_PORT", 9000),
        help="the OpenAI-compatible front door's port (default $OPENAI_PORT or 9000)",
    )
    ap.add_argument("--no-frontend", action="store_true", help="run tritonserver alone")
    ap.add_argument(
        "--host",
        default=os.environ.get("TRITON_HOST", DEFAULT_HOST),
        help="bind address for all endpoints (default 127.0.0.1; 0.0.0.0 for all interfaces)",
    )
    ap.add_argument(
        "--reasoning-parser",
        default=os.environ.get("REASONING_PARSER", "auto"),
        help="the front door's reasoning parser: auto (default), qwen3, deepseek_r1 or none (docs/frontend.md)",
    )
    ap.add_argument(
        "--openai-host",
        default=os.environ.get("OPENAI_HOST") or None,
        help="bind address of the front door alone (default: --host), e.g. 0.0.0.0 in a container "
        "whose Triton ports stay on loopback",
    )
    ap.add_argument("--log-verbose", type=int, default=0)
    ap.add_argument("--exit-timeout-secs", type=int, default=10)
    ap.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for READY before giving up (the server keeps running)",
    )
    ap.add_argument("--print-command", action="store_true", help="print the command and exit")
    ap.add_argument(
        "--no-restart",
        action="store_true",
        help="do not restart tritonserver when it exits unexpectedly or a model's engine dies",
    )
    ap.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="give up after this many consecutive restarts (default: never give up)",
    )
    ap.add_argument(
        "--no-restrict-apis",
        action="store_true",
        help="leave Triton's model-repository/model-config/shared-memory/trace/logging APIs open",
    )
    args, extra = ap.parse_known_args(argv)

    repo = resolve_model_repository(args.model_repository)
    try:
        cmd, env = server_command(
            repo,
            args.http_port,
            args.grpc_port,
            args.metrics_port,
            host=args.host,
            exit_timeout_s=args.exit_timeout_secs,
            log_verbose=args.log_verbose,
            restrict_apis=not args.no_restrict_apis,
            extra_args=extra,
        )
        if args.print_command:
            print(shown(cmd))
            for k in ("LD_LIBRARY_PATH", "PATH", "PYTHONPATH"):
                print(f"{k}={env[k]}")
            return 0
        check_ready_to_run(cmd)
        config = Path(repo) / MODEL_NAME / "config.pbtxt"
        model_dir = served_model_folder(config) if config.is_file() and not args.no_frontend else None
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    h = url_host(args.host)
    frontend = (
        None
        if args.no_frontend
        else start_frontend(
            f"{h}:{args.grpc_port}",
            args.openai_port,
            host=args.openai_host or args.host,
            metrics_url=f"http://{h}:{args.metrics_port}/metrics",
            model_dir=model_dir,
            extra_args=("--reasoning-parser", args.reasoning_parser),
        )
    )

    def announce(proc: subprocess.Popen) -> None:  # after every (re)start of tritonserver
        try:
            wait_until_ready(args.http_port, proc, args.ready_timeout, host=args.host, metrics_port=args.metrics_port)
            print(usage_text(args.http_port, args.grpc_port, args.metrics_port, args.host), flush=True)
            if frontend is not None:
                wait_until_frontend_ready(args.openai_port, frontend, args.ready_timeout, host=args.host)
                print(frontend_usage_text(args.openai_port, args.host, bool(os.environ.get("LLM_API_KEY"))), flush=True)
        except ServerError as e:
            if proc.poll() is None:
                print(f"\n[llm-serve] {str(e).splitlines()[0]}", file=sys.stderr, flush=True)

    def launch() -> subprocess.Popen:
        print("+ " + shown(cmd), flush=True)
        # Own process group: a terminal Ctrl-C reaches only us, and we stop the server exactly once.
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=str(REPO_ROOT),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc.output = OutputTee(proc.stdout)  # type: ignore[attr-defined]  # shown as it comes; errors kept
        threading.Thread(target=announce, args=(proc,), daemon=True).start()
        return proc

    supervisor = Supervisor(
        launch,
        lambda proc: stop_server(proc, timeout_s=args.exit_timeout_secs + 20),
        stop_broken=lambda proc: stop_server(proc, timeout_s=3),  # streams of other models get 3 s to end
        metrics_url=f"http://{h}:{args.metrics_port}/metrics",
        ready_url=f"http://{h}:{args.http_port}/v2/health/ready",
        max_restarts=0 if args.no_restart else args.max_restarts,
        describe=lambda proc: proc.output.load_errors(),
    )
    return supervise(supervisor, frontend, args.exit_timeout_secs)


def supervise(supervisor: Supervisor, frontend: subprocess.Popen | None, exit_timeout_s: int) -> int:
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
                print(
                    f"\n[llm-serve] the front door exited with code {frontend.returncode}; stopping the server",
                    file=sys.stderr,
                    flush=True,
                )
                code = frontend.returncode if frontend.returncode and frontend.returncode > 0 else 1
                break
            thread.join(0.2)
        else:
            code = result.get("code", 1)
    except KeyboardInterrupt:
        print("\n[llm-serve] stopping (SIGINT) ...", file=sys.stderr, flush=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Both stop at once: each refuses new requests and finishes the streams in flight (Triton waits up to
    # exit_timeout_s for them; the front door relays them until they end), then exits.
    door = threading.Thread(target=_stop_frontend, args=(frontend, exit_timeout_s), daemon=True)
    door.start()
    supervisor.stop()  # stops tritonserver from the supervisor's thread
    thread.join(exit_timeout_s + 30)
    door.join(exit_timeout_s + 30)
    if supervisor.proc is not None and supervisor.proc.poll() is None:
        stop_server(supervisor.proc)
    if supervisor.proc is not None:
        print(f"[llm-serve] tritonserver exited with code {supervisor.proc.returncode}", file=sys.stderr, flush=True)
    return code


def _stop_frontend(frontend: subprocess.Popen | None, exit_timeout_s: int) -> None:
    if frontend is not None and frontend.poll() is None:
        code = stop_server(frontend, timeout_s=exit_timeout_s + 20)
        print(f"[llm-serve] the front door exited with code {code}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
