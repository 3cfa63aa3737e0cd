"""Where the launch finds things: the checkout, its virtual environment, the Triton backend directory and the
tritonserver binary inside the nvidia-pytriton wheel. Standard library only."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("LLM_VENV") or (REPO_ROOT / ".venv"))
if not VENV.is_absolute():
    VENV = (REPO_ROOT / VENV).resolve()
BACKEND_DIR = REPO_ROOT / ".triton" / "backends"
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"  # the default model, as `make model` prepares it
DEFAULT_HOST = "127.0.0.1"  # where the server binds and where readiness is polled
MODEL_NAME = "llm"

TRITON_REL = Path("pytriton") / "tritonserver" / "bin" / "tritonserver"
LIBS_REL = Path("nvidia_pytriton.libs")


def site_packages(venv: Path | str | None = None) -> Path:
    """The site-packages directory of ``venv`` that holds nvidia-pytriton's ``tritonserver``.

    Looks at ``lib*/python3*/site-packages`` first (no subprocess); falls back to asking the venv's
    interpreter. Raises FileNotFoundError with a hint when nothing fits.
    """
    venv = Path(venv) if venv is not None else VENV
    candidates = sorted(venv.glob("lib*/python3*/site-packages"))
    for sp in candidates:
        if (sp / TRITON_REL).is_file():
            return sp
    py = venv / "bin" / "python"
    if py.exists():
        try:
            out = subprocess.run(
                [
                    str(py),
                    "-c",
                    "import sysconfig, json; p = sysconfig.get_paths();"
                    " print(json.dumps([p['purelib'], p['platlib']]))",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
            for sp in map(Path, json.loads(out)):
                if (sp / TRITON_REL).is_file():
                    return sp
        except (subprocess.SubprocessError, OSError, ValueError):
            pass
    raise FileNotFoundError(
        f"no pytriton/tritonserver/bin/tritonserver in the virtual environment {venv} "
        f"(looked in {[str(c) for c in candidates] or 'lib*/python3*/site-packages'}); run `make venv` "
        "or point LLM_VENV at a venv with nvidia-pytriton installed"
    )


def url_host(host: str) -> str:
    """The address to reach a server bound to ``host`` (loopback for a wildcard; brackets for IPv6)."""
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def resolve_model_repository(path: Path | str) -> Path:
    """``path`` as given, or under the checkout when it is relative and only exists there."""
    repo = Path(path)
    if not repo.is_absolute() and not repo.exists() and (REPO_ROOT / repo).exists():
        return REPO_ROOT / repo
    return repo
