"""What a request may ask of the served model: each check raises InvalidRequest naming what was wrong and what is
allowed, before the request reaches the engine thread (`LLMEngine.build_request` runs them on the caller's)."""

from __future__ import annotations

import dataclasses

from backend.protocol.sampling_params import SamplingParams
from backend.protocol.values import InvalidRequest

# The default prompt bound, in UTF-8 bytes per token of max_model_len: English text averages 4-5 bytes a
# token, so this refuses only prompts far past the token limit, before paying for tokenizing them.
PROMPT_BYTES_PER_TOKEN = 16


def tokenize(tokenizer, prompt: str, max_prompt_bytes: int, max_model_len: int) -> list[int]:
    if not prompt:
        raise InvalidRequest("text_input must be a non-empty string")
    # Checked before tokenizing: a multi-megabyte prompt would cost a full tokenizer pass first.
    if len(prompt) > max_prompt_bytes or len(prompt.encode("utf-8")) > max_prompt_bytes:
        raise InvalidRequest(
            f"text_input is {len(prompt.encode('utf-8'))} bytes of UTF-8; at most {max_prompt_bytes} are "
            f"allowed (max_prompt_bytes; the model's limit is {max_model_len} tokens)"
        )
    token_ids = tokenizer(prompt).input_ids
    if not token_ids:
        raise InvalidRequest("text_input produced no tokens")
    return token_ids


def check_token_ids(token_ids: list[int], max_model_len: int, vocab_size: int) -> list[int]:
    if not token_ids:
        raise InvalidRequest("input_ids must hold at least one token id")
    if len(token_ids) > max_model_len:
        raise InvalidRequest(f"input_ids has {len(token_ids)} tokens; the model's limit is {max_model_len}")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"input_ids must be token ids from 0 to {vocab_size - 1}, got {bad[:8]}")
    return list(token_ids)


def check_logits_size(params: SamplingParams, num_prompt_tokens: int, vocab_size: int, limit_mib: float) -> None:
    """The logits a request asks for stay within max_logits_mb."""
    for flag, rows, what in (
        ("return_context_logits", num_prompt_tokens * params.context_logits, "shorten the prompt"),
        ("return_generation_logits", params.max_tokens * params.n * params.generation_logits, "lower max_tokens"),
    ):
        mib = rows * vocab_size * 4 / 2**20
        if mib > limit_mib:
            raise InvalidRequest(
                f"{flag}: {rows} rows of {vocab_size} logits are {mib:.1f} MiB; at most {limit_mib} MiB are "
                f"allowed per request (max_logits_mb); {what} or leave it out"
            )


def check_token_id_fields(params: SamplingParams, vocab_size: int) -> None:
    """Every parameter that names token ids names ones the vocabulary has."""
    if params.top_k > vocab_size:
        raise InvalidRequest(f"top_k must be at most the vocabulary size {vocab_size}, got {params.top_k}")
    words = [t for s in params.bad_word_ids + params.stop_word_ids for t in s]
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias keys", params.logit_bias),
        ("bad_word_ids and stop_word_ids", words),
    ):
        bad_ids = [t for t in ids if not 0 <= t < vocab_size]
        if bad_ids:
            raise InvalidRequest(f"{name} must be token ids below {vocab_size}, got {bad_ids[:8]}")


def tokenize_words(tokenizer, params: SamplingParams) -> SamplingParams:
    """bad_words as token sequences (each phrase as written and after a space, as vLLM bans them), word_bias
    folded into logit_bias (each of a phrase's tokens takes its bias, as TensorRT-LLM's embedding bias)."""
    if not (params.bad_words or params.word_bias):  # bad_word_ids alone are used as given
        return params

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    sequences = {tuple(encode(v)) for w in params.bad_words for v in (w, " " + w.lstrip(" "))}
    sequences |= {tuple(s) for s in params.bad_word_ids}
    logit_bias = dict(params.logit_bias)
    for word, bias in params.word_bias.items():
        for token_id in encode(word):
            logit_bias[token_id] = logit_bias.get(token_id, 0.0) + bias
    return dataclasses.replace(params, bad_word_ids=sorted(list(s) for s in sequences if s), logit_bias=logit_bias)
