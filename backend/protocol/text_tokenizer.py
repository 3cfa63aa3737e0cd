"""A model's tokenizer read from its Hugging Face folder (tokenizer.json, tokenizer_config.json): text to token ids
and back, its special tokens and their ids, for the front door (frontend/tokenizer.py adds the chat template) and
TensorRT-LLM's preprocessing and postprocessing models (backend/serving/tokenizer_models.py).

Built on the `tokenizers` library and json, without transformers, which imports torch when it loads a tokenizer.
It gives the same results as transformers 5's `AutoTokenizer` for a folder whose tokenizer.json transformers loads
as is (tokenizer_class `TokenizersBackend` or `PreTrainedTokenizerFast`): the backend is set up the way
`TokenizersBackend.__init__` does it, encode and decode are `__call__` and `decode`, the special tokens' ids are
`eos_token_id` and the like, and the length is `len()`. tests/unit/test_text_tokenizer.py and
tests/unit/test_frontend_tokenizer.py compare the two.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer
from tokenizers.processors import TemplateProcessing

# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


class TextTokenizer:
    def __init__(self, model_dir: str | Path):
        folder = Path(model_dir)
        self.settings = _tokenizer_settings(folder)  # tokenizer_config.json as transformers reads it
        named, extra = _special_tokens(self.settings)
        self.tokenizer = _backend(folder, self.settings, named, extra)
        # name -> text (what a chat template sees besides the messages)
        self.special_tokens = {name: _text(token) for name, token in named.items()}
        self._clean_up_spaces = bool(self.settings.get("clean_up_tokenization_spaces", False)) and (
            type(self.tokenizer.model).__name__ != "BPE"  # transformers skips the clean-up for BPE, unless told
            or bool(self.settings.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        )
        self.eos_token_id = self.special_token_id("eos_token")
        self.pad_token_id = self.special_token_id("pad_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Token ids as text; special tokens written out unless skipped (as the engine decodes a token-id prompt)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def special_token_id(self, name: str) -> int | None:
        """A named special token's id (transformers' `<name>_id`): None where the tokenizer has no such token, the
        unknown token's where its text is not in the vocabulary."""
        text = self.special_tokens.get(name)
        if text is None:
            return None
        token_id = self.tokenizer.token_to_id(text)
        return token_id if token_id is not None or name == "unk_token" else self.special_token_id("unk_token")

    def __len__(self) -> int:
        """The vocabulary with its added tokens."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _tokenizer_settings(folder: Path) -> dict:
    """tokenizer_config.json as transformers' from_pretrained reads it: `additional_special_tokens` is
    `extra_special_tokens`, and an old folder (no `added_tokens_decoder`) has its special tokens in
    special_tokens_map.json and added_tokens.json."""
    settings = read_json(folder / "tokenizer_config.json") or {}
    if "additional_special_tokens" in settings and not settings.get("extra_special_tokens"):
        settings["extra_special_tokens"] = settings.pop("additional_special_tokens")
    model_specific = {
        key: value
        for key, value in settings.items()
        if key not in SPECIAL_TOKEN_NAMES and key.endswith("_token") and isinstance(value, str)
    }
    if isinstance(settings.get("extra_special_tokens"), dict):
        model_specific.update(settings.pop("extra_special_tokens"))
    if "added_tokens_decoder" not in settings:
        for key, value in (read_json(folder / "special_tokens_map.json") or {}).items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = {**value, "special": True}
            elif key == "extra_special_tokens" and isinstance(value, list):
                extra = list(settings.get("extra_special_tokens") or [])
                value = extra + [t for t in value if _text(t) not in map(_text, extra)]
            settings[key] = value
        if isinstance(settings.get("extra_special_tokens"), dict):
            model_specific.update(settings.pop("extra_special_tokens"))
        specials = {_text(settings[k]) for k in SPECIAL_TOKEN_NAMES if settings.get(k)}
        specials |= {_text(t) for t in settings.get("extra_special_tokens") or []}
        decoder = {
            int(index): {"content": text, "normalized": text not in specials, "special": text in specials}
            for text, index in (read_json(folder / "added_tokens.json") or {}).items()
        }
        for token in (read_json(folder / "tokenizer.json") or {}).get("added_tokens", []):
            decoder[int(token["id"])] = token
        settings["added_tokens_decoder"] = decoder
    if "additional_special_tokens" in settings and "extra_special_tokens" not in settings:  # the map's, as above
        settings["extra_special_tokens"] = settings.pop("additional_special_tokens")
    settings["_model_specific"] = model_specific
    return settings


def _text(token: Any) -> str:
    """A special token's text: a string, or transformers' serialized AddedToken ({"content": ...})."""
    return token["content"] if isinstance(token, dict) else str(token)


def _added_token(token: Any, special: bool | None = None) -> AddedToken:
    if isinstance(token, AddedToken):
        return token
    if isinstance(token, str):
        return AddedToken(token, special=True if special is None else special)
    fields = {key: token[key] for key in _ADDED_TOKEN_FIELDS if key in token}
    return AddedToken(**fields)


def _special_tokens(settings: dict) -> tuple[dict[str, Any], list[Any]]:
    """The named special tokens (bos_token ..., then the model's own *_token ones) and the extra ones."""
    named = {}
    for key in SPECIAL_TOKEN_NAMES:
        value = settings.get(key)
        if value is None:
            continue
        if not isinstance(value, (str, dict)):
            raise TypeError(f"Special token {key} has to be either str or AddedToken but got: {type(value)}")
        named[key] = value
    auto = {
        key: value
        for key, value in settings.items()
        if key not in SPECIAL_TOKEN_NAMES
        and key.endswith("_token")
        and (isinstance(value, str) or (isinstance(value, dict) and "content" in value))
    }
    named.update({**auto, **settings["_model_specific"]})
    extra = settings.get("extra_special_tokens") or []
    if not isinstance(extra, (list, tuple)):
        raise TypeError("extra_special_tokens must be a list/tuple of tokens or a dict of named tokens")
    return named, list(extra)


def _backend(folder: Path, settings: dict, named: dict[str, Any], extra: list[Any]) -> Tokenizer:
    """tokenizer.json as TokenizersBackend.__init__ sets it up: the tokens of `added_tokens_decoder` and any
    special token the file lacks added, an empty template post-processor where it has none (transformers drops
    add_bos_token / add_eos_token when there is a tokenizer.json), no truncation or padding (every transformers
    call without them turns them off)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no tokenizer.json; only that tokenizer format is read")
    backend = Tokenizer.from_file(str(path))
    backend.no_truncation()
    backend.no_padding()
    decoder = settings.get("added_tokens_decoder") or {}
    to_add = [
        _added_token(token) for _, token in sorted(((int(i), t) for i, t in decoder.items()), key=lambda item: item[0])
    ]
    known = {token.content for token in backend.get_added_tokens_decoder().values()} | {t.content for t in to_add}
    named_texts = {_text(token) for token in named.values() if token}
    for token in [*named.values(), *extra]:
        if _text(token) not in known:
            known.add(_text(token))
            to_add.append(_added_token(token))
    for token in to_add:
        if token.content in named_texts and not token.special:
            token.special = True
    if to_add:
        backend.add_tokens(to_add)
    if backend.post_processor is None:
        backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    backend.encode_special_tokens = bool(settings.get("split_special_tokens", False))
    return backend


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (clean_up_tokenization_spaces)."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text
