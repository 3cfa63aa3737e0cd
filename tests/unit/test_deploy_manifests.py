"""The Kubernetes manifests under deploy/, checked without a cluster (deploy/check.py): every overlay renders with
`kubectl kustomize`, every core object validates against the Kubernetes schemas of check.KUBERNETES_VERSIONS
(kubernetes-validate, strict), the objects agree with each other, and yamllint passes; plus the container entry
point's parameter overrides (deploy/launch.py).

The tools come from requirements.txt (`make venv`). A missing tool is a failure that says how to get it, never a
skip. tests/integration/test_deploy_probes.py calls the probe paths and metric names the manifests name on the real
server.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy import check, launch
from launcher.model_config import get_parameter
from launcher.paths import REPO_ROOT
from tests.unit.model_configs import CONFIG

OVERLAYS = {p.name: p for p in check.overlays()}


def _tool(getter):
    try:
        return getter()
    except check.ToolMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def kubectl() -> str:
    return _tool(check.kubectl)


@pytest.fixture(scope="module")
def rendered(kubectl) -> dict[str, check.Rendered]:
    return {name: check.render(path, kubectl) for name, path in OVERLAYS.items()}


def test_the_overlays_are_there():
    assert {"cpu", "gpu", "inference-gateway"} <= set(OVERLAYS), sorted(OVERLAYS)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_renders_and_validates(rendered, overlay):
    r = rendered[overlay]
    kinds = {o["kind"] for o in r.objects}
    assert {
        "Namespace",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
        "NetworkPolicy",
    } <= kinds, kinds
    assert all(o["metadata"].get("namespace") == "llm" for o in r.objects if o["kind"] != "Namespace")
    errors, custom = _tool(lambda: check.validate(r))
    assert not errors, "\n".join(errors)
    # Only the custom resources go unvalidated by the Kubernetes schema (they are cross-checked instead).
    assert {c.split("/")[0] for c in custom} <= {"ServiceMonitor", "InferencePool", "HTTPRoute"}, custom


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_objects_agree_with_each_other(rendered, overlay):
    problems = check.cross_check(rendered[overlay])
    assert not problems, "\n".join(problems)


def test_yamllint():
    problems = _tool(check.lint)
    assert not problems, "\n".join(problems)
    assert len(check.yaml_files()) >= 15


def test_schema_validation_catches_a_mistake(rendered):
    r = copy.deepcopy(rendered["cpu"])
    container = r.one("Deployment", check.MODEL_SERVER)["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")  # a misspelt field
    errors, _ = check.validate(r, versions=check.KUBERNETES_VERSIONS[:1])
    assert any("readinesProbe" in e for e in errors), errors


@pytest.mark.parametrize(
    "mistake",
    ["pool_port", "hpa_metric", "engine_label", "triton_exposed", "grace", "legacy_flag", "liveness_on_triton"],
)
def test_cross_check_catches_a_mistake(rendered, mistake):
    r = copy.deepcopy(rendered["inference-gateway"])
    deployment = r.one("Deployment", check.MODEL_SERVER)
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    if mistake == "pool_port":
        r.one("InferencePool")["spec"]["targetPorts"] = [{"number": 8000}]
    elif mistake == "hpa_metric":
        r.one("HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"] = "llm_queue"
    elif mistake == "engine_label":
        pod["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] = "vllm"
    elif mistake == "triton_exposed":
        container["ports"].append({"name": "triton-http", "containerPort": 8000})
    elif mistake == "grace":
        pod["spec"]["terminationGracePeriodSeconds"] = 30
    elif mistake == "legacy_flag":
        r.one("Deployment", "triton-llm-epp")["spec"]["template"]["spec"]["containers"][0]["args"].append(
            "--total-queued-requests-metric=llm_requests_waiting"
        )
    elif mistake == "liveness_on_triton":
        container["livenessProbe"] = {"httpGet": {"path": "/v2/health/ready", "port": 8000}}
    assert check.cross_check(r), f"{mistake} went unnoticed"


def test_the_epp_names_our_gauges(rendered):
    specs = check.epp_metric_specs(check.epp_config(rendered["inference-gateway"]))
    assert specs["triton-llm"] == {
        "queuedRequestsSpec": 'llm_requests_waiting{model="llm"}',
        "runningRequestsSpec": 'llm_requests_running{model="llm"}',
        "kvUsageSpec": 'llm_kv_cache_usage_ratio{model="llm"}',
        "loraSpec": 'llm_lora_requests_info{model="llm"}',
    }
    from backend.core.metrics import GAUGES, INFOS

    for spec in specs["triton-llm"].values():
        assert spec.split("{")[0] in {**GAUGES, **INFOS}, spec


def test_the_adapter_rule_names_an_engine_gauge():
    from backend.core.metrics import GAUGES

    for rule in check.adapter_rules():
        series = rule["seriesQuery"].split("{")[0].strip("'\"")
        assert series in GAUGES and rule["name"]["as"] == series, rule
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_gpu_overlay_asks_for_a_gpu_and_sets_the_dtype(rendered):
    container = rendered["gpu"].one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LLM_PARAM_DEVICE"] == "cuda" and env["LLM_PARAM_DTYPE"] == "bfloat16"
    assert "UNTESTED" in (check.OVERLAYS / "gpu" / "kustomization.yaml").read_text()


def test_check_module_runs_as_a_command():
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.check"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "yamllint:" in proc.stdout and "validated against Kubernetes" in proc.stdout


# --------------------------------------------------------------------------------------------- deploy/launch.py


def test_overrides_come_from_llm_param_variables():
    env = {"LLM_PARAM_NUM_THREADS": "4", "LLM_PARAM_DTYPE": "bfloat16", "LLM_PARAM_EMPTY": "", "PATH": "/bin"}
    assert launch.overrides(env) == {"dtype": "bfloat16", "num_threads": "4"}


def test_write_repository_links_the_model_and_makes_its_path_absolute(tmp_path):
    source = tmp_path / "repo"
    (source / "llm" / "1").mkdir(parents=True)
    (source / "llm" / "1" / "model.py").write_text("# model\n")
    (source / "llm" / "config.pbtxt").write_text(CONFIG)
    (source / "README").write_text("not a model\n")
    target = launch.write_repository(source, tmp_path / "out" / "model_repository", {"num_threads": "2"})
    assert sorted(p.name for p in target.iterdir()) == ["llm"]
    assert (target / "llm" / "1").is_symlink() and (target / "llm" / "1" / "model.py").read_text() == "# model\n"
    text = (target / "llm" / "config.pbtxt").read_text()
    assert get_parameter(text, "num_threads") == "2"
    assert get_parameter(text, "model") == str((source / "llm" / "../../models/m").resolve())
    launch.write_repository(source, target, {})  # rewritten in place on the next start


def test_split_repository_arg():
    repo, rest = launch.split_repository_arg(["--openai-host=0.0.0.0", "--model-repository", "/r", "--x"])
    assert repo == Path("/r") and rest == ["--openai-host=0.0.0.0", "--x"]
    repo, _ = launch.split_repository_arg(["--model-repository=/s"])
    assert repo == Path("/s")
    repo, _ = launch.split_repository_arg([])
    assert repo == REPO_ROOT / "model_repository"


def test_the_image_runs_the_launch_the_deployment_runs(rendered):
    containerfile = (check.DEPLOY / "Containerfile").read_text()
    container = rendered["cpu"].one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert f'"{container["command"][-1]}"' in containerfile
    assert "make setup" in containerfile and "USER 10001" in containerfile
    security = rendered["cpu"].one("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsUser"] == 10001 and security["runAsNonRoot"] is True
    manifest = yaml.safe_load((check.DEPLOY / "base" / "deployment.yaml").read_text())
    assert manifest["spec"]["template"]["spec"]["containers"][0]["image"] == "triton-llm:cpu"
