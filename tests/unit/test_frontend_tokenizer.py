"""frontend/tokenizer.py (tokenizers, no transformers) against transformers' AutoTokenizer: the backend as
transformers sets it up, encoding, decoding, single tokens' text and the model's sizes, for the served model's
folder and for folders made here to reach what that one does not (special tokens old and new style, clean-up of
decoded spaces, split special tokens)."""

from __future__ import annotations

import json
import random

import pytest

from launcher.paths import MODEL_DIR as SMOL_DIR
from tests.unit.tokenizer_folders import SPECIALS, TEXTS, assert_same_encoding, model_folder, pair, their_render

transformers = pytest.importorskip("transformers")


def test_the_backend_is_set_up_as_transformers_sets_it_up(ours, theirs):
    theirs("warm up")  # a call without truncation or padding turns off any in tokenizer.json, as ours does at load
    assert json.loads(ours.tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert ours.special_tokens == theirs.special_tokens_map


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode(ours, theirs, add_special_tokens):
    assert_same_encoding(ours, theirs, add_special_tokens)


def test_decode(ours, theirs):
    for text in TEXTS:
        ids = theirs(text).input_ids
        assert ours.decode(ids) == theirs.decode(ids), text
    rng = random.Random(1)
    special = list(theirs.added_tokens_decoder)
    for _ in range(300):
        ids = [
            rng.choice(special) if rng.random() < 0.15 else rng.randrange(ours.vocab_size)
            for _ in range(rng.randrange(0, 40))
        ]
        assert ours.decode(ids) == theirs.decode(ids), ids
    for ids in ([], [0], [1, 2], [49151, 0, 1], [ours.vocab_size], [5, ours.vocab_size + 100, 6]):
        assert ours.decode(ids) == theirs.decode(ids), ids


def test_token_text_of_every_id(ours, theirs):
    for token_id in range(ours.vocab_size):
        expected = theirs.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert ours.token_text(token_id) == expected, token_id
    assert [ours.token_text(i) for i in theirs.all_special_ids] == theirs.all_special_tokens


def test_the_models_size_and_length(ours):
    config = transformers.AutoConfig.from_pretrained(str(SMOL_DIR))
    assert (ours.vocab_size, ours.max_position_embeddings) == (config.vocab_size, config.max_position_embeddings)


def test_special_tokens_old_and_new_style(tmp_path):
    """Named tokens as AddedToken dicts, a model's own *_token, extra tokens (some new to the vocabulary), the
    legacy special_tokens_map.json: the same backend, encoding, decoding and template variables."""

    def added(content):
        return {
            "__type": "AddedToken",
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    template = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ image_token }}|{{ sep_token }}"
    configs = {
        "dicts": (
            {
                "bos_token": added("<|im_start|>"),
                "eos_token": added("<|im_end|>"),
                "unk_token": "<|endoftext|>",
                "image_token": "<|image|>",
                "additional_special_tokens": ["<|extra_a|>", "<jupyter_code>"],
                "chat_template": template,
            },
            {},
        ),
        "legacy": (
            {"chat_template": template, "model_max_length": 8192},
            {
                "special_tokens_map.json": json.dumps(
                    {
                        "bos_token": {
                            "content": "<|im_start|>",
                            "lstrip": False,
                            "normalized": False,
                            "rstrip": False,
                            "single_word": False,
                        },
                        "eos_token": "<|im_end|>",
                        "pad_token": "<|endoftext|>",
                        "sep_token": "<|sep|>",
                        "additional_special_tokens": ["<|extra_b|>"],
                    }
                )
            },
        ),
        "named_dict": ({**SPECIALS, "extra_special_tokens": {"image_token": "<|img|>"}, "chat_template": template}, {}),
    }
    for name, (config, files) in configs.items():
        ours, theirs = pair(model_folder(tmp_path, name, config, files))
        theirs("warm up")
        assert json.loads(ours.tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str()), name
        messages = [{"role": "user", "content": "x"}]
        assert ours.render_chat(messages) == their_render(theirs, messages), name
        for text in ("<|image|> <|img|> <|extra_a|><|extra_b|> <|sep|> <jupyter_code>", *TEXTS[:15]):
            ids = theirs(text).input_ids
            assert ours.encode(text) == ids and ours.decode(ids) == theirs.decode(ids), (name, text)


@pytest.mark.parametrize(
    "config",
    [
        {"clean_up_tokenization_spaces": True},  # transformers ignores it for a BPE tokenizer
        {
            "clean_up_tokenization_spaces": True,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True,
        },
        {"split_special_tokens": True},
    ],
)
def test_decoding_and_encoding_options(tmp_path, config):
    ours, theirs = pair(model_folder(tmp_path, "options", {**SPECIALS, **config, "chat_template": "x"}))
    for text in TEXTS:
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert [ours.token_text(i) for i in ids[:50]] == [
            theirs.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids[:50]
        ]
