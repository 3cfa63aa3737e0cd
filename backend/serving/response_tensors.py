"""Triton response tensors for engine outputs.

`response_arrays` is what one response holds, in Triton's vLLM backend's terms (docs/interface.md): the
additional outputs only when asked for, `num_output_tokens`, `logprobs` and `generation_logits` counting this
response's tokens, `prompt_logprobs` JSON null and `context_logits` left out except in the one response that
carries them.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import torch

from backend.core.request import RequestOutput, SampleOutput
from backend.protocol.wire import NO_FINISH_REASON


class TokenTexts:
    """The text of single tokens (vLLM's `decoded_token`), cached by id. Uses the engine thread's tokenizer
    from the sender thread: decoding only reads it (no truncation or padding state is touched)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[tuple[int, bool], str] = {}

    def __call__(self, token_id: int, skip_special_tokens: bool = True) -> str:
        key = (token_id, skip_special_tokens)
        text = self._cache.get(key)
        if text is None:
            text = self._cache[key] = self.tokenizer.decode(
                [token_id], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )
        return text


def vllm_logprobs(entries: list[dict] | None, token_text: Callable[[int], str]) -> list[dict] | None:
    """Engine logprob entries as vLLM's backend sends them: per token, {"<id>": {"logprob", "rank",
    "decoded_token"}} for the sampled token (first) and the top alternatives; None without logprobs."""
    if entries is None:
        return None

    def one(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}

    out = []
    for entry in entries:
        by_id = {str(entry["token_id"]): one(entry["token_id"], entry["logprob"], entry["rank"])}
        for rank, (token_id, logprob) in enumerate((entry.get("top_logprobs") or {}).items(), start=1):
            by_id.setdefault(str(token_id), one(token_id, logprob, rank))
        out.append(by_id)
    return out


def prompt_logprobs(entries: list[dict | None] | None, token_text: TokenTexts) -> list[dict | None] | None:
    """The prompt's logprobs in vLLM's shape: None for the first token, then one `vllm_logprobs` entry per
    token; None in every response but the one that carries them."""
    if entries is None:
        return None
    return [None] + vllm_logprobs(entries[1:], lambda t: token_text(t, False))


def response_arrays(
    output: RequestOutput,
    samples: list[SampleOutput],
    wanted: frozenset[str],
    token_text: TokenTexts,
    prefix: str = "",
    skip_special_tokens: bool = True,
    requested: frozenset[str] | None = None,
) -> dict[str, np.ndarray]:
    """The output tensors of one response for `samples` (one per stream response, all `n` otherwise):
    text_output, output_ids and sample_index always, each name in `wanted` (wire.OPTIONAL_OUTPUTS)
    besides; of those, only the ones in `requested` (the client's requested outputs, None for every one):
    Triton drops the others from the response, so building them would be work for nothing.
    `samples` carry this response's tokens, so their count is the response's num_output_tokens."""

    def texts(values) -> np.ndarray:
        return np.array([v.encode() for v in values], dtype=object)

    def output_ids() -> np.ndarray:
        ids = [s.token_ids for s in samples]
        width = max(len(x) for x in ids)
        id_array = np.array([x + [-1] * (width - len(x)) for x in ids], dtype=np.int32)
        return id_array[0] if len(samples) == 1 else id_array

    always = {
        "text_output": lambda: texts(prefix + s.text for s in samples),
        "output_ids": output_ids,
        "sample_index": lambda: np.array([s.sample_index for s in samples], dtype=np.int32),
    }
    optional = {
        "finish_reason": lambda: texts(s.finish_reason.value if s.finish_reason else NO_FINISH_REASON for s in samples),
        "cumulative_logprob": lambda: np.array([s.cumulative_logprob for s in samples], dtype=np.float32),
        "logprobs": lambda: texts(
            json.dumps(vllm_logprobs(s.logprobs, lambda t: token_text(t, skip_special_tokens))) for s in samples
        ),
        "num_input_tokens": lambda: np.array([output.num_input_tokens], dtype=np.uint32),
        "num_output_tokens": lambda: np.array([len(s.token_ids) for s in samples], dtype=np.uint32),
        "num_cached_tokens": lambda: np.array([output.num_cached_tokens], dtype=np.uint32),
        "prompt_logprobs": lambda: texts([json.dumps(prompt_logprobs(output.prompt_logprobs, token_text))]),
        "perf_metrics": lambda: texts([json.dumps(output.stats.as_dict())]),
        "context_logits": lambda: None if output.context_logits is None else torch.cat(output.context_logits).numpy(),
        "generation_logits": lambda: generation_logits(samples),
    }
    builders = always | {name: optional[name] for name in wanted}
    arrays = {}
    for name, build in builders.items():
        if requested is None or name in requested:
            array = build()
            if array is not None:  # context_logits: only in the response that carries them
                arrays[name] = array
    return arrays


def generation_logits(samples: list[SampleOutput]) -> np.ndarray | None:
    """The logits of this response's tokens: [tokens, V] for one sample, [samples, tokens, V] for several
    (NaN rows past a shorter sample's last token, as output_ids pads with -1)."""
    rows = [s.generation_logits for s in samples]
    if any(r is None for r in rows):
        return None
    width, vocab = max(len(r) for r in rows), next((len(r[0]) for r in rows if r), 0)
    out = np.full((len(rows), width, vocab), np.nan, dtype=np.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.stack(r).numpy()
    return out[0] if len(samples) == 1 else out
