"""backend/protocol/sampling_params.py: loosely typed client values become a validated SamplingParams; every bad
value raises InvalidRequest with a message naming the field."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.protocol.sampling_params import SamplingParams
from backend.protocol.values import InvalidRequest


def test_defaults():
    params = SamplingParams.from_dict({})
    assert params == SamplingParams()
    assert params.n == 1 and params.max_tokens == 16 and params.temperature == 1.0
    assert not params.greedy and not params.uses_penalties
    assert params.logprobs is None and params.seed is None and params.stop == []


def test_strings_are_accepted():
    params = SamplingParams.from_dict(
        {
            "temperature": "0.7",
            "top_p": " 0.9 ",
            "top_k": "40",
            "max_tokens": "12",
            "min_tokens": "2",
            "ignore_eos": "true",
            "skip_special_tokens": "False",
            "include_stop_str_in_output": "1",
            "seed": "123",
            "n": "2",
            "repetition_penalty": "1.1",
            "presence_penalty": "-0.5",
            "frequency_penalty": "0.25",
            "min_p": "0.05",
        }
    )
    assert params.temperature == pytest.approx(0.7)
    assert params.top_p == pytest.approx(0.9)
    assert params.top_k == 40 and params.max_tokens == 12 and params.min_tokens == 2
    assert params.ignore_eos is True and params.skip_special_tokens is False
    assert params.include_stop_str_in_output is True
    assert params.seed == 123 and params.n == 2
    assert params.repetition_penalty == pytest.approx(1.1)
    assert params.presence_penalty == -0.5 and params.frequency_penalty == 0.25
    assert params.min_p == pytest.approx(0.05)
    assert params.uses_penalties


def test_numbers_of_other_types():
    params = SamplingParams.from_dict({"max_tokens": 8.0, "temperature": 1, "ignore_eos": 1, "n": 3.0})
    assert params.max_tokens == 8 and isinstance(params.max_tokens, int)
    assert params.temperature == 1.0 and params.ignore_eos is True and params.n == 3


def test_greedy_when_temperature_zero():
    assert SamplingParams.from_dict({"temperature": "0"}).greedy
    assert not SamplingParams.from_dict({"temperature": "0.01"}).greedy


def test_none_values_mean_default():
    params = SamplingParams.from_dict({"seed": None, "max_tokens": None, "stop": None})
    assert params.seed is None and params.max_tokens == 16 and params.stop == []


def test_stop_forms_and_alias():
    assert SamplingParams.from_dict({"stop": "END"}).stop == ["END"]
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ["a", "b"]
    assert SamplingParams.from_dict({"stop_words": ["x"]}).stop == ["x"]
    assert SamplingParams.from_dict({"stop_token_ids": ["5", 6.0]}).stop_token_ids == [5, 6]


def test_logprobs_forms():
    assert SamplingParams.from_dict({"logprobs": True}).logprobs == 0
    assert SamplingParams.from_dict({"logprobs": False}).logprobs is None
    assert SamplingParams.from_dict({"logprobs": "3"}).logprobs == 3


@pytest.mark.parametrize(
    "values, fragment",
    [
        ({"n": 0}, "n must be between 1 and 8"),
        ({"n": 9}, "n must be between 1 and 8"),
        ({"n": "two"}, "n must be an integer"),
        ({"n": 1.5}, "n must be an integer"),
        ({"n": True}, "n must be an integer"),
        ({"max_tokens": 0}, "max_tokens must be between 1"),
        ({"max_tokens": "1e3"}, "max_tokens must be an integer"),
        ({"max_tokens": [4]}, "max_tokens must be an integer"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be between 0 and 4 (at most max_tokens)"),
        ({"min_tokens": -1}, "min_tokens must be between"),
        ({"temperature": -0.1}, "temperature must be between"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"temperature": "nan"}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": False}, "temperature must be a number"),
        ({"temperature": None, "top_p": [0.5]}, "top_p must be a number"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.01}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be -1 or 0"),
        ({"min_p": 1.5}, "min_p must be between"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 10]"),
        ({"repetition_penalty": 11}, "repetition_penalty must be in (0, 10]"),
        ({"presence_penalty": 2.5}, "presence_penalty must be between -2.0 and 2.0"),
        ({"frequency_penalty": -3}, "frequency_penalty must be between -2.0 and 2.0"),
        ({"seed": -1}, "seed must be between"),
        ({"seed": 2**64}, "seed must be between"),
        ({"logprobs": 21}, "logprobs must be between 0 and 20"),
        ({"logprobs": "many"}, "logprobs must be an integer"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens must be between"),
        ({"stop": [1, 2]}, "stop must be a string or a list of strings"),
        ({"stop": 7}, "stop must be a string or a list of strings"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"stop": [str(i) for i in range(17)]}, "stop takes at most 16"),
        ({"stop": ["x" * 257]}, "stop strings must be at most 256 characters each, got one of 257"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids takes at most 64 ids, got 65"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers"),
        ({"stop_token_ids": [1, "x"]}, "stop_token_ids[1] must be an integer"),
        ({"ignore_eos": "yes please"}, "ignore_eos must be true or false"),
        ({"ignore_eos": 2}, "ignore_eos must be true or false"),
        (
            {"skip_special_tokens": None, "include_stop_str_in_output": []},
            "include_stop_str_in_output must be true or false",
        ),
    ],
)
def test_bad_values(values, fragment):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.from_dict(values)
    assert fragment in str(info.value)


def test_unknown_keys_rejected_and_listed():
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.from_dict({"temprature": 0.5, "beam_width": 2})
    message = str(info.value)
    assert "temprature" in message and "beam_width" in message and "temperature" in message  # allowed list


def test_limits_are_parameters():
    assert SamplingParams.from_dict({"n": 20}, max_n=32).n == 20
    with pytest.raises(InvalidRequest, match="max_tokens must be between 1 and 100"):
        SamplingParams.from_dict({"max_tokens": 101}, max_tokens_limit=100)


def test_from_dict_does_not_mutate_input():
    values = {"stop_words": ["x"], "max_tokens": "3"}
    SamplingParams.from_dict(values)
    assert values == {"stop_words": ["x"], "max_tokens": "3"}


def test_invalid_request_is_a_value_error():
    assert issubclass(InvalidRequest, ValueError)


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.floats(min_value=0, max_value=100, allow_nan=False),
    top_p=st.floats(min_value=1e-6, max_value=1.0),
    top_k=st.integers(min_value=-1, max_value=1000),
    max_tokens=st.integers(min_value=1, max_value=4096),
    as_string=st.booleans(),
)
def test_valid_values_round_trip(temperature, top_p, top_k, max_tokens, as_string):
    raw = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": max_tokens}
    if as_string:
        raw = {k: repr(v) if isinstance(v, float) else str(v) for k, v in raw.items()}
    params = SamplingParams.from_dict(raw)
    assert math.isclose(params.temperature, temperature) and math.isclose(params.top_p, top_p)
    assert params.top_k == top_k and params.max_tokens == max_tokens


def test_bad_words_and_word_bias():
    params = SamplingParams.from_dict({"bad_words": ["foo", "", "bar baz"], "word_bias": {"good": "1.5", "": 3}})
    assert params.bad_words == ["foo", "bar baz"]  # an empty phrase is no phrase (TensorRT-LLM's "")
    assert params.word_bias == {"good": 1.5}
    assert SamplingParams.from_dict({"bad_words": ""}).bad_words == []
    with pytest.raises(InvalidRequest, match="bad_words takes at most 64"):
        SamplingParams.from_dict({"bad_words": ["w"] * 65})
    with pytest.raises(InvalidRequest, match="word_bias"):
        SamplingParams.from_dict({"word_bias": {"x": 1000}})
    with pytest.raises(InvalidRequest, match="bad_words must be a string or a list of strings"):
        SamplingParams.from_dict({"bad_words": [1]})


def test_token_id_word_lists():
    params = SamplingParams.from_dict({"bad_word_ids": [[1, 2], ["3"]], "stop_word_ids": [[4]]})
    assert params.bad_word_ids == [[1, 2], [3]] and params.stop_word_ids == [[4]]
    with pytest.raises(InvalidRequest, match="stop_word_ids takes at most 64 token sequences of 1 to 64 ids"):
        SamplingParams.from_dict({"stop_word_ids": [[]]})
    with pytest.raises(InvalidRequest, match="bad_word_ids must be a list of token id lists"):
        SamplingParams.from_dict({"bad_word_ids": 5})


def test_an_empty_stop_words_string_means_none():
    """TensorRT-LLM's clients send `"stop_words": ""`; `stop` (vLLM's name) still refuses an empty string."""
    assert SamplingParams.from_dict({"stop_words": ""}).stop == []
    assert SamplingParams.from_dict({"stop_words": ["", "end"]}).stop == ["end"]
    with pytest.raises(InvalidRequest, match="must not be empty"):
        SamplingParams.from_dict({"stop": [""]})
