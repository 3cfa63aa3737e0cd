"""frontend/tokenizer.py (tokenizers + Jinja2, no transformers) against transformers' AutoTokenizer: encoding,
decoding, single tokens' text, the chat template's prompt and its errors, for the served model's folder and for
folders made here to reach what that one does not (a template with tools, several templates, legacy special
tokens, clean-up of decoded spaces, split special tokens)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from conftest import SMOL_DIR

from frontend.errors import APIError
from frontend.openai_protocol import chat_messages
from frontend.tokenizer import ModelTokenizer
from frontend.tools import conversation, parse_tool_calling

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    " ",
    "   ",
    "\n",
    "Hello, world!",
    "  leading and trailing  ",
    "line\nbreaks\r\nand\ttabs",
    "naïve café — “quotes” and ‘single’",
    "日本語のテキストと中文",
    "Привет, мир",
    "مرحبا بالعالم",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_start|><|im_end|>",
    "<repo_name>x<file_sep>y<filename>z",
    "<|im_start",
    "im_end|>",
    "a<|im_end|>b",
    " <|im_end|> ",
    "12345 3.14159 -7e10",
    "def f(x):\n    return x ** 2\n",
    "\u0000 nul \u200b zero width \ufeff bom",
    "ﬁ ligature Ω ohm Å angstrom",
    "don't won't I'm they've we're",
    "Hello , world . Why ? Yes ! I 'm ok",
    "{{ not a template }} {% raw %}",
    "x" * 3000,
    "word " * 500,
]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Arr!"},
        {"role": "user", "content": "Where's the treasure?"},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "third"},
        {"role": "assistant", "content": "fourth"},
        {"role": "user", "content": "fifth"},
    ],
    [{"role": "user", "content": "emoji 😀 and 日本語 and <|im_end|> inside"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "{{ messages }} {% if true %}x{% endif %}\n\n  spaced  "}],
    [{"role": "user", "content": "hi", "name": "bob", "tool_calls": [], "tool_call_id": None}],
    [{"role": "assistant", "content": "I start."}],
]


@pytest.fixture(scope="module")
def ours() -> ModelTokenizer:
    return ModelTokenizer(SMOL_DIR)


@pytest.fixture(scope="module")
def theirs():
    return transformers.AutoTokenizer.from_pretrained(str(SMOL_DIR))


def their_render(theirs, messages, tools=None, add_generation_prompt=True):
    return theirs.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def their_error(theirs, messages, tools=None) -> str:
    with pytest.raises(Exception) as info:  # noqa: B017 - whatever transformers raises, its text is the message
        their_render(theirs, messages, tools)
    return str(info.value)


def assert_same_error(ours, theirs, messages, tools=None):
    with pytest.raises(APIError) as info:
        ours.render_chat(messages, tools)
    assert info.value.status == 400 and info.value.param == "messages"
    expected = their_error(theirs, messages, tools)
    assert info.value.message == f"the model's chat template rejected the messages: {expected}"


def test_the_backend_is_set_up_as_transformers_sets_it_up(ours, theirs):
    theirs("warm up")  # a call without truncation or padding turns off any in tokenizer.json, as ours does at load
    assert json.loads(ours.tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert ours.special_tokens == theirs.special_tokens_map


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode(ours, theirs, add_special_tokens):
    rng = random.Random(0)
    alphabet = "ab Z9\n\t.,<|>_é中😀\u0301 " + "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(60))
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80))) for _ in range(200)]
    for text in texts:
        assert (
            ours.encode(text, add_special_tokens=add_special_tokens)
            == theirs(text, add_special_tokens=add_special_tokens).input_ids
        ), text


def test_decode(ours, theirs):
    for text in TEXTS:
        ids = theirs(text).input_ids
        assert ours.decode(ids) == theirs.decode(ids), text
    rng = random.Random(1)
    special = list(theirs.added_tokens_decoder)
    for _ in range(300):
        ids = [
            rng.choice(special) if rng.random() < 0.15 else rng.randrange(ours.vocab_size)
            for _ in range(rng.randrange(0, 40))
        ]
        assert ours.decode(ids) == theirs.decode(ids), ids
    for ids in ([], [0], [1, 2], [49151, 0, 1], [ours.vocab_size], [5, ours.vocab_size + 100, 6]):
        assert ours.decode(ids) == theirs.decode(ids), ids


def test_token_text_of_every_id(ours, theirs):
    for token_id in range(ours.vocab_size):
        expected = theirs.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert ours.token_text(token_id) == expected, token_id
    assert [ours.token_text(i) for i in theirs.all_special_ids] == theirs.all_special_tokens


def test_the_models_size_and_length(ours):
    config = transformers.AutoConfig.from_pretrained(str(SMOL_DIR))
    assert (ours.vocab_size, ours.max_position_embeddings) == (config.vocab_size, config.max_position_embeddings)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat(ours, theirs, add_generation_prompt):
    for messages in CHATS:
        assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt) == their_render(
            theirs, messages, add_generation_prompt=add_generation_prompt
        ), messages
    assert ours.render_chat(CHATS[0], tools=[{"type": "function", "function": {"name": "f"}}]) == their_render(
        theirs, CHATS[0], tools=[{"type": "function", "function": {"name": "f"}}]
    )


def test_the_chats_the_front_door_renders(ours, theirs):
    """Bodies as /v1/chat/completions gets them, through chat_messages and conversation as parse_chat runs them."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    bodies = [
        {
            "messages": [
                {"role": "developer", "content": "Terse."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
                },
            ]
        },
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools},
        {
            "messages": [
                {"role": "system", "content": "Sys."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "18°C, cloudy"},
            ],
            "tools": tools,
            "tool_choice": "required",
        },
    ]
    for body in bodies:
        messages = conversation(chat_messages(body["messages"]), parse_tool_calling(body))
        assert ours.render_chat(messages) == their_render(theirs, messages), body
    raw = chat_messages(bodies[2]["messages"])  # as /tokenize renders them: tool_calls and tool_call_id kept
    assert ours.render_chat(raw) == their_render(theirs, raw)


def test_a_message_the_template_cannot_render_is_a_400_with_transformers_message(ours, theirs):
    assert_same_error(ours, theirs, [{"role": "user", "content": None}])  # None keys are dropped: undefined
    assert_same_error(ours, theirs, [{"role": "user"}])
    assert_same_error(ours, theirs, [{"role": "user", "content": 7}])
    with pytest.raises(APIError, match="empty conversation"):
        ours.render_chat([])


def model_folder(tmp_path: Path, name: str, config: dict, files: dict[str, str] | None = None) -> Path:
    """The served model's tokenizer.json and config.json with this tokenizer_config.json and these files."""
    folder = tmp_path / name
    folder.mkdir()
    for file in ("tokenizer.json", "config.json"):
        shutil.copy(SMOL_DIR / file, folder / file)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend", **config}))
    for path, text in (files or {}).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return folder


def pair(folder: Path):
    return ModelTokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


SPECIALS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
# A Qwen2.5-like template using what transformers' environment adds: tools and tojson with options, namespace,
# loop controls, raise_exception, strftime_now, dict, {% generation %}, the special tokens, reasoning aliases.
TOOL_TEMPLATE = r"""{%- set ns = namespace(turns=0, last_user=-1) %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}
    {%- else %}{{- 'Year ' + strftime_now('%Y') }}{%- endif %}
    {{- '\n\n# Tools\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}{{- tool | tojson }}
        {%- if loop.index >= 3 %}{% break %}{% endif %}
    {%- endfor %}
    {{- '\n</tools>\n' + (dict(a=1, b=[1, 2]) | tojson(indent=2, sort_keys=True)) + eos_token + '\n' }}
{%- elif messages[0].role != 'system' %}
    {{- bos_token + 'system\nDefault system.' + eos_token + '\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and (loop.first and tools) %}{% continue %}{% endif %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message.role == 'assistant' %}
        {{- bos_token + 'assistant\n' }}
        {%- if message.reasoning_content is defined %}
            {{- '<think>' + message.reasoning_content + '</think>' }}
        {%- endif %}
        {%- generation %}
        {{- message.content if message.content is string else '' }}
        {%- for call in message.tool_calls | default([]) %}
            {%- set written = {'name': call.function.name, 'arguments': call.function.arguments} | tojson %}
            {{- '\n<tool_call>\n' + written + '\n</tool_call>' }}
        {%- endfor %}
        {{- eos_token }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == 'tool' %}
        {{- bos_token + 'user\n<tool_response>\n' + message.content + '\n</tool_response>' + eos_token + '\n' }}
    {%- else %}
        {{- bos_token + message.role + '\n' + message.content + eos_token + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- bos_token + 'assistant\n' }}{%- endif %}
{{- '[' + ns.turns | string + ' turns; unk ' + unk_token + '; pad ' + (pad_token | default('none')) + ']' }}"""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather — «city»",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    },
    {"type": "function", "function": {"name": "noop"}},
    {"type": "function", "function": {"name": "never_listed"}},
]
TOOL_CHATS = CHATS[:5] + [
    [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and 2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
            ],
        },
        {"role": "tool", "content": "18°C"},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 18°C; 2+3=5.", "reasoning": "Both tools answered."},
    ],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "thinking": "be nice"}],
]


def test_a_template_with_tools_and_transformers_extras(tmp_path):
    ours, theirs = pair(model_folder(tmp_path, "tools", {**SPECIALS, "chat_template": TOOL_TEMPLATE}))
    for messages in TOOL_CHATS:
        for tools in (None, TOOLS, TOOLS[:1]):
            for add_generation_prompt in (True, False):
                assert ours.render_chat(messages, tools, add_generation_prompt) == their_render(
                    theirs, messages, tools, add_generation_prompt
                ), (messages, tools)
    assert_same_error(ours, theirs, [{"role": "critic", "content": "x"}])  # raise_exception
    assert_same_error(ours, theirs, [{"role": "user", "content": "x"}], tools=["not a schema"])


@pytest.mark.parametrize(
    "template",
    [
        "{% set ns = namespace(_hidden=1) %}{{ ns }}",  # the namespace refuses underscore names
        "{{ messages.append(1) }}",  # the sandbox: no mutating
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% for m in messages %}{{ m.content | upper }",  # a syntax error, at render time in both
        "{{ undefined_function() }}",
    ],
)
def test_template_errors_match(tmp_path, template):
    ours, theirs = pair(model_folder(tmp_path, "bad", {**SPECIALS, "chat_template": template}))
    assert_same_error(ours, theirs, [{"role": "user", "content": "x"}])


def test_several_templates(tmp_path):
    default, tool_use = "D:{{ messages[0].content }}", "T:{{ tools | length }}:{{ messages[0].content }}"
    messages = [{"role": "user", "content": "x"}]
    listed = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    for name, config, files in [
        ("listed", {**SPECIALS, "chat_template": listed}, {}),
        ("files", SPECIALS, {"chat_template.jinja": default, "additional_chat_templates/tool_use.jinja": tool_use}),
        ("files_win", {**SPECIALS, "chat_template": "config"}, {"chat_template.jinja": default}),
    ]:
        ours, theirs = pair(model_folder(tmp_path, name, config, files))
        for tools in (None, TOOLS):
            assert ours.render_chat(messages, tools) == their_render(theirs, messages, tools), (name, tools)
    ours, theirs = pair(model_folder(tmp_path, "no_default", {**SPECIALS, "chat_template": listed[1:]}))
    assert_same_error(ours, theirs, messages)  # "multiple chat templates with no default"
    assert ours.render_chat(messages, TOOLS) == their_render(theirs, messages, TOOLS)


def test_no_chat_template_is_refused_at_start(tmp_path):
    folder = model_folder(tmp_path, "none", SPECIALS)
    assert not transformers.AutoTokenizer.from_pretrained(str(folder)).chat_template
    with pytest.raises(ValueError, match=r"has no chat template; /v1/chat/completions needs one"):
        ModelTokenizer(folder)
    with pytest.raises(ValueError, match="has no chat template"):
        ModelTokenizer(model_folder(tmp_path, "empty", SPECIALS, {"chat_template.jinja": ""}))


def test_special_tokens_old_and_new_style(tmp_path):
    """Named tokens as AddedToken dicts, a model's own *_token, extra tokens (some new to the vocabulary), the
    legacy special_tokens_map.json: the same backend, encoding, decoding and template variables."""

    def added(content):
        return {
            "__type": "AddedToken",
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    template = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ image_token }}|{{ sep_token }}"
    configs = {
        "dicts": (
            {
                "bos_token": added("<|im_start|>"),
                "eos_token": added("<|im_end|>"),
                "unk_token": "<|endoftext|>",
                "image_token": "<|image|>",
                "additional_special_tokens": ["<|extra_a|>", "<jupyter_code>"],
                "chat_template": template,
            },
            {},
        ),
        "legacy": (
            {"chat_template": template, "model_max_length": 8192},
            {
                "special_tokens_map.json": json.dumps(
                    {
                        "bos_token": {
                            "content": "<|im_start|>",
                            "lstrip": False,
                            "normalized": False,
                            "rstrip": False,
                            "single_word": False,
                        },
                        "eos_token": "<|im_end|>",
                        "pad_token": "<|endoftext|>",
                        "sep_token": "<|sep|>",
                        "additional_special_tokens": ["<|extra_b|>"],
                    }
                )
            },
        ),
        "named_dict": ({**SPECIALS, "extra_special_tokens": {"image_token": "<|img|>"}, "chat_template": template}, {}),
    }
    for name, (config, files) in configs.items():
        ours, theirs = pair(model_folder(tmp_path, name, config, files))
        theirs("warm up")
        assert json.loads(ours.tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str()), name
        messages = [{"role": "user", "content": "x"}]
        assert ours.render_chat(messages) == their_render(theirs, messages), name
        for text in ("<|image|> <|img|> <|extra_a|><|extra_b|> <|sep|> <jupyter_code>", *TEXTS[:15]):
            ids = theirs(text).input_ids
            assert ours.encode(text) == ids and ours.decode(ids) == theirs.decode(ids), (name, text)


@pytest.mark.parametrize(
    "config",
    [
        {"clean_up_tokenization_spaces": True},  # transformers ignores it for a BPE tokenizer
        {
            "clean_up_tokenization_spaces": True,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True,
        },
        {"split_special_tokens": True},
    ],
)
def test_decoding_and_encoding_options(tmp_path, config):
    ours, theirs = pair(model_folder(tmp_path, "options", {**SPECIALS, **config, "chat_template": "x"}))
    for text in TEXTS:
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert [ours.token_text(i) for i in ids[:50]] == [
            theirs.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids[:50]
        ]
