"""The served model's tokenizer, read from its Hugging Face folder: the chat template that turns messages into
the prompt the model is sent, the text of single tokens for OpenAI's logprobs, encoding and decoding for
token-id prompts and /tokenize, and the model's vocabulary size and length from its config.

Encoding and decoding are backend/protocol/text_tokenizer.py's (the `tokenizers` library, without transformers,
which imports torch when it loads a tokenizer); the chat template is rendered with Jinja2 as transformers 5's
`apply_chat_template(..., tokenize=False)` renders it (transformers/utils/chat_template_utils.py), with the
template chosen as `AutoTokenizer` chooses it. tests/unit/test_frontend_tokenizer.py and
tests/unit/test_frontend_chat_template.py compare the two.
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

from backend.protocol.text_tokenizer import TextTokenizer, read_json

from .errors import bad_request

# The names a message's reasoning comes under; the first is the one templates read (transformers aliases them)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ModelTokenizer(TextTokenizer):
    def __init__(self, model_dir: str | Path):
        super().__init__(model_dir)
        folder = Path(model_dir)
        self.chat_template: str | dict[str, str] | None = _chat_template(folder, self.settings)
        if not self.chat_template:
            raise ValueError(f"the tokenizer in {model_dir} has no chat template; /v1/chat/completions needs one")
        config = read_json(folder / "config.json") or {}
        text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        vocab_size = config.get("vocab_size", text_config.get("vocab_size"))
        if not isinstance(vocab_size, int):
            raise ValueError(f"{folder / 'config.json'} gives no vocab_size")
        self.vocab_size = vocab_size  # the model's: token-id prompts are checked against it
        self.max_position_embeddings = _first(config, text_config, "max_position_embeddings", "n_positions")
        self.token_text = lru_cache(maxsize=65536)(self._token_text)  # cached per tokenizer

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


def _first(config: dict, text_config: dict, *names: str) -> Any:
    for source in (config, text_config):
        for name in names:
            if source.get(name) is not None:
                return source[name]
    return None


def _chat_template(folder: Path, settings: dict) -> str | dict[str, str] | None:
    """The chat template(s) as transformers' from_pretrained reads them: the template files take priority over
    tokenizer_config.json's `chat_template`, a list of named ones becomes a dict."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "additional_chat_templates").is_dir():
        for path in (folder / "additional_chat_templates").glob("*.jinja"):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        return templates["default"]
    if templates:
        return templates
    template = settings.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {t["name"]: t["template"] for t in template}
    return template


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
