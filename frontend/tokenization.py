"""vLLM's /tokenize and /detokenize: the served model's tokenizer over HTTP, so a client can count tokens, fit
a prompt to `max_model_len` or build token-id prompts exactly as the model will see them.

    POST /tokenize    {"model", "prompt", "add_special_tokens": true}  or
                      {"model", "messages", "add_generation_prompt": true}  (the chat template applied)
                      -> {"count", "max_model_len", "tokens", "token_strs": null}
    POST /detokenize  {"model", "tokens": [ids]} -> {"prompt": text}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import bad_request
from .openai_protocol import chat_messages, completion_prompts
from .request_fields import check_fields, served_model
from .tokenizer import ModelTokenizer

TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize(
    body: Any, served: list[str], tokenizer: ModelTokenizer, render_chat: Callable[[list[dict]], str]
) -> tuple[str, dict]:
    """(model, answer) for a /tokenize body."""
    body = check_fields(body, TOKENIZE_FIELDS)
    model = served_model(body, served)
    for flag in ("add_special_tokens", "add_generation_prompt", "return_token_strs"):
        if not isinstance(body.get(flag, True), bool):
            raise bad_request(f"{flag} must be a boolean", flag)
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give prompt (a string) or messages (a chat), exactly one", "prompt")
    if "messages" in body:
        if body.get("add_generation_prompt") is False:
            raise bad_request(
                "add_generation_prompt: false is not supported (the prompt the model is sent ends "
                "where the assistant's answer starts)",
                "add_generation_prompt",
            )
        text, special = render_chat(chat_messages(body["messages"])), False  # the template holds its own specials
    else:
        if not isinstance(body["prompt"], str):
            raise bad_request("prompt must be a string", "prompt")
        text = completion_prompts(body["prompt"], tokenizer.vocab_size)[0]
        special = body.get("add_special_tokens", True)
    tokens = tokenizer.encode(text, add_special_tokens=special)
    strings = [tokenizer.token_text(t) for t in tokens] if body.get("return_token_strs") else None
    return model, {"count": len(tokens), "tokens": tokens, "token_strs": strings}


def detokenize(body: Any, served: list[str], tokenizer: ModelTokenizer) -> dict:
    body = check_fields(body, DETOKENIZE_FIELDS)
    served_model(body, served)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("tokens must be an array of token ids", "tokens")
    bad = [t for t in tokens if not 0 <= t < tokenizer.vocab_size][:5]
    if bad:
        raise bad_request(f"tokens holds ids outside the vocabulary (0 to {tokenizer.vocab_size - 1}): {bad}", "tokens")
    return {"prompt": tokenizer.decode(tokens)}
