"""The served model's tokenizer, read from its Hugging Face folder: the chat template that turns messages into
the prompt the model is sent, the text of single tokens for OpenAI's logprobs, encoding and decoding for
token-id prompts and /tokenize, and the model's vocabulary size and length from its config."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from .errors import bad_request


class ModelTokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer  # heavy: only when the front door starts

        from transformers import AutoConfig

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if not self.tokenizer.chat_template:
            raise ValueError(f"the tokenizer in {model_dir} has no chat template; /v1/chat/completions needs one")
        config = AutoConfig.from_pretrained(str(model_dir))
        self.vocab_size = config.vocab_size  # the model's: token-id prompts are checked against it
        self.max_position_embeddings = getattr(config, "max_position_embeddings", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as the engine decodes a token-id prompt."""
        return self.tokenizer.decode(token_ids)

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text for `messages`, ending where the assistant's answer starts."""
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template that raises on these messages (jinja2 errors)
            raise bad_request(f"the model's chat template rejected the messages: {exc}", "messages") from None

    @lru_cache(maxsize=65536)
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
