"""TensorRT-LLM's core model contract (its inflight_batcher_llm `tensorrt_llm` model: token ids in, token ids out)
in our terms, for clients that tokenize themselves (its `inflight_batcher_llm_client.py`, its `end_to_end_test.py`'s
pipeline). Each batch item is one request to `llm` with `input_ids`; each `llm` response becomes `output_ids`
`[1, 1, tokens]` (the prompt first unless streaming or `exclude_input_in_output`, as TensorRT-LLM does) and
`sequence_length` `[1, 1]`, with the outputs the ensemble shares (trtllm_contract.py). Word lists come as token ids
in TensorRT-LLM's `[2, L]` form (ids, then end offsets). Pure numpy; docs/interface.md lists what each input does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from backend.protocol.values import InvalidRequest, as_bool
from backend.serving import trtllm_contract as shared
from backend.serving.trtllm_contract import BOOL, FP32, INT32, INT64, LORA_UPLOAD, UINT64, ItemRequest, item_of, scalar

SAMPLING = {
    "request_output_len": (INT32, "max_tokens"),
    "runtime_top_k": (INT32, "top_k"),
    "runtime_top_p": (FP32, "top_p"),
    **{
        name: spec
        for name, spec in shared.SAMPLING.items()
        if name not in ("max_tokens", "top_k", "top_p", "num_draft_tokens")
    },
}
FLAGS = ("streaming", *(name for name in shared.FLAGS if name not in ("stream", "use_draft_logits")))
# Accepted and checked, with no effect: beam-search settings without beam search, and a decoder-only model's
# decoder input (TensorRT-LLM's preprocessing sends `[[pad_id]]`; its core model ignores it for such a model too).
NO_EFFECT = (
    "pad_id",
    "len_penalty",
    "early_stopping",
    "beam_search_diversity_rate",
    "decoder_input_ids",
    "decoder_input_lengths",
)
UNSUPPORTED = {
    **{
        name: "the model is decoder-only"
        for name in (
            "encoder_input_features",
            "encoder_output_lengths",
            "cross_attention_mask",
            "skip_cross_attn_blocks",
        )
    },
    **{
        name: "an external draft is not supported (speculation uses the server's own draft)"
        for name in ("draft_input_ids", "draft_logits", "draft_acceptance_threshold")
    },
    **{
        name: "top-p decay is not supported"
        for name in ("runtime_top_p_min", "runtime_top_p_decay", "runtime_top_p_reset_ids")
    },
    **{
        name: "prompt tuning tables are not supported"
        for name in ("prompt_embedding_table", "prompt_table_extra_ids", "prompt_vocab_size")
    },
    **{name: "the model takes text only" for name in ("mrope_rotary_cos_sin", "mrope_position_deltas")},
    "lora_weights": LORA_UPLOAD,
    "lora_config": LORA_UPLOAD,
    "context_phase_params": "disaggregated serving is not supported",
    **{
        name: "KV-cache retention priorities are not supported"
        for name in (
            "retention_token_range_starts",
            "retention_token_range_ends",
            "retention_token_range_priorities",
            "retention_token_range_durations_ms",
            "retention_decode_priority",
            "retention_decode_duration_ms",
        )
    },
    **{
        name: "lookahead decoding is not supported"
        for name in ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")
    },
}
REQUIRED = {
    "input_ids": "the prompt's token ids, shape [batch, tokens] (a text prompt: the tensorrt_llm model's text_input)",
    "input_lengths": "each prompt's length, shape [batch, 1]",
    "request_output_len": "the number of tokens to generate, shape [batch, 1]",
}
INPUTS = {
    "input_ids": (INT32, [-1]),
    "input_lengths": (INT32, [1]),
    **{name: (dtype, [1]) for name, (dtype, _) in SAMPLING.items()},
    **{name: (BOOL, [1]) for name in FLAGS},
    "stop": (BOOL, [1]),
    "beam_width": (INT32, [1]),
    "end_id": (INT32, [1]),
    "pad_id": (INT32, [1]),
    "stop_words_list": (INT32, [2, -1]),
    "bad_words_list": (INT32, [2, -1]),
    "embedding_bias": (FP32, [-1]),
    "len_penalty": (FP32, [1]),
    "early_stopping": (BOOL, [1]),
    "beam_search_diversity_rate": (FP32, [1]),
    "lora_task_id": (UINT64, [1]),
    "guided_decoding_guide_type": ("BYTES", [1]),
    "guided_decoding_guide": ("BYTES", [1]),
    "decoder_input_ids": (INT32, [-1]),
    "decoder_input_lengths": (INT32, [1]),
    "encoder_input_features": ("FP16", [-1, -1]),
    "encoder_output_lengths": (INT32, [1]),
    "cross_attention_mask": (BOOL, [-1, -1]),
    "skip_cross_attn_blocks": (BOOL, [1]),
    "draft_input_ids": (INT32, [-1]),
    "draft_logits": (FP32, [-1, -1]),
    "draft_acceptance_threshold": (FP32, [1]),
    "runtime_top_p_min": (FP32, [1]),
    "runtime_top_p_decay": (FP32, [1]),
    "runtime_top_p_reset_ids": (INT32, [1]),
    "prompt_embedding_table": ("FP16", [-1, -1]),
    "prompt_table_extra_ids": (UINT64, [-1]),
    "prompt_vocab_size": (INT32, [1]),
    "mrope_rotary_cos_sin": (FP32, [-1]),
    "mrope_position_deltas": (INT64, [1]),
    "lora_weights": ("FP16", [-1, -1]),
    "lora_config": (INT32, [-1, 3]),
    "context_phase_params": ("UINT8", [-1]),
    **{
        name: (INT32, [-1])
        for name in (
            "retention_token_range_starts",
            "retention_token_range_ends",
            "retention_token_range_priorities",
            "retention_token_range_durations_ms",
        )
    },
    **{
        name: (INT32, [1])
        for name in (
            "retention_decode_priority",
            "retention_decode_duration_ms",
            "lookahead_window_size",
            "lookahead_ngram_size",
            "lookahead_verification_set_size",
        )
    },
}
OUTPUTS = {
    "output_ids": (INT32, [-1, -1]),
    "sequence_length": (INT32, [-1]),
    **{name: spec for name, spec in shared.OUTPUTS.items() if name != "text_output"},
}


def is_stop(tensors: dict[str, np.ndarray]) -> bool:
    """A stop request: `stop` true cancels the generations of the request with the same request id."""
    return "stop" in tensors and bool(np.any(tensors["stop"]))


def batch_size(tensors: dict[str, np.ndarray]) -> int:
    return shared.batch_size(tensors, REQUIRED)


def item_request(tensors: dict[str, np.ndarray], b: int) -> ItemRequest:
    """Batch item b of a request to the core model as an `llm` request; raises InvalidRequest naming the input."""
    shared.refuse_unsupported(tensors, b, UNSUPPORTED)
    flags = {name: as_bool(name, scalar(name, tensors[name], b)) for name in FLAGS if name in tensors}
    sampling = shared.sampling_of(tensors, b, SAMPLING)
    sampling.update(shared.common_sampling(tensors, b, NO_EFFECT))
    for name, key in (("bad_words_list", "bad_word_ids"), ("stop_words_list", "stop_word_ids")):
        if name in tensors:
            words = word_list(name, item_of(name, tensors[name], b))
            if words:
                sampling[key] = words
    if "embedding_bias" in tensors:
        bias = item_of("embedding_bias", tensors["embedding_bias"], b).reshape(-1)
        nonzero = np.flatnonzero(bias)
        if nonzero.size:
            sampling["logit_bias"] = {int(t): float(bias[t]) for t in nonzero}
    outputs = shared.outputs_of(flags, sampling)
    return ItemRequest(
        _prompt_ids(tensors, b),
        sampling,
        flags.get("streaming", False),
        flags.get("exclude_input_in_output", False),
        outputs,
    )


def _prompt_ids(tensors: dict[str, np.ndarray], b: int) -> list[int]:
    """input_ids trimmed to input_lengths (a batch pads its shorter prompts)."""
    ids = item_of("input_ids", tensors["input_ids"], b).reshape(-1)
    length = scalar("input_lengths", tensors["input_lengths"], b)
    if not 1 <= length <= ids.size:
        raise InvalidRequest(f"input_lengths must be from 1 to the {ids.size} ids of input_ids, got {length}")
    return [int(t) for t in ids[:length]]


def word_list(name: str, array: np.ndarray) -> list[list[int]]:
    """TensorRT-LLM's `[2, L]` word list: row 0 the words' token ids end to end, row 1 each word's end offset
    (-1 pads); an empty list (`[2, 0]`, or offsets all -1) means none."""
    if array.size == 0:
        return []
    if array.ndim != 2 or array.shape[0] != 2:
        raise InvalidRequest(
            f"{name} must be [2, L] per batch item (token ids, then end offsets), got {list(array.shape)}"
        )
    ids, offsets = array[0].tolist(), [int(o) for o in array[1] if o >= 0]
    words, start = [], 0
    for end in offsets:
        if not start < end <= len(ids):
            raise InvalidRequest(f"{name}: end offset {end} does not follow {start} within the {len(ids)} ids")
        words.append(ids[start:end])
        start = end
    return words


def response_outputs(
    llm_outputs: dict[str, np.ndarray], item: ItemRequest, batch_index: int | None
) -> list[dict[str, Any]]:
    """The core model's outputs for one `llm` response: output_ids `[1, 1, tokens]` (the prompt first in a
    non-streaming answer unless exclude_input_in_output) and sequence_length, plus the shared outputs."""
    ids = llm_outputs["output_ids"]
    rows = ids.reshape(1, -1) if ids.ndim == 1 else ids
    out = shared.common_outputs(llm_outputs, item, batch_index)
    for row, arrays in zip(rows, out):
        tokens = [int(t) for t in row if t >= 0]  # -1 pads a shorter sample
        if not item.stream and not item.exclude_input_in_output:
            tokens = list(item.prompt) + tokens
        arrays["output_ids"] = np.array([[tokens]], np.int32)
        arrays["sequence_length"] = np.array([[len(tokens)]], np.int32)
    return out
