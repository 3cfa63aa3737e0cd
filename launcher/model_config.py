"""Engine parameters in a model's config.pbtxt: read them, set one, and write a model repository of variants of a
model (each under its own name with its own parameters), as the container's launch, the integration tests and the
benchmarks do. Standard library only; values are plain strings (Triton's `string_value`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from launcher.paths import DEFAULT_MODEL_REPOSITORY, REPO_ROOT, VENV

_ENTRY = r'\{{\s*key:\s*"{key}"\s*,\s*value:\s*\{{\s*string_value:\s*"([^"]*)"\s*\}}\s*\}}'
_ANY_ENTRY = re.compile(_ENTRY.format(key='([^"]+)'))  # (key, value)


def get_parameter(config_text: str, key: str) -> str | None:
    """The value of parameter `key`, or None when the config does not set it."""
    match = re.search(_ENTRY.format(key=re.escape(key)), config_text)
    return match.group(1) if match else None


def set_parameter(config_text: str, key: str, value: str) -> str:
    """config.pbtxt text with parameter `key` set to `value` (replaced where present, else added)."""
    if '"' in value or "\\" in value:
        raise ValueError(f"parameter {key}: quotes and backslashes are not supported in values ({value!r})")
    entry = f'{{ key: "{key}", value: {{ string_value: "{value}" }} }}'
    pattern = re.compile(_ENTRY.format(key=re.escape(key)))
    if pattern.search(config_text):
        return pattern.sub(lambda _: entry, config_text, count=1)
    block = re.search(r"^parameters\s*\[[ \t]*\n?", config_text, re.MULTILINE)
    if block is None:
        return config_text.rstrip() + f"\n\nparameters [\n  {entry}\n]\n"
    return config_text[: block.end()] + f"  {entry},\n" + config_text[block.end() :]


def with_absolute_model(config_text: str, model_dir: Path) -> str:
    """The config with a relative `model` path (relative to the model's folder `model_dir`) made absolute."""
    path = get_parameter(config_text, "model")
    if path and not Path(path).is_absolute():
        return set_parameter(config_text, "model", str((Path(model_dir) / path).resolve()))
    return config_text


def read_parameters(config_path: Path = DEFAULT_MODEL_REPOSITORY / "llm" / "config.pbtxt") -> dict[str, str]:
    """Every engine parameter (key -> value) of a config.pbtxt, `model` made absolute."""
    text = with_absolute_model(Path(config_path).read_text(), Path(config_path).parent)
    return dict(_ANY_ENTRY.findall(text))


def served_model_folder(config_path: Path) -> Path:
    """The folder holding the tokenizer and chat template of the model a config.pbtxt serves (what the front door
    reads): its `model` folder, or for a GGUF file the folder the engine prepares from it, prepared now (by the
    engine's own code, in a subprocess: the launcher imports none of it), so that tritonserver finds it ready."""
    model = Path(read_parameters(config_path)["model"])
    if model.is_dir() and (model / "config.json").is_file():
        return model
    done = subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "backend.model.model_source", str(model)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise ValueError(f"{config_path}: parameter 'model': {done.stderr.strip().splitlines()[-1]}")
    return Path(done.stdout.strip().splitlines()[-1])


# The models of model_repository/ that serve TensorRT-LLM's client contract beside `llm` (no weights of their own):
# four forward to `llm`, two run `llm`'s tokenizer.
TENSORRT_LLM_MODELS = (
    "ensemble",
    "tensorrt_llm_bls",
    "tensorrt_llm",
    "tensorrt_llm_core",
    "preprocessing",
    "postprocessing",
)


def write_model_repository(
    root: Path, variants: dict[str, dict[str, str]], source: Path = DEFAULT_MODEL_REPOSITORY / "llm"
) -> Path:
    """A model repository under `root` with one model per variant: `source`'s config.pbtxt under the variant's
    name with its parameter overrides (`model` made absolute), `source`'s 1/model.py linked; with a variant named
    `llm`, the TENSORRT_LLM_MODELS found beside `source` too, their `tokenizer_dir` the `llm` variant's model.
    Returns `root`."""
    base = with_absolute_model((source / "config.pbtxt").read_text(), source)
    for name, overrides in variants.items():
        text, count = re.subn(r'^name:\s*"[^"]*"', f'name: "{name}"', base, count=1, flags=re.MULTILINE)
        if count != 1:
            raise ValueError(f"no top-level name: in {source / 'config.pbtxt'}")
        for key, value in overrides.items():
            text = set_parameter(text, key, str(value))
        version = root / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        link = version / "model.py"
        if not link.exists():
            link.symlink_to((source / "1" / "model.py").resolve())
        (root / name / "config.pbtxt").write_text(text)
    for name in TENSORRT_LLM_MODELS:  # TensorRT-LLM's model names, serving through the variant named `llm`
        if "llm" in variants and (source.parent / name).is_dir() and not (root / name).exists():
            (root / name / "1").mkdir(parents=True)
            text = (source.parent / name / "config.pbtxt").read_text()
            if get_parameter(text, "tokenizer_dir") is not None:
                text = set_parameter(
                    text, "tokenizer_dir", get_parameter((root / "llm" / "config.pbtxt").read_text(), "model")
                )
            (root / name / "config.pbtxt").write_text(text)
            (root / name / "1" / "model.py").symlink_to((source.parent / name / "1" / "model.py").resolve())
    return root
