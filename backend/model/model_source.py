"""What the `model` parameter names, resolved to a folder every loader reads as a Hugging Face folder.

Accepted: a Hugging Face folder (config.json; weights as safetensors, or only its GGUF beside it as
`model.gguf`), a GGUF file, or a folder holding exactly one GGUF. A GGUF is served straight from the file: its
configuration, tokenizer and generation config are read from it once (transformers' GGUF loader, about 20 s for
the shipped model) into a folder of the cache, beside a link to the file as `model.gguf`; every later load (each
model instance, the draft, the tokenizer models, the front door) reads that folder. The weights are
de-quantized from the file at each load, as transformers does, and the file's blocks are what the low-bit kernels
serve (`gguf_weights.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_NAME = "model.gguf"
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


class ModelSourceError(ValueError):
    """`model` names nothing we can serve; the message says what is accepted."""


ACCEPTED = "a Hugging Face model folder (with config.json), a .gguf file, or a folder holding one .gguf file"


def cache_dir() -> Path:
    """`LLM_MODEL_CACHE`, else `.cache/models` in the checkout."""
    return Path(os.environ.get("LLM_MODEL_CACHE") or Path(__file__).resolve().parents[2] / ".cache" / "models")


def resolve(model: str | Path) -> Path:
    """The folder to load `model` from (see the module's docstring); raises ModelSourceError naming what is wrong."""
    gguf = locate(model)
    return Path(model).expanduser() if gguf is None else _prepared(gguf.resolve())


def has_gguf(model: str | Path) -> bool:
    """Whether `model` comes with GGUF blocks: a GGUF file, or a Hugging Face folder with its `model.gguf`."""
    return locate(model) is not None or (Path(model).expanduser() / GGUF_NAME).is_file()


def stored_in_16_bits(folder: str | Path) -> bool:
    """Whether a Hugging Face folder's safetensors hold every floating-point weight in bf16 or fp16 (their headers
    only are read)."""
    files = sorted(Path(folder).expanduser().glob("*.safetensors"))
    if not files:
        return False
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        if not dtypes & {"BF16", "F16"} or dtypes & {"F32", "F64"}:
            return False
    return True


def locate(model: str | Path) -> Path | None:
    """The GGUF file `model` names, None for a Hugging Face folder; raises ModelSourceError for anything else.
    Cheap (reads no file): what the configuration's validation runs."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelSourceError(f"model {str(model)!r} does not exist; give {ACCEPTED}")
    if path.is_dir() and (path / "config.json").is_file():
        return None
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) != 1:
            found = f"{len(files)} .gguf files ({', '.join(f.name for f in files)})" if files else "no config.json"
            raise ModelSourceError(f"model {str(model)!r}: {found}; give {ACCEPTED}")
        path = files[0]
    if path.suffix != ".gguf":
        raise ModelSourceError(f"model {str(model)!r} is not a .gguf file; give {ACCEPTED}")
    if _SPLIT.search(path.name):
        raise ModelSourceError(
            f"model {str(model)!r} is one part of a split GGUF, which is not supported: merge the parts into one "
            "file first (llama.cpp's `llama-gguf-split --merge`)"
        )
    return path


def has_weights(folder: Path) -> bool:
    """Whether a Hugging Face folder holds its weights (else they come from its GGUF)."""
    return any(next(folder.glob(pattern), None) for pattern in _WEIGHT_FILES)


def load_model(folder: str | Path, **kwargs):
    """`AutoModelForCausalLM.from_pretrained` for a resolved folder: its weights, or its GGUF's de-quantized."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    if has_weights(folder) or not (folder / GGUF_NAME).is_file():
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    config = AutoConfig.from_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, config=config, **kwargs)


def _prepared(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir() / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    log.info("reading the configuration and tokenizer of %s into %s", gguf, folder)
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_folder(gguf, tmp)
        tmp.rename(folder)  # atomic: loads side by side never read a half-written folder
    except OSError:
        if not (folder / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _write_folder(gguf: Path, folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ModelSourceError(f"model {str(gguf)!r}: transformers cannot read this GGUF ({exc})") from None
    if not getattr(config, "architectures", None):  # the GGUF loader leaves it empty
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    (folder / GGUF_NAME).symlink_to(gguf)
    (folder / "source.json").write_text(json.dumps({"gguf": str(gguf)}) + "\n")


def main(argv: list[str] | None = None) -> None:
    """`python -m backend.model.model_source MODEL`: prepare a GGUF's folder now and print the folder to load."""
    import sys

    logging.basicConfig(level=logging.INFO)
    try:
        print(resolve((argv if argv is not None else sys.argv[1:])[0]))
    except ModelSourceError as exc:
        sys.exit(str(exc))


if __name__ == "__main__":
    main()
