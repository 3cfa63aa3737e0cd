"""launcher/supervisor.py: restarts a server process that exits unexpectedly, with bounded back-off, one that
lost a Python stub, and one whose model reports a dead engine; stops on request."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from launcher.supervisor import Supervisor, dead_engines, describe_exit, stub_processes


def python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def stop(proc: subprocess.Popen) -> int:
    proc.kill()
    return proc.wait()


def test_describe_exit_names_the_signal():
    assert describe_exit(-11) == "killed by signal 11 (SIGSEGV)"
    assert describe_exit(3) == "exit code 3"


def test_dead_engines_reads_the_gauge():
    text = (
        '# TYPE llm_engine_alive gauge\nllm_engine_alive{model="a",version="1"} 1\n'
        'llm_engine_alive{model="b",version="1"} 0\nllm_engine_alive_x{model="c"} 0\n'
    )
    assert dead_engines(text) == ['model="b",version="1"']


def test_restarts_with_bounded_backoff_then_gives_up():
    log = io.StringIO()
    starts = []

    def start():
        starts.append(time.monotonic())
        return python("import os; os.kill(os.getpid(), 11)")  # dies like the segfaulting server

    sup = Supervisor(start, stop, backoff_initial_s=0.1, backoff_max_s=0.2, max_restarts=3, log=log)
    assert sup.run() == -11
    assert len(starts) == 4 and sup.restarts == 3
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2 and gaps[2] >= 0.2 and max(gaps) < 2.0  # 0.1, 0.2, then capped
    text = log.getvalue()
    assert text.count("exited unexpectedly (killed by signal 11 (SIGSEGV))") == 4
    assert "restarting in 0.1 s" in text and "restarting in 0.2 s" in text and "not restarting" in text


def test_stop_ends_a_running_server():
    sup = Supervisor(lambda: python("import time; time.sleep(60)"), stop, health_interval_s=0.05, log=io.StringIO())
    runner = threading.Thread(target=sup.run)
    runner.start()
    while sup.proc is None:
        time.sleep(0.01)
    sup.stop()
    runner.join(10)
    assert not runner.is_alive() and sup.proc.poll() is not None and sup.restarts == 0


def test_a_dead_engine_gauge_restarts_the_server():
    alive = {"value": 1}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = f'llm_engine_alive{{model="llm",version="1"}} {alive["value"]}\n'.encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    log = io.StringIO()
    sup = Supervisor(
        lambda: python("import time; time.sleep(60)"),
        stop,
        health_interval_s=0.05,
        backoff_initial_s=0.01,
        metrics_url=f"http://127.0.0.1:{httpd.server_port}/metrics",
        log=log,
    )
    runner = threading.Thread(target=sup.run)
    runner.start()
    try:
        time.sleep(0.3)
        assert sup.restarts == 0  # alive: left alone
        first = sup.proc
        alive["value"] = 0
        deadline = time.monotonic() + 10
        while sup.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        alive["value"] = 1
        assert sup.restarts >= 1 and first.poll() is not None
        assert 'engine thread died (model="llm",version="1")' in log.getvalue()
    finally:
        sup.stop()
        runner.join(10)
        httpd.shutdown()


def test_a_lost_stub_process_restarts_the_server():
    """A fake server with one child named like Triton's Python stub; killing the child restarts the server."""
    code = (
        "import subprocess, time; subprocess.Popen(['/x/triton_python_backend_stub', '-c', 'sleep 60; true', "
        "'a', 'b', 'c', 'd', 'e', 'llm_0_0'], executable='/bin/bash'); time.sleep(60)"
    )
    log = io.StringIO()

    def start():
        return subprocess.Popen([sys.executable, "-c", code])

    def stop_tree(proc):
        for pid in stub_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)
        return stop(proc)

    sup = Supervisor(start, stop_tree, health_interval_s=0.05, backoff_initial_s=0.01, log=log)
    runner = threading.Thread(target=sup.run)
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while (sup.proc is None or not stub_processes(sup.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        first = sup.proc
        ((stub_pid, name),) = stub_processes(first.pid).items()
        assert name == "llm_0_0"
        time.sleep(0.2)  # the supervisor has seen it
        os.kill(stub_pid, signal.SIGKILL)
        while sup.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sup.restarts == 1 and first.poll() is not None
        assert f"lost Python stub process(es) llm_0_0 (pid {stub_pid})" in log.getvalue()
    finally:
        sup.stop()
        runner.join(10)


def test_an_unexpected_exit_is_cleaned_up():
    """The server's leftovers (its Python stubs survive a SIGKILL of tritonserver) are stopped with it."""
    stopped = []

    def record_stop(proc: subprocess.Popen) -> int:
        stopped.append(proc.pid)
        return stop(proc)

    procs = []

    def start():
        procs.append(python("import sys; sys.exit(3)"))
        return procs[-1]

    sup = Supervisor(start, record_stop, backoff_initial_s=0.01, max_restarts=1, log=io.StringIO())
    assert sup.run() == 3
    assert stopped == [p.pid for p in procs] and len(procs) == 2
