"""Per-request sampling parameters, parsed from loosely typed client values and validated.

Clients send these as vLLM-style JSON (`sampling_parameters`), as TensorRT-LLM-style flat tensors, or as
request parameters; values may arrive as strings (GenAI-Perf sends them so). Every bad value raises
InvalidRequest with a message that says what was wrong and what is allowed. Pure Python: the front door
validates with this module before a request reaches Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend.protocol.guided_decoding import (
    CONSTRAINT_KEYS,
    GuidedDecoding,
    pop_guided_decoding,
)
from backend.protocol.values import InvalidRequest, as_bool, as_float, as_int, in_range

# Upper bounds on list-valued inputs (docs/security.md, "Input bounds", lists every bound).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
MAX_BAD_WORDS = 64
# Request priority (lower is served first, vLLM's convention): a bounded range keeps the metrics' `priority`
# label to a bounded set of values.
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's logprob and the top k
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (computed in prefill)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit before sampling
    bad_words: list[str] = field(default_factory=list)  # phrases never generated (vLLM's and TensorRT-LLM's name)
    word_bias: dict[str, float] = field(default_factory=dict)  # phrase -> added to each of its tokens' logits
    # Token sequences whose last token is banned after the rest (TensorRT-LLM's bad_words_list); the engine adds
    # bad_words' own.
    bad_word_ids: list[list[int]] = field(default_factory=list)
    stop_word_ids: list[list[int]] = field(default_factory=list)  # a sample stops once it ends with one of these
    num_speculative_tokens: int | None = None  # None: the engine's setting; 0 turns speculation off
    guided_decoding: GuidedDecoding | None = None  # an output constraint (guided_decoding.py)
    priority: int = 0  # the scheduler serves lower values first (docs/engine.md, "Priority"); not a sampling knob
    # Set from the return_context_logits / return_generation_logits flags (not sampling parameters): keep the
    # model's logits of every prompt position / of every generated token.
    context_logits: bool = False
    generation_logits: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_dict(cls, values: dict[str, Any], max_n: int = 8, max_tokens_limit: int = 1 << 20) -> SamplingParams:
        values = dict(resolve_aliases(values))
        guided_decoding = pop_guided_decoding(values)
        unknown = sorted(set(values) - set(_PARSERS))
        if unknown:
            allowed = sorted(_PARSERS) + CONSTRAINT_KEYS
            raise InvalidRequest(f"unknown sampling parameter(s) {unknown}; allowed: {allowed}")
        parsed = {}
        for key, value in values.items():
            if value is None:
                continue
            parsed[key] = _PARSERS[key](key, value)
        params = cls(**parsed, guided_decoding=guided_decoding)
        params._check(max_n, max_tokens_limit)
        return params

    def _check(self, max_n: int, max_tokens_limit: int) -> None:
        in_range("n", self.n, 1, max_n)
        scoring_only = self.max_tokens == 0 and self.prompt_logprobs is not None
        if not scoring_only and not 1 <= self.max_tokens <= max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens must be between 1 and {max_tokens_limit}, got {self.max_tokens} "
                "(0 only with prompt_logprobs: the prompt scored, nothing generated)"
            )
        in_range("min_tokens", self.min_tokens, 0, self.max_tokens, hint=" (at most max_tokens)")
        in_range("temperature", self.temperature, 0.0, 100.0)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}")
        in_range("min_p", self.min_p, 0.0, 1.0)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequest(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            in_range("seed", self.seed, 0, 2**64 - 1)
        if self.logprobs is not None:
            in_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            in_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequest(
                f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}"
            )
        for token_id, bias in self.logit_bias.items():
            if token_id < 0:
                raise InvalidRequest(f"logit_bias keys must be token ids (integers >= 0), got {token_id}")
            in_range(f"logit_bias[{token_id}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.num_speculative_tokens is not None:
            in_range("num_speculative_tokens", self.num_speculative_tokens, 0, 16)
        in_range("priority", self.priority, MIN_PRIORITY, MAX_PRIORITY, hint=" (an integer; lower is served first)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters each, got one of {longest}"
            )
        for name, words in (("bad_words", self.bad_words), ("word_bias", self.word_bias)):
            if len(words) > MAX_BAD_WORDS:
                raise InvalidRequest(f"{name} takes at most {MAX_BAD_WORDS} phrases, got {len(words)}")
            if any(len(w) > MAX_STOP_STRING_CHARS for w in words):
                raise InvalidRequest(f"{name} phrases must be at most {MAX_STOP_STRING_CHARS} characters each")
        for word, bias in self.word_bias.items():
            in_range(f"word_bias[{word!r}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        for name, sequences in (("bad_word_ids", self.bad_word_ids), ("stop_word_ids", self.stop_word_ids)):
            if len(sequences) > MAX_BAD_WORDS or any(not 1 <= len(s) <= MAX_STOP_TOKEN_IDS for s in sequences):
                raise InvalidRequest(
                    f"{name} takes at most {MAX_BAD_WORDS} token sequences of 1 to {MAX_STOP_TOKEN_IDS} ids each"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )


def resolve_aliases(values: dict[str, Any]) -> dict[str, Any]:
    """`stop_words` (TensorRT-LLM's name) means `stop`, where an empty string means none (TensorRT-LLM's clients
    send `"stop_words": ""`); within one source an explicit `stop` wins."""
    if "stop_words" not in values:
        return values
    values = dict(values)
    alias = values.pop("stop_words")
    values.setdefault("stop", _without_empty(alias))
    return values


def _without_empty(value):
    """A word list with its empty strings dropped (TensorRT-LLM: an empty word is no word)."""
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, (list, tuple)):
        return [v for v in value if v != ""]
    return value


def _as_words(name: str, value) -> list[str]:
    return _as_stop(name, _without_empty(value))


def _as_word_bias(name: str, value) -> dict[str, float]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be an object mapping phrases to biases, got {value!r}")
    return {str(key): as_float(f"{name}[{key!r}]", bias) for key, bias in value.items() if key != ""}


def _as_stop(name: str, value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise InvalidRequest(f"{name} must be a string or a list of strings, got {value!r}")


def _as_int_list(name: str, value) -> list[int]:
    if isinstance(value, (list, tuple)):
        return [as_int(f"{name}[{i}]", v) for i, v in enumerate(value)]
    raise InvalidRequest(f"{name} must be a list of integers, got {value!r}")


def _as_id_sequences(name: str, value) -> list[list[int]]:
    if isinstance(value, (list, tuple)):
        return [_as_int_list(f"{name}[{i}]", v) for i, v in enumerate(value)]
    raise InvalidRequest(f"{name} must be a list of token id lists, got {value!r}")


def _as_logprobs(name: str, value) -> int | None:
    """An integer k (the top k alternatives too), or true/false for just the chosen token's logprob."""
    if isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in ("true", "false")):
        return 0 if as_bool(name, value) else None
    return as_int(name, value)


def _as_priority(name: str, value) -> int:
    """An integer only: not a bool, a float (2.0 included) nor a string, unlike the other integer parameters."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InvalidRequest(
        f"{name} must be an integer between {MIN_PRIORITY} and {MAX_PRIORITY} (lower is served first), got {value!r}"
    )


def _as_logit_bias(name: str, value) -> dict[int, float]:
    """{token id: bias}; JSON object keys are strings, so "50256" and 50256 both name token 50256."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be an object mapping token ids to biases, got {value!r}")
    return {as_int(f"{name} key", key): as_float(f"{name}[{key}]", bias) for key, bias in value.items()}


_PARSERS = {
    "n": as_int,
    "max_tokens": as_int,
    "min_tokens": as_int,
    "temperature": as_float,
    "top_p": as_float,
    "top_k": as_int,
    "min_p": as_float,
    "repetition_penalty": as_float,
    "presence_penalty": as_float,
    "frequency_penalty": as_float,
    "seed": as_int,
    "stop": _as_stop,
    "stop_token_ids": _as_int_list,
    "ignore_eos": as_bool,
    "include_stop_str_in_output": as_bool,
    "skip_special_tokens": as_bool,
    "logprobs": _as_logprobs,
    "prompt_logprobs": _as_logprobs,
    "logit_bias": _as_logit_bias,
    "bad_words": _as_words,
    "word_bias": _as_word_bias,
    "bad_word_ids": _as_id_sequences,
    "stop_word_ids": _as_id_sequences,
    "num_speculative_tokens": as_int,
    "priority": _as_priority,
}
