"""The command lines (argv and environment) that run tritonserver and the OpenAI-compatible front door.
Standard library only."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from launcher.paths import BACKEND_DIR, DEFAULT_HOST, LIBS_REL, MODEL_NAME, REPO_ROOT, TRITON_REL, VENV, site_packages

# Triton APIs that change or expose the server beyond inference; the launch restricts them to requests that
# carry the header `llm-admin-key: $LLM_ADMIN_KEY` (a random key when the variable is unset: only the front door,
# started from the same launch, knows it; it reads the model's settings with it).
RESTRICTED_APIS = ("model-repository", "model-config", "shared-memory", "trace", "logging")
ADMIN_HEADER = "llm-admin-key"


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
    venv's packages through the ``python`` on PATH), and puts the checkout on PYTHONPATH (so a model can
    ``import backend`` from a venv without the editable install). With ``restrict_apis`` the APIs of
    RESTRICTED_APIS answer only requests that carry the ``llm-admin-key`` header with the value of
    ``$LLM_ADMIN_KEY`` (loading and unloading models among them: the server runs in explicit model-control mode).
    """
    venv = Path(venv) if venv is not None else VENV
    sp = site_packages(venv)
    backend_dir = Path(backend_dir) if backend_dir is not None else BACKEND_DIR
    argv = [
        str(sp / TRITON_REL),
        "--model-repository",
        str(Path(model_repository).resolve()),
        "--backend-directory",
        str(backend_dir.resolve()),
        "--http-address",
        host,
        "--http-port",
        str(int(http_port)),
        "--grpc-address",
        host,
        "--grpc-port",
        str(int(grpc_port)),
        "--metrics-address",
        host,
        "--metrics-port",
        str(int(metrics_port)),
        "--log-verbose",
        str(int(log_verbose)),
        "--exit-timeout-secs",
        str(int(exit_timeout_s)),
        # Explicit model control, every model loaded at start: a model whose engine died unloads itself, so that
        # its ready endpoint and the server's say not ready at once (model_repository/llm/1/model.py).
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        # Triton's CPU-metrics thread sleeps this long between polls and is joined at exit: at its default
        # (2000 ms) an idle stop took up to 2 s longer (measured 2.9 s vs 2.0 s for one model).
        "--metrics-interval-ms",
        "200",
        *(restriction_args() if restrict_apis else []),
        *extra_args,
    ]
    env = dict(os.environ)
    env.pop("PYTHONHOME", None)  # would point the embedded interpreter at another stdlib
    env["LD_LIBRARY_PATH"] = _prepend(str(sp / LIBS_REL), env.get("LD_LIBRARY_PATH"))
    env["PATH"] = _prepend(str(venv / "bin"), env.get("PATH") or os.defpath)
    env["PYTHONPATH"] = _prepend(str(REPO_ROOT), env.get("PYTHONPATH"))
    env["VIRTUAL_ENV"] = str(venv)
    return argv, env


def restriction_args() -> list[str]:
    """tritonserver's flags that restrict RESTRICTED_APIS to the admin key (made up once per launch when unset,
    in this process's environment, so that the front door started after it inherits it)."""
    if not os.environ.get("LLM_ADMIN_KEY"):
        os.environ["LLM_ADMIN_KEY"] = secrets.token_urlsafe(24)
    key = os.environ["LLM_ADMIN_KEY"]
    restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={key}"
    return [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]


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
    argv = [
        str(venv / "bin" / "python"),
        "-m",
        "frontend",
        "--triton-grpc",
        grpc_url,
        "--triton-metrics",
        metrics_url,
        "--host",
        host,
        "--port",
        str(int(port)),
    ]
    if model_dir is not None:
        argv += ["--model-dir", str(model_dir)]
    for name in models:
        argv += ["--served-model-name", name]
    return argv + list(extra_args)


def check_ready_to_run(argv: list[str]) -> None:
    """FileNotFoundError naming the make target when the backend directory or the model repository is missing."""
    stub = Path(argv[argv.index("--backend-directory") + 1]) / "python" / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"{stub} is missing: run `make triton` to assemble the backend directory")
    repo = Path(argv[argv.index("--model-repository") + 1])
    if not repo.is_dir():
        raise FileNotFoundError(f"model repository {repo} does not exist")


def shown(cmd: list[str]) -> str:
    """The command line with the admin key masked."""
    return re.sub(rf"({ADMIN_HEADER}=)\S+", r"\1***", " ".join(cmd))


def _prepend(item: str, pathlist: str | None) -> str:
    parts = [p for p in (pathlist or "").split(os.pathsep) if p and p != item]
    return os.pathsep.join([item, *parts])
