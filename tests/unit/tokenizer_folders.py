"""Model folders side by side in the tokenizer tests: a folder made with a given tokenizer_config.json, our
ModelTokenizer and transformers' AutoTokenizer over it, the texts both encode and the check that they encode them
the same, and transformers' rendering of a chat template (the `ours` and `theirs` fixtures of the served model's
folder are in conftest.py)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from frontend.tokenizer import ModelTokenizer
from launcher.paths import MODEL_DIR as SMOL_DIR

transformers = pytest.importorskip("transformers")

SPECIALS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
# Texts every tokenizer comparison encodes and decodes: spaces, scripts, emoji, special tokens whole and cut, long
TEXTS = [
    "",
    " ",
    "   ",
    "\n",
    "Hello, world!",
    "  leading and trailing  ",
    "line\nbreaks\r\nand\ttabs",
    "naïve café — “quotes” and ‘single’",
    "日本語のテキストと中文",
    "Привет, мир",
    "مرحبا بالعالم",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_start|><|im_end|>",
    "<repo_name>x<file_sep>y<filename>z",
    "<|im_start",
    "im_end|>",
    "a<|im_end|>b",
    " <|im_end|> ",
    "12345 3.14159 -7e10",
    "def f(x):\n    return x ** 2\n",
    "\u0000 nul \u200b zero width \ufeff bom",
    "ﬁ ligature Ω ohm Å angstrom",
    "don't won't I'm they've we're",
    "Hello , world . Why ? Yes ! I 'm ok",
    "{{ not a template }} {% raw %}",
    "x" * 3000,
    "word " * 500,
]


def assert_same_encoding(ours, theirs, add_special_tokens: bool) -> None:
    """TEXTS and 200 random strings encode the same by `ours` and transformers' `theirs`."""
    rng = random.Random(0)
    alphabet = "ab Z9\n\t.,<|>_é中😀\u0301 " + "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(60))
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80))) for _ in range(200)]
    for text in texts:
        assert (
            ours.encode(text, add_special_tokens=add_special_tokens)
            == theirs(text, add_special_tokens=add_special_tokens).input_ids
        ), text


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
