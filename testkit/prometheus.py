"""The one Prometheus text-format (exposition format 0.0.4) parser of the tests, benchmarks and load tests.

A scrape parses into {(name, frozenset of (label, value) pairs): value}; `value` looks one series up by its exact
labels, `samples` finds every series whose labels include the given ones, and `scrape(url)` fetches and parses.

    metrics = scrape("http://127.0.0.1:8002/metrics")
    value(metrics, "llm_requests_running", model="llm", version="1")       # nan when absent
    samples(metrics, "llm_kv_cache_usage_ratio", model="llm")              # [v, ...]
"""

from __future__ import annotations

import math
import re
import urllib.request

MetricKey = tuple[str, frozenset[tuple[str, str]]]  # (name, frozenset of (label, value))
Metrics = dict[MetricKey, float]

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPE_RE = re.compile(r"\\(.)")
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}


def _unescape(text: str) -> str:
    return _ESCAPE_RE.sub(lambda m: _ESCAPES.get(m.group(1), m.group(0)), text)


def parse_prometheus(text: str) -> Metrics:
    """Prometheus text format -> {(name, frozenset(labels.items())): value}.

    Comments (# HELP, # TYPE) and blank lines are skipped, as is a sample whose value does not parse; label
    values are unescaped (\\\\, \\", \\n); a timestamp after the value is ignored; NaN and +Inf/-Inf parse as
    floats. A series that appears twice keeps its last value.
    """
    out: Metrics = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        if not match:
            continue
        name, labels, number = match.groups()
        pairs = frozenset((key, _unescape(val)) for key, val in _LABEL_RE.findall(labels or ""))
        try:
            out[(name, pairs)] = float(number)
        except ValueError:
            continue
    return out


def key(name: str, **labels: str) -> MetricKey:
    """The MetricKey of series `name` with exactly `labels`."""
    return name, frozenset(labels.items())


def value(metrics: Metrics, name: str, default: float | None = math.nan, **labels: str) -> float | None:
    """The value of series `name` with exactly `labels` (Triton's carry model and version), `default` if absent."""
    return metrics.get(key(name, **labels), default)


def samples(metrics: Metrics, name: str, **labels: str) -> list[float]:
    """The values of every series `name` whose labels include `labels` (as a PromQL selector matches them)."""
    wanted = set(labels.items())
    return [v for (n, pairs), v in metrics.items() if n == name and wanted <= pairs]


def fetch(url: str, timeout_s: float = 10.0) -> str:
    """The text of a metrics endpoint (OSError when it cannot be read)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode("utf-8")


def scrape(url: str, timeout_s: float = 10.0) -> Metrics:
    """GET a metrics endpoint and parse it (OSError when it cannot be read)."""
    return parse_prometheus(fetch(url, timeout_s))
