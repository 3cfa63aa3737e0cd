"""frontend/tokenizer.py's chat template (Jinja2, no transformers) against transformers' apply_chat_template:
the prompt and its errors for the served model's folder and the chats the front door renders, and for folders
made here to reach what that one does not (a template with tools and transformers' extras, several templates,
none)."""

from __future__ import annotations

import pytest

from frontend.errors import APIError
from frontend.openai_protocol import chat_messages
from frontend.tokenizer import ModelTokenizer
from frontend.tools import conversation, parse_tool_calling
from tests.unit.tokenizer_folders import SPECIALS, model_folder, pair, their_render

transformers = pytest.importorskip("transformers")

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


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    "{{ bos_token if keep_bos else '' }}"
)


def test_chat_template_kwargs_as_transformers_passes_them(tmp_path):
    """vLLM's chat_template_kwargs: more template variables (Qwen3's enable_thinking), overriding special tokens."""
    ours, theirs = pair(model_folder(tmp_path, "thinking", {**SPECIALS, "chat_template": THINKING_TEMPLATE}))
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "be nice"},
        {"role": "user", "content": "again"},
    ]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}, {"keep_bos": 1, "bos_token": "<B>"}):
        rendered = ours.render_chat(messages, template_kwargs=kwargs)
        assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.render_chat(messages, template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    # through the chat path: an assistant message's reasoning_content reaches the template
    assert "<think>be nice</think>" in ours.render_chat(conversation(chat_messages(messages), None))
