"""backend/protocol/text_tokenizer.py (tokenizers, no transformers: what TensorRT-LLM's preprocessing and
postprocessing models load) against transformers' AutoTokenizer: encoding with and without special tokens,
decoding with special tokens kept and skipped, the special tokens' ids (end and pad among them) and the length,
for the served model's folder, the tiny models the tests make, and folders made here (no pad token, the legacy
special_tokens_map.json, clean-up of decoded spaces, split special tokens)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from backend.protocol.text_tokenizer import SPECIAL_TOKEN_NAMES, TextTokenizer
from backend.serving.trtllm_tokenizer import special_ids
from launcher.paths import MODEL_DIR as SMOL_DIR
from tests.unit.tokenizer_folders import SPECIALS, TEXTS, assert_same_encoding, model_folder

transformers = pytest.importorskip("transformers")
if not (SMOL_DIR / "tokenizer.json").exists():
    pytest.skip(f"no tokenizer at {SMOL_DIR} (make model)", allow_module_level=True)

# name -> (tokenizer_config.json, other files) of a folder made from the served model's tokenizer.json
MADE = {
    "no_pad_token": (SPECIALS, {}),
    "legacy_special_tokens_map": (
        {"model_max_length": 8192},
        {"special_tokens_map.json": json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})},
    ),
    "clean_up_spaces": (
        {
            **SPECIALS,
            "clean_up_tokenization_spaces": True,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True,
        },
        {},
    ),
    "split_special_tokens": ({**SPECIALS, "pad_token": "<|endoftext|>", "split_special_tokens": True}, {}),
}


@pytest.fixture(scope="module", params=["served", "tiny_llama", "tiny_gpt2", *MADE])
def both(request, tmp_path_factory):
    """(ours, transformers') of one folder."""
    if request.param == "served":
        folder = SMOL_DIR
    elif request.param.startswith("tiny_"):
        folder = Path(request.getfixturevalue("tiny_model_factory")(request.param.removeprefix("tiny_")))
    else:
        config, files = MADE[request.param]
        folder = model_folder(tmp_path_factory.mktemp("text-tokenizer"), request.param, config, files)
    return TextTokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode(both, add_special_tokens):
    assert_same_encoding(*both, add_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode(both, skip_special_tokens):
    ours, theirs = both
    rng = random.Random(1)
    special = list(theirs.added_tokens_decoder)
    size = len(theirs)
    cases = [theirs(text).input_ids for text in TEXTS]
    cases += [
        [rng.choice(special) if rng.random() < 0.2 else rng.randrange(size) for _ in range(rng.randrange(0, 40))]
        for _ in range(200)
    ]
    cases += [[], [0], [1, 2], [size - 1, 0, 1], [size], [5, size + 100, 6]]
    for ids in cases:
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == theirs.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), ids
    assert ours.decode(cases[0]) == theirs.decode(cases[0])  # both keep special tokens by default


def test_special_token_ids_and_length(both):
    ours, theirs = both
    assert (ours.eos_token_id, ours.pad_token_id) == (theirs.eos_token_id, theirs.pad_token_id)
    assert special_ids(ours) == special_ids(theirs)  # TensorRT-LLM's end and pad ids
    assert {name: ours.special_token_id(name) for name in SPECIAL_TOKEN_NAMES} == {
        name: getattr(theirs, f"{name}_id") for name in SPECIAL_TOKEN_NAMES
    }
    assert len(ours) == len(theirs)
