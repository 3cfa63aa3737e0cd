"""Model folders side by side in the front door's tokenizer tests: a folder made with a given
tokenizer_config.json, our ModelTokenizer and transformers' AutoTokenizer over it, and transformers' rendering of
a chat template (the `ours` and `theirs` fixtures of the served model's folder are in conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from frontend.tokenizer import ModelTokenizer
from launcher.paths import MODEL_DIR as SMOL_DIR

transformers = pytest.importorskip("transformers")

SPECIALS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}


def their_render(theirs, messages, tools=None, add_generation_prompt=True):
    return theirs.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def model_folder(tmp_path: Path, name: str, config: dict, files: dict[str, str] | None = None) -> Path:
    """The served model's tokenizer.json and config.json with this tokenizer_config.json and these files."""
    folder = tmp_path / name
    folder.mkdir()
    for file in ("tokenizer.json", "config.json"):
        shutil.copy(SMOL_DIR / file, folder / file)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend", **config}))
    for path, text in (files or {}).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return folder


def pair(folder: Path):
    return ModelTokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
