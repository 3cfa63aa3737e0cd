"""TensorRT-LLM's `preprocessing` and `postprocessing` models in our terms: the tokenizer steps its pipeline clients
run around the core model (`tensorrt_llm_core`) (its end_to_end_test.py calls the three in turn, then checks the
`ensemble` answers the same). Text to token ids, word lists to its `[2, L]` form, embedding-bias words to a
vector over the vocabulary; token ids back to text. Pure numpy and a tokenizer with transformers' encode, decode,
eos_token_id, pad_token_id and len (backend/protocol/text_tokenizer.py's); the Triton glue is
backend/serving/tokenizer_models.py.
"""

from __future__ import annotations

import numpy as np

from backend.protocol.values import InvalidRequest

# Inputs of its preprocessing model (config.pbtxt at tensorrtllm_backend c2e65b88; dims without the batch dimension)
PRE_INPUTS = {
    "QUERY": ("BYTES", [1]),
    "DECODER_QUERY": ("BYTES", [1]),
    "IMAGE_BYTES": ("UINT8", [-1, -1, -1, -1]),
    "IMAGE_URL": ("BYTES", [1]),
    "VIDEO_BYTES": ("UINT8", [-1, -1, -1, -1]),
    "REQUEST_OUTPUT_LEN": ("INT32", [1]),
    "BAD_WORDS_DICT": ("BYTES", [-1]),
    "STOP_WORDS_DICT": ("BYTES", [-1]),
    "EMBEDDING_BIAS_WORDS": ("BYTES", [-1]),
    "EMBEDDING_BIAS_WEIGHTS": ("FP32", [-1]),
    "END_ID": ("INT32", [1]),
    "PAD_ID": ("INT32", [1]),
    "PROMPT_TABLE_EXTRA_ID": ("UINT64", [1]),
}
PRE_OUTPUTS = {
    "INPUT_ID": ("INT32", [-1]),
    "REQUEST_INPUT_LEN": ("INT32", [1]),
    "DECODER_INPUT_ID": ("INT32", [-1]),
    "REQUEST_DECODER_INPUT_LEN": ("INT32", [1]),
    "BAD_WORDS_IDS": ("INT32", [2, -1]),
    "STOP_WORDS_IDS": ("INT32", [2, -1]),
    "EMBEDDING_BIAS": ("FP32", [-1]),
    "REQUEST_OUTPUT_LEN": ("INT32", [-1]),
    "OUT_END_ID": ("INT32", [1]),
    "OUT_PAD_ID": ("INT32", [1]),
}
POST_INPUTS = {"TOKENS_BATCH": ("INT32", [-1, -1]), "SEQUENCE_LENGTH": ("INT32", [-1])}
POST_OUTPUTS = {"OUTPUT": ("BYTES", [-1])}
_UNSUPPORTED = {
    "DECODER_QUERY": "the model is decoder-only",
    "IMAGE_BYTES": "the model takes text only",
    "IMAGE_URL": "the model takes text only",
    "VIDEO_BYTES": "the model takes text only",
    "PROMPT_TABLE_EXTRA_ID": "prompt tuning tables are not supported",
}


def _texts(name: str, array: np.ndarray) -> list[list[str]]:
    """Per batch item, its strings (UTF-8 bytes decoded)."""
    try:
        return [[v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in row.reshape(-1)] for row in array]
    except UnicodeDecodeError:
        raise InvalidRequest(f"{name} must be UTF-8 text") from None


def special_ids(tokenizer) -> tuple[int, int]:
    """(end id, pad id): the tokenizer's end token, and its pad token or else the end token (TensorRT-LLM's)."""
    end = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end
    return end, pad


def word_lists(tokenizer, words: list[list[str]] | None, batch: int) -> np.ndarray:
    """Each item's words as TensorRT-LLM's `[2, L]` word list (token ids end to end, padded with 0; each word's end
    offset, padded with -1), stacked `[batch, 2, L]`; `[batch, 2, 0]` without words. Empty words are none."""
    if words is None:
        return np.empty((batch, 2, 0), np.int32)
    items = []
    for item in words:
        encoded = [ids for w in item if w and (ids := tokenizer.encode(w, add_special_tokens=False))]
        items.append(([t for ids in encoded for t in ids], list(np.cumsum([len(ids) for ids in encoded]))))
    width = max(1, *(len(flat) for flat, _ in items))
    out = np.zeros((batch, 2, width), np.int32)
    out[:, 1, :] = -1
    for i, (flat, ends) in enumerate(items):
        out[i, 0, : len(flat)], out[i, 1, : len(ends)] = flat, ends
    return out


def embedding_bias(tokenizer, words: list[list[str]] | None, weights: np.ndarray | None, batch: int) -> np.ndarray:
    """Each item's bias over the vocabulary: every token of a word gets the word's weight added; `[batch, 0]`
    without words."""
    if words is None or weights is None:
        if (words is None) != (weights is None):
            raise InvalidRequest("EMBEDDING_BIAS_WORDS and EMBEDDING_BIAS_WEIGHTS go together: send both or neither")
        return np.empty((batch, 0), np.float32)
    out = np.zeros((batch, len(tokenizer)), np.float32)
    for i, (item, item_weights) in enumerate(zip(words, weights)):
        item_weights = item_weights.reshape(-1)
        if len(item) != len(item_weights):
            raise InvalidRequest(
                f"EMBEDDING_BIAS_WORDS has {len(item)} words and EMBEDDING_BIAS_WEIGHTS {len(item_weights)} weights"
            )
        for word, weight in zip(item, item_weights):
            for token_id in tokenizer.encode(word, add_special_tokens=False) if word else []:
                out[i, token_id] += weight
    return out


def preprocess(tokenizer, tensors: dict[str, np.ndarray], add_special_tokens: bool = True) -> dict[str, np.ndarray]:
    """Its preprocessing model's outputs for one request (`[batch, ...]` tensors); raises InvalidRequest."""
    for name, reason in _UNSUPPORTED.items():
        if name in tensors and tensors[name].size:
            raise InvalidRequest(f"{name} is not supported: {reason}")
    for name in ("QUERY", "REQUEST_OUTPUT_LEN"):
        if name not in tensors:
            raise InvalidRequest(f"{name} is required")
    queries = [item[0] if item else "" for item in _texts("QUERY", tensors["QUERY"])]
    batch = len(queries)
    ids = [tokenizer.encode(q, add_special_tokens=add_special_tokens) for q in queries]
    if not all(ids):
        raise InvalidRequest("QUERY must be non-empty text (it produced no tokens)")
    end, pad = special_ids(tokenizer)
    width = max(len(x) for x in ids)
    input_ids = np.full((batch, width), pad, np.int32)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)] = x
    texts = {
        name: _texts(name, tensors[name]) for name in PRE_INPUTS if name in tensors and PRE_INPUTS[name][0] == "BYTES"
    }
    end_ids = tensors.get("END_ID", np.full((batch, 1), end, np.int32))
    pad_ids = tensors.get("PAD_ID", np.full((batch, 1), pad, np.int32))
    return {
        "INPUT_ID": input_ids,
        "REQUEST_INPUT_LEN": np.array([[len(x)] for x in ids], np.int32),
        "DECODER_INPUT_ID": pad_ids.reshape(batch, 1).astype(np.int32),
        "REQUEST_DECODER_INPUT_LEN": np.ones((batch, 1), np.int32),
        "BAD_WORDS_IDS": word_lists(tokenizer, texts.get("BAD_WORDS_DICT"), batch),
        "STOP_WORDS_IDS": word_lists(tokenizer, texts.get("STOP_WORDS_DICT"), batch),
        "EMBEDDING_BIAS": embedding_bias(
            tokenizer, texts.get("EMBEDDING_BIAS_WORDS"), tensors.get("EMBEDDING_BIAS_WEIGHTS"), batch
        ),
        "REQUEST_OUTPUT_LEN": tensors["REQUEST_OUTPUT_LEN"].astype(np.int32),
        "OUT_END_ID": end_ids.reshape(batch, 1).astype(np.int32),
        "OUT_PAD_ID": pad_ids.reshape(batch, 1).astype(np.int32),
    }


def postprocess(tokenizer, tensors: dict[str, np.ndarray], skip_special_tokens: bool = True) -> dict[str, np.ndarray]:
    """Its postprocessing model's output: each (batch item, beam)'s first SEQUENCE_LENGTH tokens as text, one
    string each."""
    for name in POST_INPUTS:
        if name not in tensors:
            raise InvalidRequest(f"{name} is required")
    tokens, lengths = tensors["TOKENS_BATCH"], tensors["SEQUENCE_LENGTH"]
    if tokens.ndim == 2:  # [batch, tokens]: one beam
        tokens = tokens[:, np.newaxis, :]
    lengths = lengths.reshape(tokens.shape[0], -1)
    if lengths.shape[1] != tokens.shape[1]:
        raise InvalidRequest(f"SEQUENCE_LENGTH {list(lengths.shape)} must give one length per beam of TOKENS_BATCH")
    texts = [
        tokenizer.decode(tokens[b, beam, : lengths[b, beam]].tolist(), skip_special_tokens=skip_special_tokens)
        for b in range(tokens.shape[0])
        for beam in range(tokens.shape[1])
    ]
    return {"OUTPUT": np.array([t.encode("utf-8") for t in texts], dtype=object)}
