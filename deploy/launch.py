"""The container's entry point: the supervised launch (llm-serve, launcher/serve.py: tritonserver and the OpenAI
front door, as `make serve`), with engine parameters taken from the environment.

Each `LLM_PARAM_<NAME>=<value>` sets the parameter `<name>` (lower case) of every model in the repository: the
Deployment sets LLM_PARAM_NUM_THREADS from the container's CPU limit, so torch runs as many threads as the pod
may use rather than one per core of the node; the GPU overlay sets LLM_PARAM_DEVICE=cuda and
LLM_PARAM_DTYPE=bfloat16. The repository (--model-repository, default model_repository/) is then written with
those values under $LLM_RUNTIME_DIR (default /tmp/llm): each model's config.pbtxt with the parameters set (a
relative `model` path made absolute, since it was relative to the original folder) and everything else linked to
the original. Without any LLM_PARAM_ variable the repository is served as it is.

Every other argument goes to llm-serve, which replaces this process (exec): the container's SIGTERM
reaches llm-serve, which stops the front door and tritonserver together (each finishes its streams first).

    python -m deploy.launch --openai-host=0.0.0.0 [llm-serve options]

Standard library only, like the launcher.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from launcher.model_config import set_parameter, with_absolute_model
from launcher.paths import REPO_ROOT

PREFIX = "LLM_PARAM_"


def overrides(environ: dict[str, str]) -> dict[str, str]:
    """{parameter: value} of the LLM_PARAM_* variables."""
    return {k[len(PREFIX) :].lower(): v for k, v in sorted(environ.items()) if k.startswith(PREFIX) and v}


def write_repository(source: Path, target: Path, params: dict[str, str]) -> Path:
    """`source` with `params` set in every model's config.pbtxt, written to `target` (replaced)."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for model in sorted(p for p in source.iterdir() if (p / "config.pbtxt").is_file()):
        (target / model.name).mkdir()
        for entry in model.iterdir():
            if entry.name != "config.pbtxt":
                (target / model.name / entry.name).symlink_to(entry.resolve())
        text = (model / "config.pbtxt").read_text()
        for key, value in params.items():
            text = set_parameter(text, key, value)
        (target / model.name / "config.pbtxt").write_text(with_absolute_model(text, model))
    return target


def split_repository_arg(argv: list[str]) -> tuple[Path, list[str]]:
    """(the --model-repository given, or the default; the other arguments)."""
    repo, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--model-repository" and i + 1 < len(argv):
            repo, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--model-repository="):
            repo = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    path = Path(repo or os.environ.get("MODEL_REPOSITORY") or REPO_ROOT / "model_repository")
    return (path if path.is_absolute() else (Path.cwd() / path)).resolve(), rest


def main(argv: list[str] | None = None) -> None:
    repo, rest = split_repository_arg(sys.argv[1:] if argv is None else argv)
    params = overrides(dict(os.environ))
    if params:
        runtime = Path(os.environ.get("LLM_RUNTIME_DIR") or "/tmp/llm")
        repo = write_repository(repo, runtime / "model_repository", params)
        print(f"[launch] engine parameters from the environment: {params}; repository {repo}", flush=True)
    command = [sys.executable, "-m", "launcher.serve", "--model-repository", str(repo), *rest]
    print("[launch] " + " ".join(command), flush=True)
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
