"""frontend/openai_protocol.py: OpenAI bodies mapped onto the model's sampling_parameters, and every bad or
unsupported field a 400 (or 404 for an unknown model) naming the parameter."""

from __future__ import annotations

import pytest

from frontend.errors import APIError
from frontend.openai_protocol import parse_chat, parse_completion

SERVED = ["llm", "llm_small_queue"]
VOCAB = 49152
MESSAGES = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}}


def render(messages: list[dict]) -> str:
    """A stand-in chat template: role: content lines, then the assistant's turn."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def chat(**body):
    return parse_chat({"model": "llm", "messages": MESSAGES, **body}, SERVED, 256, render)


def completion(**body):
    return parse_completion({"model": "llm", "prompt": "Once", **body}, SERVED, 256, VOCAB)


def refused(parse, **body) -> APIError:
    with pytest.raises(APIError) as info:
        parse(**body)
    return info.value


def test_chat_maps_openai_and_vllm_parameters_onto_sampling_parameters():
    g = chat(
        max_completion_tokens=12,
        temperature=0.5,
        top_p=0.9,
        n=2,
        stop=["\n"],
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=True,
        top_logprobs=3,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
        user="u1",
    )
    assert g.prompts == ["user: Hi\nassistant:"]
    assert g.sampling == {
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "stop": ["\n"],
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "max_tokens": 12,
        "logprobs": 3,
    }
    assert (g.n, g.stream, g.include_usage, g.logprobs, g.echo, g.num_choices) == (2, True, True, 3, False, 2)


def test_chat_defaults_and_message_forms():
    g = chat()
    assert g.sampling == {"max_tokens": 256} and g.logprobs is None and not g.stream and g.n == 1
    assert chat(max_tokens=5).sampling["max_tokens"] == 5
    assert chat(logprobs=True).logprobs == 0  # the chosen token only
    assert chat(temperature=None).sampling == {"max_tokens": 256}  # null means the default
    parts = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert parse_chat({"model": "llm", "messages": parts}, SERVED, 8, render).prompts == [
        "system: Be brief.\nuser: ab\nassistant:"
    ]


def test_completion_prompts_echo_and_logprobs():
    g = completion(prompt=["a", "b"], n=2, echo=True, max_tokens=3)
    assert g.prompts == ["a", "b"] and g.num_choices == 4 and g.echo and g.sampling == {"n": 2, "max_tokens": 3}
    assert completion(logprobs=2).sampling["logprobs"] == 2
    assert completion(best_of=1).n == 1


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        (["a", [5, 6]], ["a", [5, 6]]),
        ([VOCAB - 1], [[VOCAB - 1]]),
    ],
)
def test_completion_token_id_prompts(prompt, expected):
    assert completion(prompt=prompt).prompts == expected


def test_echo_with_logprobs_or_max_tokens_zero_scores_the_prompt():
    g = completion(prompt=[[1, 2, 3]], echo=True, logprobs=1, max_tokens=1)
    assert g.sampling == {"max_tokens": 1, "logprobs": 1, "prompt_logprobs": 1} and g.echo
    assert completion(echo=True, max_tokens=0).sampling == {"max_tokens": 0, "prompt_logprobs": 0}
    assert "prompt_logprobs" not in completion(logprobs=1).sampling  # no echo: the prompt is not scored
    assert completion(logit_bias={"42": -100, "7": 5}).sampling["logit_bias"] == {"42": -100, "7": 5}


def test_prompts_times_n_are_bounded():
    assert len(completion(prompt=["x"] * 64).prompts) == 64
    err = refused(completion, prompt=["x"] * 2000)
    assert (err.status, err.param, err.code) == (400, "prompt", "too_many_prompts") and "2000" in err.message
    assert refused(completion, prompt=["x"] * 9, n=8).code == "too_many_prompts"
    err = refused(lambda: parse_completion({"model": "llm", "prompt": ["x"] * 3}, SERVED, 8, VOCAB, max_prompts=2))
    assert "at most 2" in err.message


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"temperature": -1}, "temperature", None),
        ({"temperature": "hot"}, "temperature", None),
        ({"top_p": 0}, "top_p", None),
        ({"n": 0}, "n", None),
        ({"n": True}, "n", None),
        ({"max_tokens": 0}, "max_tokens", None),
        ({"max_completion_tokens": -1}, "max_completion_tokens", None),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", None),
        ({"stop": [1, 2]}, "stop", None),
        ({"stop": ""}, "stop", None),
        ({"seed": -1}, "seed", None),
        ({"presence_penalty": 3}, "presence_penalty", None),
        ({"top_logprobs": 2}, "top_logprobs", None),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", None),
        ({"logprobs": 3}, "logprobs", None),
        ({"logit_bias": {"50256": -101}}, "logit_bias[50256]", None),
        ({"logit_bias": {"a": 1}}, "logit_bias", None),
        ({"tools": [{"type": "function"}]}, "tools[0]", None),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", None),
        ({"tools": [TOOL, TOOL]}, "tools", None),
        ({"tools": []}, "tools", None),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", None),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", None),
        ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "response_format", None),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", None),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
            "response_format.json_schema.schema",
            None,
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),
        ({"stream": True, "stream_options": {"chunk": 1}}, "stream_options.chunk", "unsupported_parameter"),
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"messages": []}, "messages", None),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            None,
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", None),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0].tool_calls",
            None,
        ),
        ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages[0].audio", "unsupported_parameter"),
    ],
)
def test_bad_chat_fields_are_400s_naming_the_parameter(body, param, code):
    err = refused(chat, **body)
    assert (err.status, err.type, err.param, err.code) == (400, "invalid_request_error", param, code), err.body()
    assert err.message


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1, True]]}, "prompt"),
        ({"prompt": [VOCAB]}, "prompt"),
        ({"prompt": [[-1]]}, "prompt"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": True}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": "yes"}, "echo"),
        ({"messages": MESSAGES}, "messages"),  # a chat field on the completions route
    ],
)
def test_bad_completion_fields_are_400s(body, param):
    err = refused(completion, **body)
    assert (err.status, err.param) == (400, param), err.body()


def test_model_is_required_and_must_be_served():
    assert refused(lambda: parse_chat({"messages": MESSAGES}, SERVED, 8, render)).param == "model"
    err = refused(chat, model="gpt-4")
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert chat(model="llm_small_queue").model == "llm_small_queue"


def test_body_must_be_an_object():
    assert refused(lambda: parse_completion(["prompt"], SERVED, 8, VOCAB)).status == 400


def test_response_format_becomes_a_structured_output_key():
    assert chat(response_format={"type": "text"}).sampling == {"max_tokens": 256}
    assert chat(response_format={"type": "json_object"}).sampling["guided_json_object"] is True
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    spec = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert chat(response_format=spec).sampling["guided_json"] == schema
    assert (
        chat(response_format={"type": "json_schema", "json_schema": {"name": "any"}}).sampling["guided_json_object"]
        is True
    )
    assert chat(guided_regex="a+").sampling["guided_regex"] == "a+"  # vLLM's extras pass through
    assert completion(guided_choice=["x", "y"]).sampling["guided_choice"] == ["x", "y"]
    err = refused(chat, guided_regex="a", guided_choice=["a"])  # the engine's own rule
    assert err.status == 400 and "at most one output constraint" in err.message


def test_tools_are_listed_in_the_system_message_and_forced_calls_are_a_grammar():
    auto = chat(tools=[TOOL])
    assert auto.tool_calling.choice == "auto" and "guided_grammar" not in auto.sampling
    assert auto.prompts[0].startswith("system: You may call one or more functions")
    assert '"name": "get_weather"' in auto.prompts[0] and auto.prompts[0].endswith("user: Hi\nassistant:")
    required = chat(tools=[TOOL], tool_choice="required")
    assert (
        required.tool_calling.choice == "required"
        and 'call: "<tool_call>\\n" %json' in required.sampling["guided_grammar"]
    )
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_calling.choice == "get_weather" and "guided_grammar" in named.sampling
    none = chat(tools=[TOOL], tool_choice="none")
    assert none.tool_calling is None and none.prompts == ["user: Hi\nassistant:"]


def test_earlier_tool_calls_and_results_are_written_into_the_conversation():
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    g = parse_chat({"model": "llm", "messages": history, "tools": [TOOL]}, SERVED, 8, render)
    prompt = g.prompts[0]
    assert prompt.startswith("system: Be brief.\n\nYou may call")
    assert 'assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' in prompt
    assert prompt.endswith("user: <tool_response>\n-3 C\n</tool_response>\nassistant:")
