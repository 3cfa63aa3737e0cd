"""A checked OpenAI body as one request in the model's terms: the `Generation` (prompts, n, streaming, logprobs)
and the JSON for the model's `sampling_parameters`, validated with the engine's own rules
(backend/protocol/sampling_params.py) so a bad value is a 400 naming the OpenAI parameter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.protocol.sampling_params import SamplingParams
from backend.protocol.values import InvalidRequest

from .errors import bad_request, unsupported
from .reasoning import Reasoning
from .tools import ToolCalling

# OpenAI (and vLLM-extra) parameters passed through to sampling_parameters under the same name.
PASSTHROUGH = (
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    # vLLM's structured-output extras (the openai SDK sends them with extra_body)
    "guided_json",
    "guided_json_object",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "logit_bias",
    "priority",  # vLLM's extra: the scheduler serves lower values first
)
CONSTRAINTS = tuple(key for key in PASSTHROUGH if key.startswith("guided_")) + ("structured_outputs",)


@dataclass
class Generation:
    """One OpenAI request in the model's terms."""

    model: str
    prompts: list[str | list[int]]  # text or token ids; each is one Triton request; choice = prompt * n + sample
    sampling: dict[str, Any]  # the model's sampling_parameters
    n: int
    stream: bool
    include_usage: bool  # streaming: a last chunk with usage (stream_options.include_usage)
    echo: bool  # completions: the prompt comes before the completion text
    logprobs: int | None  # None: none; k: each token's logprob and its top k alternatives
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    tool_calling: ToolCalling | None = None  # chat: tools the model may call (their calls parsed from its text)
    target: str = ""  # the Triton model that serves it where `model` names a LoRA adapter (lora.py)
    reasoning: Reasoning | None = None  # chat: the reasoning parser its text goes through (reasoning.py)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def triton_model(self) -> str:
        return self.target or self.model


def make_generation(
    body: dict,
    model: str,
    prompts: list[str],
    max_tokens: Any,
    logprobs: int | None,
    echo: bool,
    names: dict[str, str],
    constraint: dict[str, Any] | None = None,
) -> Generation:
    stream = body.get("stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        extra = set(options) - {"include_usage"}
        if extra:
            raise unsupported(f"stream_options.{sorted(extra)[0]}")
        if not isinstance(options.get("include_usage", False), bool):
            raise bad_request("stream_options.include_usage must be a boolean", "stream_options.include_usage")
    sampling = {key: body[key] for key in PASSTHROUGH if key in body}
    sampling["max_tokens"] = max_tokens
    sampling.update(constraint or {})
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    _validate(sampling, names)
    return Generation(
        model,
        prompts,
        sampling,
        sampling.get("n", 1),
        stream,
        bool((options or {}).get("include_usage")),
        echo,
        logprobs,
        body.get("return_tokens_as_token_ids", False),
    )


def is_constrained(generation: Generation) -> bool:
    """Whether a grammar holds the answer from its first token (structured output, a forced tool call)."""
    return any(key in generation.sampling for key in CONSTRAINTS)


def _validate(sampling: dict, names: dict[str, str]) -> None:
    """The engine's own checks (its per-model limits, such as the largest n, are checked when it is sent);
    `names`: the OpenAI parameter behind an engine key where they differ."""
    try:
        SamplingParams.from_dict(sampling, max_n=1 << 16)
    except InvalidRequest as exc:
        field = str(exc).split(" ", 1)[0]  # e.g. "temperature", "logit_bias[50256]"
        base = field.split("[", 1)[0]
        raise bad_request(str(exc), names.get(base, field if base in sampling else None)) from None
