"""frontend/tokenization.py: /tokenize and /detokenize bodies, with a stand-in tokenizer (the real one is in
tests/integration/test_openai_scoring_e2e.py)."""

from __future__ import annotations

import pytest

from frontend.errors import APIError
from frontend.tokenization import detokenize, tokenize


class Tokenizer:
    """One token per character; a leading BOS (0) when special tokens are added."""

    vocab_size = 200

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def token_text(self, token_id):
        return chr(token_id)


def render(messages):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_tokenize_a_prompt_or_a_chat():
    model, answer = tokenize({"model": "llm", "prompt": "ab"}, ["llm"], Tokenizer(), render)
    assert model == "llm" and answer == {"count": 3, "tokens": [0, 97, 98], "token_strs": None}
    _, plain = tokenize(
        {"model": "llm", "prompt": "ab", "add_special_tokens": False, "return_token_strs": True},
        ["llm"],
        Tokenizer(),
        render,
    )
    assert plain == {"count": 2, "tokens": [97, 98], "token_strs": ["a", "b"]}
    _, chat = tokenize({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}, ["llm"], Tokenizer(), render)
    assert Tokenizer().decode(chat["tokens"]) == "<user>hi<assistant>"  # the template brings its own specials


def test_detokenize():
    assert detokenize({"model": "llm", "tokens": [104, 105]}, ["llm"], Tokenizer()) == {"prompt": "hi"}


@pytest.mark.parametrize(
    "call, body, param",
    [
        (tokenize, {"model": "llm"}, "prompt"),
        (tokenize, {"model": "llm", "prompt": "a", "messages": []}, "prompt"),
        (tokenize, {"model": "llm", "prompt": ["a"]}, "prompt"),
        (tokenize, {"model": "llm", "prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        (
            tokenize,
            {"model": "llm", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
            "add_generation_prompt",
        ),
        (tokenize, {"model": "llm", "prompt": "a", "extra": 1}, "extra"),
        (detokenize, {"model": "llm", "tokens": "ab"}, "tokens"),
        (detokenize, {"model": "llm", "tokens": [1, 200]}, "tokens"),
        (detokenize, {"model": "llm", "tokens": [True]}, "tokens"),
        (detokenize, {"tokens": [1]}, "model"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(call, body, param):
    args = (body, ["llm"], Tokenizer()) + ((render,) if call is tokenize else ())
    with pytest.raises(APIError) as info:
        call(*args)
    assert (info.value.status, info.value.param) == (400, param), info.value.body()
