"""One response of the `llm` model read back: its output tensors (wire.OUTPUTS) as python values, per sample.

The one decoder of a response, shared by the front door (frontend/triton_stream.py) and the client
(client/results.py). It takes the outputs as a mapping of name to value: numpy arrays from gRPC (read by duck
typing, so this room stays free of numpy) or JSON values from Triton's HTTP generate endpoint (scalars or lists).
A response carries one sample when streaming and all `n` otherwise, one row each: its text, its token ids
(output_ids, padded with -1 past a shorter sample's last token), its finish reason (wire.NO_FINISH_REASON until
the sample's last response), the response's token count and cumulative logprob, and logprobs in Triton's vLLM
backend's shape (JSON, per token `{"<id>": {"logprob", "rank", "decoded_token"}}`, the sampled token first).
`token_logprobs` and `prompt_token_logprobs` read that shape back as {"token_id", "logprob", "top_logprobs"}.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backend.protocol.wire import NO_FINISH_REASON


@dataclass
class SampleRow:
    """What one sample holds in one response."""

    index: int  # sample_index: the sample's index among the request's n
    text: str
    token_ids: list[int]  # without output_ids' -1 padding
    finish_reason: str | None  # None until the sample's last response (wire.NO_FINISH_REASON on the wire)
    num_output_tokens: int | None  # this response's tokens (the model sends the delta); None unless asked for
    cumulative_logprob: float | None  # of the sample's tokens so far; None unless asked for
    logprobs: list[dict] | None  # vLLM's shape, per token; None unless asked for and the request set `logprobs`


@dataclass
class TritonResponse:
    """One response: its samples, the outputs that belong to the request, and every output as sent."""

    samples: list[SampleRow]
    num_input_tokens: int | None
    prompt_logprobs: list[dict | None] | None  # vLLM's shape, None first; only in the response that carries them
    raw: dict[str, list] = field(default_factory=dict)  # every output as a flat list of python values
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served; None unless asked for


def flat_values(value: Any) -> list:
    """A tensor (numpy array), list or scalar as a flat python list, bytes decoded to str; None as []."""
    if value is None:
        return []
    if hasattr(value, "reshape"):  # a numpy array or scalar
        value = value.reshape(-1).tolist()
    elif not isinstance(value, (list, tuple)):
        value = [value]
    return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in value]


def decode_response(outputs: Mapping[str, Any]) -> TritonResponse:
    """The samples of one response, from its outputs by name (those it did not send are absent)."""
    raw = {name: flat_values(value) for name, value in outputs.items()}
    texts = raw.get("text_output", [])
    ids = raw.get("output_ids", [])
    width = len(ids) // len(texts) if texts else 0

    def at(name: str, i: int, cast):
        values = raw.get(name, [])
        return cast(values[i]) if i < len(values) else None

    samples = []
    for i, text in enumerate(texts):
        index = at("sample_index", i, int)
        samples.append(
            SampleRow(
                index=i if index is None else index,
                text=str(text),
                token_ids=[int(t) for t in ids[i * width : (i + 1) * width] if t >= 0],
                finish_reason=at("finish_reason", i, _finish_reason),
                num_output_tokens=at("num_output_tokens", i, int),
                cumulative_logprob=at("cumulative_logprob", i, float),
                logprobs=at("logprobs", i, json.loads),
            )
        )
    return TritonResponse(
        samples=samples,
        num_input_tokens=at("num_input_tokens", 0, int),
        prompt_logprobs=at("prompt_logprobs", 0, json.loads),
        raw=raw,
        num_cached_tokens=at("num_cached_tokens", 0, int),
    )


def _finish_reason(value: Any) -> str | None:
    reason = str(value)
    return None if reason in ("", NO_FINISH_REASON) else reason


def token_logprobs(token_id: int, by_id: dict, top: int) -> dict:
    """One token's vLLM-shaped logprobs read back: {"token_id", "logprob", "top_logprobs"} (the `top` most
    likely tokens by rank, id -> logprob; no top_logprobs when `top` is 0)."""
    entry = {"token_id": token_id, "logprob": by_id[str(token_id)]["logprob"]}
    if top:
        best = sorted(by_id.items(), key=lambda item: item[1]["rank"])[:top]
        entry["top_logprobs"] = {int(t): v["logprob"] for t, v in best}
    return entry


def prompt_token_logprobs(entries: list[dict | None] | None, top: int) -> list[dict | None] | None:
    """The prompt_logprobs output read back, None first: each position's first key is its token."""
    if entries is None:
        return None
    return [None] + [token_logprobs(int(next(iter(by_id))), by_id, top) for by_id in entries[1:]]
