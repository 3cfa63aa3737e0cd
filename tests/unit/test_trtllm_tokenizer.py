"""backend/serving/trtllm_tokenizer.py: TensorRT-LLM's preprocessing and postprocessing steps with SmolLM2's own
tokenizer, as the models load it (backend/protocol/text_tokenizer.py) and as transformers does: prompts padded
into a batch, word lists in the `[2, L]` form the core model reads back, the embedding bias vector, decoding back
to text (the real server: tests/integration/test_trtllm_core_e2e.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from backend.protocol.text_tokenizer import TextTokenizer
from backend.protocol.values import InvalidRequest
from backend.serving import trtllm_core_contract, trtllm_tokenizer
from launcher.paths import MODEL_DIR as SMOL_DIR
from tests.unit.test_trtllm_contract import declared_tensors


@pytest.fixture(scope="module", params=["TextTokenizer", "AutoTokenizer"])
def tokenizer(request, tokenizer):
    """The served model's tokenizer as the models load it, and transformers' (conftest.py)."""
    return TextTokenizer(SMOL_DIR) if request.param == "TextTokenizer" else tokenizer


def texts(*rows) -> np.ndarray:
    return np.array([[v.encode() for v in row] for row in rows], dtype=object)


def test_a_batch_of_prompts_is_padded_and_measured(tokenizer):
    out = trtllm_tokenizer.preprocess(
        tokenizer, {"QUERY": texts(["Hi"], ["What is machine learning?"]), "REQUEST_OUTPUT_LEN": np.array([[4], [5]])}
    )
    short, long = tokenizer.encode("Hi"), tokenizer.encode("What is machine learning?")
    end, pad = trtllm_tokenizer.special_ids(tokenizer)
    assert out["INPUT_ID"].shape == (2, len(long)) and out["INPUT_ID"][1].tolist() == long
    assert out["INPUT_ID"][0].tolist() == short + [pad] * (len(long) - len(short))
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(short)], [len(long)]]
    assert out["OUT_END_ID"].tolist() == [[end], [end]] and out["REQUEST_OUTPUT_LEN"].tolist() == [[4], [5]]
    assert out["DECODER_INPUT_ID"].tolist() == [[pad], [pad]]  # a decoder-only model's: ignored downstream
    assert out["BAD_WORDS_IDS"].shape == (2, 2, 0) and out["EMBEDDING_BIAS"].shape == (2, 0)


def test_word_lists_round_trip_through_the_core_models_reader(tokenizer):
    out = trtllm_tokenizer.preprocess(
        tokenizer,
        {
            "QUERY": texts(["a"], ["b"]),
            "REQUEST_OUTPUT_LEN": np.array([[1], [1]]),
            "BAD_WORDS_DICT": texts(["machine learning", ""], ["cat", "dog"]),
            "STOP_WORDS_DICT": texts([""], [""]),
        },
    )
    encode = lambda w: tokenizer.encode(w, add_special_tokens=False)  # noqa: E731
    assert trtllm_core_contract.word_list("bad", out["BAD_WORDS_IDS"][0]) == [encode("machine learning")]
    assert trtllm_core_contract.word_list("bad", out["BAD_WORDS_IDS"][1]) == [encode("cat"), encode("dog")]
    assert trtllm_core_contract.word_list("stop", out["STOP_WORDS_IDS"][0]) == []  # "" is no word


def test_embedding_bias_words_become_a_vector_over_the_vocabulary(tokenizer):
    out = trtllm_tokenizer.preprocess(
        tokenizer,
        {
            "QUERY": texts(["a"]),
            "REQUEST_OUTPUT_LEN": np.array([[1]]),
            "EMBEDDING_BIAS_WORDS": texts(["cat", "cat"]),
            "EMBEDDING_BIAS_WEIGHTS": np.array([[1.5, 0.5]], np.float32),
        },
    )
    (token,) = tokenizer.encode("cat", add_special_tokens=False)
    bias = out["EMBEDDING_BIAS"][0]
    assert bias.shape == (len(tokenizer),) and bias[token] == 2.0 and np.count_nonzero(bias) == 1


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"DECODER_QUERY": texts(["x"])}, "DECODER_QUERY is not supported: the model is decoder-only"),
        ({"EMBEDDING_BIAS_WORDS": texts(["x"])}, "send both or neither"),
        ({"QUERY": texts([""])}, "QUERY must be non-empty text"),
    ],
)
def test_bad_preprocessing_requests_say_why(tokenizer, extra, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        trtllm_tokenizer.preprocess(tokenizer, {"QUERY": texts(["a"]), "REQUEST_OUTPUT_LEN": np.array([[1]]), **extra})


def test_postprocessing_decodes_each_beam_up_to_its_length(tokenizer):
    ids = tokenizer.encode("What is machine learning?")
    tokens = np.array([[ids + [0, 0]]], np.int32)  # [batch 1, beam 1, tokens], padded past its length
    out = trtllm_tokenizer.postprocess(tokenizer, {"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": np.array([[len(ids)]])})
    assert out["OUTPUT"].tolist() == [b"What is machine learning?"]
    with pytest.raises(InvalidRequest, match="one length per beam"):
        trtllm_tokenizer.postprocess(tokenizer, {"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": np.array([[1, 2]])})


@pytest.mark.parametrize("model,prefix", [("preprocessing", "PRE"), ("postprocessing", "POST")])
def test_the_model_configs_declare_the_tensors(model, prefix):
    inputs, outputs, text = declared_tensors(model)
    assert inputs == getattr(trtllm_tokenizer, f"{prefix}_INPUTS")
    assert outputs == getattr(trtllm_tokenizer, f"{prefix}_OUTPUTS")
    assert "tokenizer_dir" in text and "max_batch_size: 64" in text
