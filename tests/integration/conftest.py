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

# The one Prometheus parser and the one Hugging Face greedy reference (float32, batch 1, stops after EOS, its
# outputs kept in a JSON file) live in testkit; imported here too, as tests import them from conftest.
from testkit.hf_reference import HFReference as Reference
from testkit.hf_reference import RefOutput  # noqa: F401
from testkit.prometheus import MetricKey, parse_prometheus  # noqa: F401

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]

MODEL_DIR = (REPO_ROOT / "models" / "smollm2-135m-instruct").resolve()

# Every variant the session's server loads: model name -> engine parameters that differ from
# model_repository/llm/config.pbtxt (string values, as in config.pbtxt). `model` is always set to the
# absolute path of models/smollm2-135m-instruct unless a variant sets it.
# float32 variants are held to token-for-token equality with Hugging Face's float32 `generate`.
# Dense fp32 without speculation: the reference configuration every feature test holds token for token to
# transformers (the default repository's own settings, GGUF blocks and adaptive n-gram speculation, are
# `llm_default`'s, held to the rule of what it picks on the machine).
_FP32 = {"dtype": "float32", "quantization": "none", "draft_model": "", "num_speculative_tokens": "0"}
_FIXED_K = {"spec_adaptive": "false"}  # the speculative variants verify a fixed k every step
VARIANTS: dict[str, dict[str, str]] = {
    # Default-like, but a small token budget so that prompts longer than 64 tokens are prefilled in chunks.
    "llm": {**_FP32, "max_num_batched_tokens": "64", "max_num_seqs": "32"},
    # 40 blocks x 16 tokens = 640 tokens of KV: 24 concurrent requests must preempt.
    "llm_small_kv": {**_FP32, "kv_cache_blocks": "40", "block_size": "16", "max_num_seqs": "32"},
    # Two running sequences and at most four waiting requests: a flood is partly refused.
    "llm_small_queue": {**_FP32, "max_queue_size": "4", "max_num_seqs": "2"},
    # The `llm` settings without a prefix cache: the cold-cache baseline for prefix-caching tests.
    "llm_no_prefix_cache": {**_FP32, "max_num_batched_tokens": "64", "enable_prefix_caching": "false"},
    # Speculative decoding: the target's weights in bf16 as the draft, n-gram drafts, and a draft identical
    # to the target. A large spec_max_batch_size keeps speculation on under load.
    "llm_spec_draft": {
        **_FP32,
        **_FIXED_K,
        "max_num_batched_tokens": "64",
        "draft_model": "self",
        "draft_dtype": "bfloat16",
        "num_speculative_tokens": "3",
        "spec_max_batch_size": "32",
    },
    "llm_spec_ngram": {
        **_FP32,
        **_FIXED_K,
        "max_num_batched_tokens": "64",
        "draft_model": "ngram",
        "num_speculative_tokens": "3",
        "spec_max_batch_size": "32",
    },
    "llm_spec_same": {
        **_FP32,
        **_FIXED_K,
        "draft_model": "self",
        "draft_dtype": "float32",
        "num_speculative_tokens": "4",
    },
    # The default model repository as shipped (quantization auto: the GGUF blocks where our kernel runs;
    # adaptive n-gram speculation), with a small token budget (chunked prefill) and speculation kept on for
    # the whole concurrent set: held to the rule of what `auto` picks here (test_default_fidelity.py).
    "llm_default": {"max_num_batched_tokens": "64", "spec_max_batch_size": "32"},
    # Test-only faults (test_engine_faults.py): a step holding a request whose prompt carries the step marker
    # raises; one carrying the death marker kills the engine thread. One sequence per step: the others wait.
    "llm_faults": {
        **_FP32,
        "max_num_seqs": "1",
        "kv_cache_blocks": "64",
        "fault_injection": "step_error:<<FAIL THIS STEP>>,engine_death:<<KILL THE ENGINE>>",
    },
}

# Triton models the session's front door serves (the first is the one its batch view shows).
FRONTEND_MODELS = ("llm", "llm_small_queue", "llm_default")

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

    def wait_for(self, predicate: Callable[[Metrics], bool], timeout_s: float = 30.0, poll_s: float = 0.2) -> Metrics:
        """Scrape until predicate(metrics) holds; returns the last scrape (check the predicate again)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if predicate(m) or time.monotonic() >= deadline:
                return m
            time.sleep(poll_s)

    def settled_metrics(self, model: str = "llm", timeout_s: float = 10.0, interval_s: float = 0.15) -> Metrics:
        """A scrape that reflects every update the engine has made so far: the model publishes its metrics
        from a thread of its own every 100 ms, so scrape until two scrapes `interval_s` apart agree on all of
        `model`'s values."""
        deadline = time.monotonic() + timeout_s
        last = self.metrics()
        while True:
            time.sleep(interval_s)
            m = self.metrics()
            mine = {k: v for k, v in m.values.items() if ("model", model) in k[1]}
            if (
                mine == {k: v for k, v in last.values.items() if ("model", model) in k[1]}
                or time.monotonic() >= deadline
            ):
                return m
            last = m

    def wait_idle(self, model: str = "llm", timeout_s: float = 30.0) -> Metrics:
        """Wait until `model` runs nothing, has nothing waiting and holds no KV blocks."""
        if not self.metrics().has("llm_kv_cache_blocks_total", model):
            raise AssertionError(
                f"model {model!r} is not served (no metrics): add it to VARIANTS in "
                f"tests/integration/conftest.py (served: {sorted(self.variants)})"
            )
        return self.wait_for(lambda m: is_idle(m, model), timeout_s)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 80) -> str:
        return launcher.log_tail(self.log_path, lines)


def is_idle(m: Metrics, model: str) -> bool:
    return (
        m.get("llm_requests_running", model, default=-1) == 0
        and m.get("llm_requests_waiting", model, default=-1) == 0
        and m.get("llm_kv_cache_blocks_used", model, default=-1) == 0
    )


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> LLMServer:
    """The session's tritonserver with every model of VARIANTS loaded."""
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
    repository = write_model_repository(base / "model_repository", VARIANTS)
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
        launcher.wait_until_ready(ports[0], proc, float(os.environ.get("LLM_READY_TIMEOUT_S", "600")))
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
            proc, *ports, log_path, repository=repository, variants=VARIANTS, frontend=frontend, openai_port=openai_port
        )
        m = srv.metrics()
        missing = [name for name in VARIANTS if not m.has("llm_kv_cache_blocks_total", name)]
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
    """Once idle, no model of the session's server holds a KV block or a request, and the server is alive."""
    leaks = {}
    for model in server.variants:
        m = server.wait_idle(model, timeout_s=30)
        used = m.get("llm_kv_cache_blocks_used", model, default=-1)
        running = m.get("llm_requests_running", model, default=-1)
        waiting = m.get("llm_requests_waiting", model, default=-1)
        if (used, running, waiting) != (0, 0, 0):
            leaks[model] = dict(blocks_used=used, running=running, waiting=waiting)
        total = m.get("llm_kv_cache_blocks_total", model)
        free = m.get("llm_kv_cache_blocks_free", model)
        assert free == total or model in leaks, f"{model}: {free:.0f} free of {total:.0f} blocks while idle"
    assert not leaks, f"models not back to idle 30 s after the suite: {leaks}"
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
        from llm_testlib import REFERENCE_PREFETCH

        session_reference(tmp_path_factory).many(REFERENCE_PREFETCH, stop=stop)
    except Exception as exc:  # noqa: BLE001 - the tests compute (and report) it again
        sys.stderr.write(f"[integration] reference prefetch failed: {exc!r}\n")


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Reference:
    """HF greedy reference outputs: `reference.get(prompt, max_tokens)` / `reference.many(cases)`."""
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"no model at {MODEL_DIR}: run `make model`")
    return session_reference(tmp_path_factory)
