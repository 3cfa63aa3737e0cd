"""The served model's tokenizer, read from its Hugging Face folder: the chat template that turns messages into
the prompt the model is sent, the text of single tokens for OpenAI's logprobs, encoding and decoding for
token-id prompts and /tokenize, and the model's vocabulary size and length from its config.

Built on the `tokenizers` library (tokenizer.json), Jinja2 (the chat template) and json (the configs), without
transformers, which imports torch when it loads a tokenizer. It gives the same results as transformers 5's
`AutoTokenizer` for a folder whose tokenizer.json transformers loads as is (tokenizer_class `TokenizersBackend` or
`PreTrainedTokenizerFast`): the backend is set up the way `TokenizersBackend.__init__` does it, encode and decode
are `__call__` and `decode`, and the template renders as `apply_chat_template(..., tokenize=False)` does
(transformers/utils/chat_template_utils.py). tests/unit/test_frontend_tokenizer.py compares the two.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer
from tokenizers.processors import TemplateProcessing

from .errors import bad_request

# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES): the template sees them
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# The names a message's reasoning comes under; the first is the one templates read (transformers aliases them)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ModelTokenizer:
    def __init__(self, model_dir: str | Path):
        folder = Path(model_dir)
        settings = _tokenizer_settings(folder)
        named, extra = _special_tokens(settings)
        self.tokenizer = _backend(folder, settings, named, extra)
        self.special_tokens = {name: _text(token) for name, token in named.items()}  # what the template sees
        self.chat_template: str | dict[str, str] | None = settings.get("chat_template")
        if not self.chat_template:
            raise ValueError(f"the tokenizer in {model_dir} has no chat template; /v1/chat/completions needs one")
        self._clean_up_spaces = bool(settings.get("clean_up_tokenization_spaces", False)) and (
            type(self.tokenizer.model).__name__ != "BPE"  # transformers skips the clean-up for BPE, unless told
            or bool(settings.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        )
        config = _read_json(folder / "config.json") or {}
        text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        vocab_size = config.get("vocab_size", text_config.get("vocab_size"))
        if not isinstance(vocab_size, int):
            raise ValueError(f"{folder / 'config.json'} gives no vocab_size")
        self.vocab_size = vocab_size  # the model's: token-id prompts are checked against it
        self.max_position_embeddings = _first(config, text_config, "max_position_embeddings", "n_positions")
        self.token_text = lru_cache(maxsize=65536)(self._token_text)  # cached per tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as the engine decodes a token-id prompt."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`, by default ending where the assistant's answer starts;
        `template_kwargs` are more variables for the template (vLLM's chat_template_kwargs, e.g. Qwen3's
        `enable_thinking`)."""
        try:
            return self._render(messages, tools, add_generation_prompt, template_kwargs or {})
        except Exception as exc:  # noqa: BLE001 - a template that raises on these messages (jinja2 errors)
            raise bad_request(f"the model's chat template rejected the messages: {exc}", "messages") from None

    def _token_text(self, token_id: int) -> str:
        """One token's text, special tokens written out (OpenAI's logprobs, /tokenize's token_strs)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _render(
        self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool, template_kwargs: dict
    ) -> str:
        """transformers' apply_chat_template(messages, tools, add_generation_prompt, tokenize=False,
        **template_kwargs)."""
        source = self._template_source(tools)
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        # transformers drops the keys whose value is None (templates handle a missing key, not a None)
        chat = [{k: v for k, v in message.items() if v is not None} for message in messages]
        template = _compile_jinja_template(source)  # a syntax error comes first, as in transformers
        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            raise ValueError(
                "Tools should either be a JSON schema, or a callable function with type hints "
                "and a docstring suitable for auto-conversion to a schema."
            )
        chat = _plain_template_data(chat)
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        return template.render(
            messages=_alias_reasoning_fields(chat),
            tools=_plain_template_data(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **_plain_template_data(template_kwargs)},
        )

    def _template_source(self, tools: list[dict] | None) -> str:
        """transformers' get_chat_template: the one template, or the default (tool_use with tools) of several."""
        if not isinstance(self.chat_template, dict):
            return self.chat_template
        if tools is not None and "tool_use" in self.chat_template:
            return self.chat_template["tool_use"]
        if "default" in self.chat_template:
            return self.chat_template["default"]
        raise ValueError(
            "This model has multiple chat templates with no default specified! Please either pass a chat "
            "template or the name of the template you wish to use to the `chat_template` argument. Available "
            f"template names are {sorted(self.chat_template)}."
        )


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _first(config: dict, text_config: dict, *names: str) -> Any:
    for source in (config, text_config):
        for name in names:
            if source.get(name) is not None:
                return source[name]
    return None


def _tokenizer_settings(folder: Path) -> dict:
    """tokenizer_config.json as transformers' from_pretrained reads it: the chat template files take priority
    over its `chat_template`, `additional_special_tokens` is `extra_special_tokens`, and an old folder (no
    `added_tokens_decoder`) has its special tokens in special_tokens_map.json and added_tokens.json."""
    settings = _read_json(folder / "tokenizer_config.json") or {}
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "additional_chat_templates").is_dir():
        for path in (folder / "additional_chat_templates").glob("*.jinja"):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        settings["chat_template"] = templates["default"]
    elif templates:
        settings["chat_template"] = templates
    elif isinstance(settings.get("chat_template"), (list, tuple)):
        settings["chat_template"] = {t["name"]: t["template"] for t in settings["chat_template"]}
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
        for key, value in (_read_json(folder / "special_tokens_map.json") or {}).items():
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
            for text, index in (_read_json(folder / "added_tokens.json") or {}).items()
        }
        for token in (_read_json(folder / "tokenizer.json") or {}).get("added_tokens", []):
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
        raise ValueError(f"{folder} has no tokenizer.json; the front door reads only that tokenizer format")
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


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    """A message's reasoning under every name templates read it by (transformers' _alias_reasoning_fields)."""
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _plain_template_data(value: Any) -> Any:
    """What the template may see, rebuilt of plain JSON types (transformers' _plain_template_data): the sandbox
    does not know other objects' methods are safe."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_template_data(key): _plain_template_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_template_data(item) for item in value)
    numpy = sys.modules.get("numpy")  # never imported here: a numpy value means numpy is loaded
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain_template_data(value.item())  # np.bool_(False) would otherwise be a truthy placeholder
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker), which marks the assistant's
    tokens for training masks: rendering just writes the block."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context: jinja2.nodes.EvalContext, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _TemplateDict:
    """`dict` in a template, without dictionary attribute access or type-hackery."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` in a template, refusing underscore names (CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; transformers' writes plain JSON and takes json.dumps' options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


@lru_cache
def _compile_jinja_template(source: str) -> jinja2.Template:
    """The template in transformers' environment (_compile_jinja_template): a sandbox, trim_blocks and
    lstrip_blocks, loop controls, and its tojson, raise_exception, strftime_now, dict and namespace."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment.from_string(source)
