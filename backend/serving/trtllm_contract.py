"""TensorRT-LLM's client contract (its inflight_batcher_llm `ensemble` and `tensorrt_llm_bls` models) in our terms.

Those models take flat tensors with a batch dimension (`max_batch_size` > 0: a client sends `[1, 1]` for a scalar,
`[B, 1]` for a batch of B prompts) and answer each batch item on its own, tagged with `batch_index` (B > 1) and
`sequence_index` (num_return_sequences > 1). Here each batch item becomes the inputs of one request to `llm` (the
prompt, the sampling parameters as vLLM-style JSON, the return_* flags), and each of `llm`'s responses becomes
TensorRT-LLM's outputs. Pure numpy, so it is tested without Triton; docs/interface.md lists what each input does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from backend.protocol.values import InvalidRequest, as_bool

BYTES, BOOL, INT32, INT64, UINT64, FP32 = "BYTES", "BOOL", "INT32", "INT64", "UINT64", "FP32"

# Inputs of TensorRT-LLM's ensemble and BLS models (their config.pbtxt; dims without the batch dimension) -> the
# sampling parameter each one sets; None where the value is handled below.
SAMPLING = {
    "max_tokens": (INT32, "max_tokens"),
    "num_return_sequences": (INT32, "n"),
    "top_k": (INT32, "top_k"),
    "top_p": (FP32, "top_p"),
    "temperature": (FP32, "temperature"),
    "repetition_penalty": (FP32, "repetition_penalty"),
    "presence_penalty": (FP32, "presence_penalty"),
    "frequency_penalty": (FP32, "frequency_penalty"),
    "min_tokens": (INT32, "min_tokens"),
    "seed": (UINT64, "seed"),
    "num_draft_tokens": (INT32, "num_speculative_tokens"),
}
WORD_LISTS = ("bad_words", "stop_words", "embedding_bias_words")
FLAGS = (
    "stream",
    "exclude_input_in_output",
    "return_log_probs",
    "return_context_logits",
    "return_generation_logits",
    "return_perf_metrics",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "use_draft_logits",
)
GUIDE_TYPES = {"json": "guided_json_object", "json_schema": "guided_json", "regex": "guided_regex"}
# Accepted and checked, with no effect on a server without beam search (docs/interface.md says why).
NO_EFFECT = ("length_penalty", "pad_id")
LORA_UPLOAD = (
    "uploading LoRA weights is not supported: list the adapter in multi_lora.json; lora_task_id N picks its N-th"
)
# Inputs of features this server does not have: refused with the reason, never ignored.
UNSUPPORTED = {
    "decoder_text_input": "the model is decoder-only",
    "prompt_embedding_table": "prompt tuning tables are not supported",
    "prompt_vocab_size": "prompt tuning tables are not supported",
    "prompt_table_extra_id": "prompt tuning tables are not supported",
    "lora_weights": LORA_UPLOAD,
    "lora_config": LORA_UPLOAD,
    "image_input": "the model takes text only",
    "image_bytes_input": "the model takes text only",
    "image_url_input": "the model takes text only",
    "video_bytes_input": "the model takes text only",
}

INPUTS = {
    "text_input": (BYTES, [1]),
    **{name: (dtype, [1]) for name, (dtype, _) in SAMPLING.items()},
    **{name: (BYTES, [-1]) for name in WORD_LISTS},
    "embedding_bias_weights": (FP32, [-1]),
    **{name: (BOOL, [1]) for name in FLAGS},
    "beam_width": (INT32, [1]),
    "end_id": (INT32, [1]),
    "pad_id": (INT32, [1]),
    "length_penalty": (FP32, [1]),
    "lora_task_id": (UINT64, [1]),
    "guided_decoding_guide_type": (BYTES, [1]),
    "guided_decoding_guide": (BYTES, [1]),
    "decoder_text_input": (BYTES, [1]),
    "prompt_embedding_table": ("FP16", [-1, -1]),
    "prompt_vocab_size": (INT32, [1]),
    "prompt_table_extra_id": (UINT64, [1]),
    "lora_weights": ("FP16", [-1, -1]),
    "lora_config": (INT32, [-1, 3]),
    "image_input": ("FP16", [-1, 3, -1, -1]),
    "image_bytes_input": ("UINT8", [-1, -1, -1, -1]),
    "image_url_input": (BYTES, [1]),
    "video_bytes_input": ("UINT8", [-1, -1, -1, -1]),
}
# return_perf_metrics: the request's cost and times so far, each [1, 1] on every response (from `llm`'s
# perf_metrics output, backend/core/request.py RequestStats).
PERF_OUTPUTS = {
    "kv_cache_alloc_new_blocks": INT32,
    "kv_cache_reused_blocks": INT32,
    "kv_cache_alloc_total_blocks": INT32,
    "arrival_time_ns": INT64,
    "first_scheduled_time_ns": INT64,
    "first_token_time_ns": INT64,
    "last_token_time_ns": INT64,
    "acceptance_rate": FP32,
    "total_accepted_draft_tokens": INT32,
    "total_draft_tokens": INT32,
}
OUTPUTS = {
    "text_output": (BYTES, [-1]),
    "cum_log_probs": (FP32, [-1]),
    "output_log_probs": (FP32, [-1, -1]),
    "batch_index": (INT32, [1]),
    "sequence_index": (INT32, [1]),
    **{name: (dtype, [1]) for name, dtype in PERF_OUTPUTS.items()},
    "num_input_tokens": (INT32, [1]),
    "num_output_tokens": (INT32, [1]),
    "context_logits": (FP32, [-1, -1]),  # [prompt tokens, vocabulary]
    "generation_logits": (FP32, [-1, -1, -1]),  # [beams (1), tokens, vocabulary]
}
LOGITS = ("context_logits", "generation_logits")
_NUMPY = {INT32: np.int32, INT64: np.int64, FP32: np.float32}


@dataclass
class ItemRequest:
    """What one batch item asks `llm` for."""

    prompt: str | list[int]  # text_input, or the core model's input_ids
    sampling: dict[str, Any]
    stream: bool = False
    exclude_input_in_output: bool = False
    outputs: set[str] = field(default_factory=set)  # TensorRT-LLM outputs to send besides text_output
    ONE_RESPONSE: ClassVar[bool] = False  # whether its samples (n) make one response rather than one each

    @property
    def wants_perf_metrics(self) -> bool:
        return set(PERF_OUTPUTS) <= self.outputs

    def llm_flags(self) -> dict[str, bool]:
        """The BOOL inputs of the `llm` request: the return_* flags our outputs are made from."""
        return {
            "stream": self.stream,
            "exclude_input_in_output": self.exclude_input_in_output,
            "return_logprobs": "output_log_probs" in self.outputs,
            "return_cumulative_logprob": "cum_log_probs" in self.outputs,
            "return_num_input_tokens": "num_input_tokens" in self.outputs,
            "return_num_output_tokens": "num_output_tokens" in self.outputs,
            "return_perf_metrics": self.wants_perf_metrics,
            **{f"return_{name}": name in self.outputs for name in LOGITS},
        }


def item_of(name: str, array: np.ndarray, b: int) -> np.ndarray:
    """Batch item b of an input (a batch dimension first, as TensorRT-LLM's clients send every tensor)."""
    if array.ndim == 0 or array.shape[0] <= b:
        raise InvalidRequest(
            f"{name} has shape {list(array.shape)}: every input needs a batch dimension first (shape [batch, ...], "
            f"e.g. [1, 1] for one value) holding all {b + 1}+ items of the batch"
        )
    return array[b]


def scalar(name: str, array: np.ndarray, b: int) -> Any:
    values = item_of(name, array, b).reshape(-1)
    if values.size != 1:
        raise InvalidRequest(f"{name} must hold one value per batch item, got {values.size}")
    value = values[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{name} must be UTF-8 text") from None
    return value.item() if hasattr(value, "item") else value


def scalar_or(tensors: dict[str, np.ndarray], name: str, b: int, default: Any) -> Any:
    """Batch item b of input `name`, or `default` where the request leaves it out."""
    return scalar(name, tensors[name], b) if name in tensors else default


def words(name: str, array: np.ndarray, b: int) -> list[str]:
    """A word list: one phrase per string, empty strings meaning none (TensorRT-LLM's `"bad_words": ""`)."""
    words = []
    for value in item_of(name, array, b).reshape(-1):
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        if text:
            words.append(text)
    return words


REQUIRED = {
    "text_input": "the prompt, shape [batch, 1]",
    "max_tokens": "the number of tokens to generate, shape [batch, 1]",
}


def is_stop(tensors: dict[str, np.ndarray]) -> bool:
    """Whether the request is a stop request: never here (only the core model has `stop`)."""
    return False


def batch_size(tensors: dict[str, np.ndarray], required: dict[str, str] = REQUIRED) -> int:
    """The request's batch size: the first dimension of the prompt (the first of `required`, each of which must be
    there: name -> what it is), which every other input must have too."""
    for name, what in required.items():
        if name not in tensors:
            raise InvalidRequest(f"{name} is required: {what}")
    prompt = next(iter(required))
    size = tensors[prompt].shape[0] if tensors[prompt].ndim else 0
    for name, array in tensors.items():
        if array.ndim == 0 or array.shape[0] != size:
            raise InvalidRequest(
                f"{name} has shape {list(array.shape)}, {prompt} {list(tensors[prompt].shape)}: every input "
                "needs the same batch dimension first"
            )
    if size < 1:
        raise InvalidRequest(f"{prompt} must hold at least one prompt")
    return size


def item_request(tensors: dict[str, np.ndarray], b: int) -> ItemRequest:
    """Batch item b of a TensorRT-LLM request as an `llm` request; raises InvalidRequest naming the input."""
    refuse_unsupported(tensors, b, UNSUPPORTED)
    flags = {name: as_bool(name, scalar(name, tensors[name], b)) for name in FLAGS if name in tensors}
    sampling = sampling_of(tensors, b, SAMPLING)
    sampling.update(common_sampling(tensors, b, NO_EFFECT))
    for name in ("bad_words", "stop_words"):
        if name in tensors:
            sampling[name] = words(name, tensors[name], b)
    sampling.update(_embedding_bias(tensors, b))
    outputs = outputs_of(flags, sampling)
    text = scalar("text_input", tensors["text_input"], b)
    if not isinstance(text, str) or not text:
        raise InvalidRequest("text_input must be a non-empty string")
    return ItemRequest(text, sampling, flags.get("stream", False), flags.get("exclude_input_in_output", False), outputs)


def refuse_unsupported(tensors: dict[str, np.ndarray], b: int, unsupported: dict[str, str]) -> None:
    for name, reason in unsupported.items():
        if name in tensors and item_of(name, tensors[name], b).size:
            raise InvalidRequest(f"{name} is not supported: {reason}")


def sampling_of(tensors: dict[str, np.ndarray], b: int, names: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """The sampling parameters set by inputs `names` (input -> (dtype, parameter)), under TensorRT-LLM's rules:
    top_p 0 means unset, and with neither top_k (or top_k 1) nor top_p decoding is greedy."""
    sampling = {key: scalar(name, tensors[name], b) for name, (_, key) in names.items() if name in tensors}
    if sampling.get("top_p") is not None and sampling["top_p"] <= 0:
        del sampling["top_p"]
    if "top_p" not in sampling and sampling.get("top_k", 0) in (0, 1):
        sampling["temperature"] = 0.0  # top_k 1 alone picks the top token: greedy, so said
    return sampling


def common_sampling(tensors: dict[str, np.ndarray], b: int, no_effect: tuple[str, ...]) -> dict[str, Any]:
    """What the inputs every TensorRT-LLM model shares ask for: beam_width 1, the LoRA adapter (lora_task_id), the
    no-effect inputs checked, end_id, the guide."""
    sampling: dict[str, Any] = {}
    beam_width = scalar_or(tensors, "beam_width", b, 1)
    if beam_width != 1:
        raise InvalidRequest(
            f"beam_width must be 1: beam search is not supported (got {beam_width}); for several answers to one "
            "prompt use num_return_sequences"
        )
    lora = scalar_or(tensors, "lora_task_id", b, 0)
    if lora:  # an adapter of the model's listing, by its task id (the model checks it)
        sampling["lora_task_id"] = int(lora)
    for name in no_effect:
        if name in tensors:
            value = scalar(name, tensors[name], b)
            if name == "pad_id" and value < 0:
                raise InvalidRequest(f"pad_id must be a token id (>= 0), got {value}")
    if "end_id" in tensors:
        end_id = scalar("end_id", tensors["end_id"], b)
        if end_id < 0:
            raise InvalidRequest(f"end_id must be a token id (>= 0), got {end_id}")
        sampling.update(stop_token_ids=[end_id], ignore_eos=True)  # end_id replaces the model's end token
    sampling.update(guide(tensors, b))
    return sampling


def outputs_of(flags: dict[str, bool], sampling: dict[str, Any]) -> set[str]:
    """The optional outputs the return_* flags ask for (return_log_probs needs the chosen tokens' logprobs)."""
    outputs = set(PERF_OUTPUTS) if flags.get("return_perf_metrics") else set()
    if flags.get("return_log_probs"):
        outputs |= {"cum_log_probs", "output_log_probs"}
        sampling["logprobs"] = 0
    outputs |= {name for name in ("num_input_tokens", "num_output_tokens", *LOGITS) if flags.get(f"return_{name}")}
    return outputs


def _embedding_bias(tensors: dict[str, np.ndarray], b: int) -> dict[str, Any]:
    has_words, has_weights = "embedding_bias_words" in tensors, "embedding_bias_weights" in tensors
    if not (has_words or has_weights):
        return {}
    if has_words != has_weights:
        raise InvalidRequest("embedding_bias_words and embedding_bias_weights go together: send both or neither")
    words = [
        v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
        for v in item_of("embedding_bias_words", tensors["embedding_bias_words"], b).reshape(-1)
    ]
    weights = item_of("embedding_bias_weights", tensors["embedding_bias_weights"], b).reshape(-1).tolist()
    if len(words) != len(weights):
        raise InvalidRequest(
            f"embedding_bias_words has {len(words)} words and embedding_bias_weights {len(weights)} weights: "
            "they must be the same length"
        )
    bias: dict[str, float] = {}
    for word, weight in zip(words, weights):
        if word:
            bias[word] = bias.get(word, 0.0) + float(weight)
    return {"word_bias": bias} if bias else {}


def guide(tensors: dict[str, np.ndarray], b: int) -> dict[str, Any]:
    kind = scalar_or(tensors, "guided_decoding_guide_type", b, "")
    guide = scalar_or(tensors, "guided_decoding_guide", b, "")
    if not kind:
        if guide:
            raise InvalidRequest(f"guided_decoding_guide needs guided_decoding_guide_type (one of {_guide_types()})")
        return {}
    if kind == "json":
        return {"guided_json_object": True}
    if kind == "ebnf_grammar" or kind in GUIDE_TYPES:
        if not guide:
            raise InvalidRequest(f"guided_decoding_guide_type {kind} needs the guide in guided_decoding_guide")
        return {GUIDE_TYPES.get(kind, "guided_grammar"): guide}
    raise InvalidRequest(f"guided_decoding_guide_type must be one of {_guide_types()}, got {kind!r}")


def _guide_types() -> list[str]:
    return sorted([*GUIDE_TYPES, "ebnf_grammar"])


def response_outputs(
    llm_outputs: dict[str, np.ndarray], item: ItemRequest, batch_index: int | None
) -> list[dict[str, np.ndarray]]:
    """TensorRT-LLM's outputs for one `llm` response (one per sample it carries: `llm` answers a non-streaming
    request with every sample in one response), each tagged with batch_index and sequence_index where asked."""
    texts = llm_outputs["text_output"].reshape(-1)
    out = common_outputs(llm_outputs, item, batch_index)
    for text, arrays in zip(texts, out):
        arrays["text_output"] = np.array([text], dtype=object)
    return out


def common_outputs(
    llm_outputs: dict[str, np.ndarray], item: ItemRequest, batch_index: int | None
) -> list[dict[str, np.ndarray]]:
    """The outputs every TensorRT-LLM model shares, one dict per sample of an `llm` response."""
    num_samples = llm_outputs["text_output"].size
    samples = llm_outputs.get("sample_index", np.zeros(num_samples, np.int32)).reshape(-1)
    logprobs = llm_outputs.get("logprobs")
    cumulative = llm_outputs.get("cumulative_logprob")
    counts = llm_outputs.get("num_output_tokens")
    out = []
    for i in range(num_samples):
        arrays = {}
        if batch_index is not None:
            arrays["batch_index"] = np.array([[batch_index]], np.int32)
        if item.sampling.get("n", 1) > 1:
            arrays["sequence_index"] = np.array([[samples[i]]], np.int32)
        if "output_log_probs" in item.outputs and logprobs is not None:
            arrays["output_log_probs"] = np.array([[_chosen_logprobs(logprobs.reshape(-1)[i])]], np.float32)
        if "cum_log_probs" in item.outputs and cumulative is not None:
            arrays["cum_log_probs"] = np.array([[cumulative.reshape(-1)[i]]], np.float32)
        if "num_input_tokens" in item.outputs and "num_input_tokens" in llm_outputs:
            arrays["num_input_tokens"] = llm_outputs["num_input_tokens"].reshape(1, 1).astype(np.int32)
        if "num_output_tokens" in item.outputs and counts is not None:
            arrays["num_output_tokens"] = np.array([[counts.reshape(-1)[i]]], np.int32)
        if "context_logits" in item.outputs and "context_logits" in llm_outputs:  # in the first response only
            arrays["context_logits"] = llm_outputs["context_logits"][np.newaxis]
        if "generation_logits" in item.outputs and "generation_logits" in llm_outputs:
            arrays["generation_logits"] = _sample_logits(llm_outputs["generation_logits"], i)[np.newaxis, np.newaxis]
        if item.wants_perf_metrics and "perf_metrics" in llm_outputs:
            perf = json.loads(llm_outputs["perf_metrics"].reshape(-1)[0])
            arrays.update((name, np.array([[perf[name]]], _NUMPY[dtype])) for name, dtype in PERF_OUTPUTS.items())
        out.append(arrays)
    return out


def _sample_logits(logits: np.ndarray, i: int) -> np.ndarray:
    """Sample i's rows of `llm`'s generation_logits ([tokens, V] for one sample; [samples, tokens, V] with NaN
    rows padding the shorter ones for several)."""
    if logits.ndim == 2:
        return logits
    rows = logits[i]
    return rows[~np.isnan(rows).all(axis=1)]


def _chosen_logprobs(entry: bytes | str) -> list[float]:
    """The chosen tokens' logprobs from `llm`'s `logprobs` output (vLLM's shape: per token {id: {logprob, rank,
    decoded_token}}, the chosen token first)."""
    parsed = json.loads(entry) or []
    return [next(iter(token.values()))["logprob"] for token in parsed]
