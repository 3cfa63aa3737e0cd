"""The names the Kubernetes manifests rely on, called on the session's real server (tritonserver + the front door
from the `server` fixture): every probe path of the Deployment, the ServiceMonitor's scrape path, the metric
names (and labels) the endpoint picker's configuration, the HorizontalPodAutoscaler and the Prometheus Adapter
rule read. A renamed endpoint or metric fails here, not in a cluster.

The manifests are rendered with `kubectl kustomize` (deploy/check.py; the tools come from requirements.txt and a
missing one fails the test). The Deployment's ports (Triton 8000/8001/8002 on loopback, the front door 9000) are
mapped onto the session server's ports by the launch arguments that name them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest

from deploy import check
from testkit.prometheus import parse_prometheus, samples

_URL_RE = re.compile(r"http://127\.0\.0\.1:(\d+)(/[^\s'\"]*)")


@pytest.fixture(scope="module")
def manifests() -> dict[str, check.Rendered]:
    try:
        binary = check.kubectl()
    except check.ToolMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    return {name: check.render(check.OVERLAYS / name, binary) for name in ("cpu", "inference-gateway")}


@pytest.fixture(scope="module")
def ports(server, manifests) -> dict[int, int]:
    """Pod port -> the session server's port."""
    named = check.server_ports(manifests["cpu"].one("Deployment", check.MODEL_SERVER))
    actual = {
        "http": server.http_port,
        "grpc": server.grpc_port,
        "metrics": server.metrics_port,
        "openai": server.openai_port,
    }
    return {named[k]: actual[k] for k in actual}


@pytest.fixture(scope="module")
def container(manifests) -> dict:
    return manifests["cpu"].one("Deployment", check.MODEL_SERVER)["spec"]["template"]["spec"]["containers"][0]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def probe_urls(probe: dict, container: dict) -> list[tuple[int, str]]:
    """(pod port, path) of every endpoint a probe calls: an httpGet's, or each URL in an exec command."""
    if "httpGet" in probe:
        port = probe["httpGet"]["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
        return [(port, probe["httpGet"]["path"])]
    command = " ".join(probe["exec"]["command"])
    return [(int(port), path) for port, path in _URL_RE.findall(command)]


@pytest.mark.parametrize("kind", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_probe_paths_answer_200(server, container, ports, kind):
    urls = probe_urls(container[kind], container)
    assert urls, f"{kind} calls no URL: {container[kind]}"
    for port, path in urls:
        assert port in ports, f"{kind} calls port {port}, which the launch does not open ({sorted(ports)})"
        status, body = get(ports[port], path)
        assert status == 200, f"{kind}: GET {path} on the pod's port {port} answered {status}: {body[:300]}"


def test_readiness_names_both_the_front_door_and_triton(container):
    paths = {path for _, path in probe_urls(container["readinessProbe"], container)}
    assert paths == {"/health/ready", "/v2/health/ready"}, paths


def test_exec_probes_run_as_written(server, container, ports):
    """The probe's own shell command, with the pod's ports swapped for the session's (curl is in the image;
    where this machine has none, the GETs above stand for it)."""
    if shutil.which("curl") is None:
        return
    for kind in ("startupProbe", "readinessProbe"):
        command = container[kind]["exec"]["command"]
        script = _URL_RE.sub(lambda m: f"http://127.0.0.1:{ports[int(m.group(1))]}{m.group(2)}", command[-1])
        proc = subprocess.run([*command[:-1], script], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"{kind}: {script!r} exited {proc.returncode}: {proc.stderr}"


@pytest.fixture(scope="module")
def scraped(server, manifests, ports) -> str:
    """The front door's /metrics, through the port and path the ServiceMonitor names."""
    rendered = manifests["cpu"]
    service = rendered.one("Service", check.MODEL_SERVER)
    endpoint = rendered.one("ServiceMonitor")["spec"]["endpoints"][0]
    target = next(p["targetPort"] for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    container = rendered.one("Deployment", check.MODEL_SERVER)["spec"]["template"]["spec"]["containers"][0]
    pod_port = next(p["containerPort"] for p in container["ports"] if p["name"] == target)
    server.wait_idle("llm")
    status, text = get(ports[pod_port], endpoint["path"])
    assert status == 200, text[:300]
    return text


def _selector(spec: str) -> tuple[str, dict[str, str]]:
    """PromQL instant-vector selector -> (name, labels)."""
    name, _, rest = spec.partition("{")
    labels = dict(re.findall(r'(\w+)\s*=\s*"?([^",}]+)"?', rest))
    return name.strip(), labels


def _samples(text: str, name: str, labels: dict[str, str]) -> list[float]:
    return samples(parse_prometheus(text), name, **labels)


def test_scrape_is_one_valid_exposition(scraped):
    """The endpoint picker's parser (Prometheus' text format) refuses a family declared twice."""
    types = re.findall(r"^# TYPE (\S+)", scraped, re.MULTILINE)
    assert len(types) == len(set(types)), sorted({t for t in types if types.count(t) > 1})
    assert "frontdoor_requests_total" in types and "llm_requests_waiting" in types


def test_endpoint_picker_metrics_are_served(scraped, manifests):
    specs = check.epp_metric_specs(check.epp_config(manifests["inference-gateway"]))
    assert specs, "no engineConfigs in the endpoint picker's configuration"
    for engine, fields in specs.items():
        for field, spec in fields.items():
            name, labels = _selector(spec)
            values = _samples(scraped, name, labels)
            assert len(values) == 1, f"{engine}.{field} = {spec}: {len(values)} matching samples on /metrics"
            assert values[0] >= 0
    name, labels = _selector(specs["triton-llm"]["kvUsageSpec"])
    ratio = _samples(scraped, name, labels)[0]
    used = _samples(scraped, "llm_kv_cache_blocks_used", labels)[0]
    total = _samples(scraped, "llm_kv_cache_blocks_total", labels)[0]
    assert 0.0 <= ratio <= 1.0 and total > 0 and ratio == pytest.approx(used / total), (ratio, used, total)


def test_autoscaler_metric_is_served(scraped, manifests):
    hpa = manifests["cpu"].one("HorizontalPodAutoscaler")
    for rule in check.adapter_rules():
        series, labels = _selector(rule["seriesQuery"].strip("'\""))
        # namespace and pod are added by Prometheus at scrape time, not by the server.
        labels = {k: v for k, v in labels.items() if k not in ("namespace", "pod")}
        assert _samples(scraped, series, labels), f"the adapter rule's series {series} is not on /metrics"
        assert re.fullmatch(rule["name"]["matches"], series)
    exposed = {rule["name"]["as"] for rule in check.adapter_rules()}
    for metric in hpa["spec"]["metrics"]:
        name = metric["pods"]["metric"]["name"]
        assert name in exposed and _samples(scraped, name, {"model": "llm"}), name


def test_readiness_body_reports_the_models(server, ports, container):
    port = next(p for p, path in probe_urls(container["readinessProbe"], container) if path == "/health/ready")
    status, body = get(ports[port], "/health/ready")
    assert status == 200 and '"llm": true' in body, body
