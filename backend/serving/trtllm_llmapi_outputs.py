"""The outputs of TensorRT-LLM's LLM-API Triton model (trtllm_llmapi_contract.py) made from `llm`'s responses.

As its model sends them: `text_output` is the answer so far (a streamed response carries all of it, not the new
text: TensorRT-LLM sends its RequestOutput's cumulative `text`), after the prompt unless
`sampling_param_exclude_input_from_output`; `finish_reason` and `stop_reason` are `None` until the last response,
then `stop`, `length` or `cancelled`, and the stop string that ended the answer (cut from the text; `None` for the
end token); with best_of > 1 the answer is the sample of the highest cumulative logprob. The perf outputs come from
`llm`'s perf_metrics: the KV blocks of the prompt found in the prefix cache (`kv_cache_reused_block`) and not
(`kv_cache_missed_block`: the prompt's blocks, `ceil(prompt tokens / block_size)`, less those), their hit rate, the
blocks held and newly allocated, the request's times and its speculation. `LlmApiItem` is what one request asks
`llm` for and keeps between its responses. Pure numpy.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from backend.protocol.wire import NO_FINISH_REASON
from backend.serving.trtllm_contract import ItemRequest

# return_perf_metrics: the request's KV blocks, times and speculation so far (from `llm`'s perf_metrics)
PERF_OUTPUTS = {
    "kv_cache_reused_block": ("INT32", [-1]),
    "kv_cache_missed_block": ("INT32", [-1]),
    "kv_cache_alloc_new_blocks": ("INT32", [-1]),
    "kv_cache_alloc_total_blocks": ("INT32", [-1]),
    "kv_cache_hit_rate": ("FP32", [-1]),
    "arrival_time_ns": ("INT64", [1]),
    "first_scheduled_time_ns": ("INT64", [1]),
    "first_token_time_ns": ("INT64", [1]),
    "last_token_time_ns": ("INT64", [1]),
    "acceptance_rate": ("FP32", [1]),
    "total_accepted_draft_tokens": ("INT32", [1]),
    "total_draft_tokens": ("INT32", [1]),
}


@dataclass
class LlmApiItem(ItemRequest):
    """One LLM-API request as `llm` is asked for it, and what its responses need to be made (the prompt, the stop
    strings to name in stop_reason, the answer so far when streaming: each response carries all of it)."""

    best_of: int = 1
    stops: list[str] = field(default_factory=list)
    lora: tuple[str, str] | None = None  # (adapter name, its folder on the server)
    block_size: int = 16  # `llm`'s KV block size (kv_cache_missed_block counts the prompt's blocks)
    answers: dict[int, str] = field(default_factory=dict)  # streaming: each sample's completion so far
    ONE_RESPONSE: ClassVar[bool] = True  # best_of samples make one response (the best), not one each

    @property
    def names_stop(self) -> bool:
        """stop_reason asked for with stop strings: `llm` keeps the matched one in the text, which is cut here."""
        return "stop_reason" in self.outputs and bool(self.stops)

    def llm_flags(self) -> dict[str, bool]:
        return {
            "stream": self.stream,
            "exclude_input_in_output": True,  # the prompt is put before the answer here
            "return_finish_reason": True,
            "return_cumulative_logprob": "cumulative_logprob" in self.outputs or self.best_of > 1,
            "return_num_input_tokens": self.wants_perf_metrics,
            "return_perf_metrics": self.wants_perf_metrics,
        }

    @property
    def wants_perf_metrics(self) -> bool:
        return set(PERF_OUTPUTS) <= self.outputs


FINISH_REASONS = {"abort": "cancelled"}  # `llm`'s reasons in TensorRT-LLM's words (stop and length are the same)
_NUMPY = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32}
# The perf outputs `llm`'s perf_metrics JSON holds under the same name
_SAME_NAME = [name for name in PERF_OUTPUTS if not name.startswith("kv_cache_") or "alloc" in name]


def response_outputs(
    llm_outputs: dict[str, np.ndarray], item: LlmApiItem, batch_index: int | None = None
) -> list[dict[str, np.ndarray]]:
    """The one response an `llm` response makes (non-streaming, the one answer; streaming, the answer so far)."""
    texts = [_text(t) for t in llm_outputs["text_output"].reshape(-1)]
    samples = llm_outputs.get("sample_index", np.arange(len(texts))).reshape(-1)
    reasons = [_text(r) for r in llm_outputs.get("finish_reason", np.array([], dtype=object)).reshape(-1)]
    cumulative = llm_outputs.get("cumulative_logprob")
    i = int(np.argmax(cumulative.reshape(-1))) if len(texts) > 1 and cumulative is not None else 0
    reason = FINISH_REASONS.get(reasons[i], reasons[i]) if i < len(reasons) else NO_FINISH_REASON
    answer = texts[i]
    if item.stream:
        sample = int(samples[i])
        answer = item.answers[sample] = item.answers.get(sample, "") + answer
    stop_reason = NO_FINISH_REASON
    if reason == "stop" and item.names_stop:
        matched = next((s for s in sorted(item.stops, key=len, reverse=True) if answer.endswith(s)), None)
        if matched is not None:
            stop_reason, answer = matched, answer[: -len(matched)]
    text = answer if item.exclude_input_in_output else item.prompt + answer
    arrays = {"text_output": np.array([text.encode()], dtype=object)}
    if "finish_reason" in item.outputs:
        arrays["finish_reason"] = np.array([reason.encode()], dtype=object)
    if "stop_reason" in item.outputs:
        arrays["stop_reason"] = np.array([stop_reason.encode()], dtype=object)
    if "cumulative_logprob" in item.outputs and cumulative is not None:
        arrays["cumulative_logprob"] = np.array([cumulative.reshape(-1)[i]], np.float32)
    if item.wants_perf_metrics and "perf_metrics" in llm_outputs:
        prompt_tokens = int(llm_outputs["num_input_tokens"].reshape(-1)[0]) if "num_input_tokens" in llm_outputs else 0
        arrays.update(perf_outputs(json.loads(llm_outputs["perf_metrics"].reshape(-1)[0]), prompt_tokens, item))
    return [arrays]


def perf_outputs(perf: dict, prompt_tokens: int, item: LlmApiItem) -> dict[str, np.ndarray]:
    """The perf outputs, each [1], from `llm`'s perf_metrics (TensorRT-LLM's core names)."""
    reused = int(perf["kv_cache_reused_blocks"])
    missed = max(math.ceil(prompt_tokens / item.block_size) - reused, 0)
    values = {
        "kv_cache_reused_block": reused,
        "kv_cache_missed_block": missed,
        "kv_cache_hit_rate": reused / (reused + missed) if reused + missed else 0.0,
        **{name: perf[name] for name in _SAME_NAME},
    }
    return {name: np.array([values[name]], _NUMPY[dtype]) for name, (dtype, _) in PERF_OUTPUTS.items()}


def block_size_of(config_text: str, default: int) -> int:
    """The `block_size` parameter of a model's config.pbtxt (`llm`'s: kv_cache_missed_block counts the prompt's
    blocks), else `default`."""
    found = re.search(r'key:\s*"block_size"\s*,\s*value:\s*\{\s*string_value:\s*"(\d+)"', config_text)
    return int(found.group(1)) if found else default


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
