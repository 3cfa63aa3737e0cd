"""Integration suite: ONE real tritonserver for the whole session, serving several variants of the model.

The `server` fixture writes a temporary model repository with one copy of `model_repository/llm` per entry
of `VARIANTS` (its own name and engine parameters; `1/model.py` is symlinked), starts tritonserver on free
ports through the launcher (`launcher.start_server`, as `llm-serve` does), waits until it is ready and stops it
at the end. The OpenAI-compatible front door (`launcher.start_frontend`) runs beside it on a free port, serving
`FRONTEND_MODELS`
(`server.openai_url` is its `/v1` base URL, as the openai SDK takes it). Add a variant by adding
an entry to `VARIANTS` (e.g. speculative decoding ones); nothing else needs to change.

The `reference` fixture computes reference outputs with Hugging Face `transformers` (greedy, one prompt at a
time, no padding) and caches them in a JSON file under the session's tmp dir.

Environment:
    LLM_VENV             the venv that has nvidia-pytriton (read by the launcher; default .venv)
    LLM_REFERENCE_CACHE  optional JSON file that keeps reference outputs across sessions (default: tmp dir)
    LLM_READY_TIMEOUT_S  seconds to wait for the server to become ready (default 600)
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

import launcher
from launcher.model_config import write_model_repository
from launcher.paths import MODEL_DIR

# The one Prometheus parser and the one Hugging Face greedy reference (float32, batch 1, stops after EOS, its
# outputs kept in a JSON file) live in testkit.
from testkit.hf_reference import HFReference as Reference
from testkit.prometheus import MetricKey, parse_prometheus
from testkit.server_variants import FRONTEND_MODELS, session_variants

HERE = Path(__file__).resolve().parent

_LOG_PATH: Path | None = None  # for the failure summary


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration is an integration test."""
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)


# --------------------------------------------------------------------------------------------------- metrics


@dataclasses.dataclass
class Metrics:
    """One scrape, with lookups by model."""

    values: dict[MetricKey, float]

    def get(self, name: str, model: str = "llm", default: float = 0.0, **labels: str) -> float:
        key = (name, frozenset({"model": model, "version": "1", **labels}.items()))
        return self.values.get(key, default)

    def has(self, name: str, model: str = "llm", **labels: str) -> bool:
        return (name, frozenset({"model": model, "version": "1", **labels}.items())) in self.values

    def multi_sequence_steps(self, model: str = "llm") -> float:
        """Engine steps whose batch held more than one sequence (llm_step_num_sequences count - le=1)."""
        return self.get("llm_step_num_sequences_count", model) - self.get(
            "llm_step_num_sequences_bucket", model, le="1"
        )


# ---------------------------------------------------------------------------------------------------- server


@dataclasses.dataclass(kw_only=True)
class LLMServer(launcher.RunningServer):
    """The launcher's running server (ports, URLs, log) with the session's repository, its variants, the front
    door beside it, and metric helpers."""

    repository: Path
    variants: dict[str, dict[str, str]]
    unloaded: set[str] = dataclasses.field(default_factory=set)  # models a test unloaded on purpose
    frontend: object | None = None  # the front door's process
    openai_port: int = 0

    @property
    def openai_url(self) -> str:
        """The front door's OpenAI base URL (`http://127.0.0.1:<port>/v1`)."""
        return f"http://{launcher.url_host(self.host)}:{self.openai_port}/v1"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            return resp.read().decode("utf-8")

    def metrics(self) -> Metrics:
        """Scrape the metrics port: a Metrics holding {(name, frozenset(labels)): value}."""
        return Metrics(parse_prometheus(self.metrics_text()))

    def wait_for(
        self, predicate: Callable[[Metrics], bool], timeout_s: float = 30.0, what: str = "", poll_s: float = 0.2
    ) -> Metrics:
        """Scrape until predicate(metrics) holds and return that scrape; after `timeout_s`, fail saying what was
        awaited (`what`, else the predicate's source) and what the last scrape showed."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if predicate(m):
                return m
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"timed out after {timeout_s:.0f} s waiting for {what or _source(predicate)}; "
                    f"last scrape: {_engine_state(m)}"
                )
            time.sleep(poll_s)

    def settled_metrics(self, model: str = "llm", timeout_s: float = 10.0, interval_s: float = 0.15) -> Metrics:
        """A scrape that reflects every update the engine has made so far: the model publishes its metrics
        from a thread of its own every 100 ms, so scrape until two scrapes `interval_s` apart agree on all of
        `model`'s values (fails if they still change after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        last = self.metrics()
        while True:
            time.sleep(interval_s)
            m = self.metrics()
            mine = {k: v for k, v in m.values.items() if ("model", model) in k[1]}
            if mine == {k: v for k, v in last.values.items() if ("model", model) in k[1]}:
                return m
            if time.monotonic() >= deadline:
                raise AssertionError(f"{model}'s metrics still changed after {timeout_s:.0f} s: {_engine_state(m)}")
            last = m

    def wait_idle(self, model: str = "llm", timeout_s: float = 30.0) -> Metrics:
        """Wait until `model` runs nothing, has nothing waiting and holds no KV blocks (fails after `timeout_s`)."""
        if not self.metrics().has("llm_kv_cache_blocks_total", model):
            raise AssertionError(
                f"model {model!r} is not served (no metrics): add it to VARIANTS in "
                f"testkit/server_variants.py (served: {sorted(self.variants)}; unloaded: {sorted(self.unloaded)})"
            )
        return self.wait_for(lambda m: is_idle(m, model), timeout_s, what=f"{model} to be idle")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 80) -> str:
        return launcher.log_tail(self.log_path, lines)


def _source(predicate) -> str:
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)


def _engine_state(m: Metrics) -> str:
    """Each model's running / waiting / KV blocks used, from one scrape."""
    models = sorted({dict(labels).get("model") for name, labels in m.values if name == "llm_kv_cache_blocks_total"})
    return "; ".join(
        f"{model}: running {m.get('llm_requests_running', model, -1):.0f}, "
        f"waiting {m.get('llm_requests_waiting', model, -1):.0f}, "
        f"blocks used {m.get('llm_kv_cache_blocks_used', model, -1):.0f}"
        for model in models
    )


def is_idle(m: Metrics, model: str) -> bool:
    return (
        m.get("llm_requests_running", model, default=-1) == 0
        and m.get("llm_requests_waiting", model, default=-1) == 0
        and m.get("llm_kv_cache_blocks_used", model, default=-1) == 0
    )


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> LLMServer:
    """The session's tritonserver with every model of `session_variants` loaded."""
    global _LOG_PATH
    try:
        launcher.site_packages()
    except FileNotFoundError as e:
        pytest.skip(f"no tritonserver: {e}")
    if not (launcher.BACKEND_DIR / "python" / "triton_python_backend_stub").is_file():
        pytest.skip("the Triton backend directory .triton/backends is missing: run `make triton`")
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"no model at {MODEL_DIR}: run `make model`")
    base = tmp_path_factory.mktemp("triton")
    variants = session_variants(base)
    repository = write_model_repository(base / "model_repository", variants)
    log_path = base / "tritonserver.log"
    _LOG_PATH = log_path
    ports = [launcher.free_port() for _ in range(3)]
    proc = launcher.start_server(repository, *ports, log_path)
    frontend = None
    # Compute the common reference outputs while the server loads its models.
    stop_prefetch = threading.Event()
    prefetch = threading.Thread(target=_prefetch_reference, args=(tmp_path_factory, stop_prefetch), daemon=True)
    prefetch.start()
    try:
        launcher.wait_until_ready(
            ports[0], proc, float(os.environ.get("LLM_READY_TIMEOUT_S", "600")), metrics_port=ports[2]
        )
        openai_port = launcher.free_port()
        frontend = launcher.start_frontend(
            f"127.0.0.1:{ports[1]}",
            openai_port,
            base / "frontend.log",
            models=FRONTEND_MODELS,
            model_dir=MODEL_DIR,
            metrics_url=f"http://127.0.0.1:{ports[2]}/metrics",
        )
        srv = LLMServer(
            proc, *ports, log_path, repository=repository, variants=variants, frontend=frontend, openai_port=openai_port
        )
        m = srv.metrics()
        missing = [name for name in variants if not m.has("llm_kv_cache_blocks_total", name)]
        assert not missing, f"no metrics for model(s) {missing}; log tail:\n{srv.log_tail()}"
        launcher.wait_until_frontend_ready(openai_port, frontend, 120)
        yield srv
        check_no_kv_block_leaks(srv)  # after the last test that used the server, whatever the order
    finally:
        if frontend is not None:
            launcher.stop_server(frontend, timeout_s=10)
        stop_prefetch.set()
        prefetch.join(timeout=60)  # torch must not be mid-computation when the interpreter exits
        code = launcher.stop_server(proc)
        sys.stderr.write(f"\n[integration] tritonserver stopped (exit code {code}); log: {log_path}\n")


def check_no_kv_block_leaks(server: LLMServer) -> None:
    """Once idle, no model of the session's server holds a KV block or a request, and the server is alive (the
    models a test unloaded on purpose, `server.unloaded`, excepted)."""
    for model in sorted(set(server.variants) - server.unloaded):
        m = server.wait_idle(model, timeout_s=30)
        total = m.get("llm_kv_cache_blocks_total", model)
        free = m.get("llm_kv_cache_blocks_free", model)
        assert free == total, f"{model}: {free:.0f} free of {total:.0f} blocks while idle"
    assert server.alive(), "tritonserver died during the suite"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """On failures, show the server log's tail."""
    if _LOG_PATH is None or exitstatus == 0:
        return
    if not terminalreporter.stats.get("failed") and not terminalreporter.stats.get("error"):
        return
    terminalreporter.section("tritonserver log tail")
    terminalreporter.write_line(f"(full log: {_LOG_PATH})")
    lines = [
        line
        for line in launcher.log_tail(_LOG_PATH, 400).splitlines()
        if line.strip() and not line.startswith(("|", "+-")) and "Loading weights" not in line
    ]
    terminalreporter.write_line("\n".join(lines[-60:]))


# ------------------------------------------------------------------------------------------------- reference


_REFERENCE: Reference | None = None
_REFERENCE_LOCK = threading.Lock()


def session_reference(tmp_path_factory) -> Reference:
    """The session's one Reference (shared by the fixture and the prefetch thread)."""
    global _REFERENCE
    with _REFERENCE_LOCK:
        if _REFERENCE is None:
            cache = os.environ.get("LLM_REFERENCE_CACHE")
            path = Path(cache) if cache else tmp_path_factory.mktemp("reference") / "hf_greedy.json"
            _REFERENCE = Reference.shared(MODEL_DIR, "float32", cache_path=path)
        return _REFERENCE


def _prefetch_reference(tmp_path_factory, stop: threading.Event) -> None:
    try:
        from tests.integration.llm_testlib import REFERENCE_PREFETCH

        session_reference(tmp_path_factory).many(REFERENCE_PREFETCH, stop=stop)
    except Exception as exc:  # noqa: BLE001 - the tests compute (and report) it again
        sys.stderr.write(f"[integration] reference prefetch failed: {exc!r}\n")


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Reference:
    """HF greedy reference outputs: `reference.get(prompt, max_tokens)` / `reference.many(cases)`."""
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"no model at {MODEL_DIR}: run `make model`")
    return session_reference(tmp_path_factory)
