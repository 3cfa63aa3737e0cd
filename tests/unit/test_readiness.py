"""launcher/readiness.py: "ready" means both tritonserver's health endpoint and its metrics port answer, because
tritonserver opens the metrics port after the HTTP one; a process that exits first fails at once."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from launcher.readiness import ServerError, free_port, url_ok, wait_until_ready


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def _serve(port: int) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer(("127.0.0.1", port), _Ok)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_ready_waits_for_the_metrics_port_that_opens_later():
    http_port, metrics_port = free_port(), free_port()
    servers = [_serve(http_port)]
    late = threading.Timer(1.0, lambda: servers.append(_serve(metrics_port)))
    late.start()
    try:
        assert not url_ok(f"http://127.0.0.1:{metrics_port}/metrics")  # not yet: the race the wait closes
        wait_until_ready(http_port, None, 30, metrics_port=metrics_port, poll_s=0.05)
        assert url_ok(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        late.join()
        for s in servers:
            s.shutdown()
            s.server_close()


def test_a_process_that_exits_before_ready_fails_with_its_exit_code(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("boom: no model\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(ServerError, match=r"exited with code 3(.|\n)*boom: no model"):
        wait_until_ready(free_port(), proc, 30, log_path=log, metrics_port=free_port())
