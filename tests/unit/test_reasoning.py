"""frontend/reasoning.py: think tags split off whole and streamed (tags split across pieces, no closing tag,
DeepSeek-R1's open tag in the prompt), reasoning tokens counted from the deltas' token ids, and the setting
resolved against the chat template."""

from __future__ import annotations

import pytest

from frontend.reasoning import ReasoningParser, ReasoningSplit, ThinkTags

QWEN3_STYLE = "<think>\nLet me see.\n</think>\n\nHello!"


def split(pieces: list[str], starts_inside: bool = False) -> tuple[str, str]:
    tags = ThinkTags(starts_inside)
    reasoning = content = ""
    for piece in pieces:
        r, c = tags.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = tags.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_whole_and_streamed_give_the_same_split(size):
    pieces = [QWEN3_STYLE[i : i + size] for i in range(0, len(QWEN3_STYLE), size)]
    assert split(pieces) == ("\nLet me see.\n", "Hello!")


def test_tags_split_across_pieces():
    assert split(["  <th", "ink>ab", "c</th", "ink", ">", "\n\n", "Hi </think> there"]) == (
        "abc",
        "Hi </think> there",  # after the reasoning, tags are the answer's text
    )
    assert split(["<think>a </thin", "g> b</think>c"]) == ("a </thing> b", "c")  # not a tag after all


def test_no_closing_tag_is_all_reasoning():
    assert split(["<think>", "still thinking", " </thi"]) == ("still thinking </thi", "")
    assert split(["more thought"], starts_inside=True) == ("more thought", "")


def test_deepseek_r1_starts_inside_without_an_opening_tag():
    assert split(["First, ", "think.</think>", "The answer."], starts_inside=True) == ("First, think.", "The answer.")
    assert split(["<think>x</think>y"], starts_inside=True) == ("x", "y")  # an opening tag written anyway


def test_without_a_tag_at_the_start_it_is_all_answer():
    assert split(["Hello <think>x</think>"]) == ("", "Hello <think>x</think>")
    assert split(["  ", "<thi"]) == ("", "  <thi")  # held back, then let go at the end
    assert split([""]) == ("", "")


def count(deltas: list[tuple[str, list[int]]], starts_inside: bool = False, decode=None) -> tuple[str, str, int]:
    parts = ReasoningSplit(starts_inside, decode)
    reasoning = content = ""
    for text, ids in deltas:
        r, c = parts.feed(text, ids)
        reasoning, content = reasoning + r, content + c
    r, c = parts.finish()
    assert parts.reasoning == reasoning + r
    return reasoning + r, content + c, parts.tokens


def test_reasoning_tokens_are_the_tokens_inside_the_tags():
    one_each = [("<think>", [1]), ("a", [2]), (" b", [3]), ("</think>", [4]), ("\n\n", [5]), ("Hi", [6])]
    assert count(one_each) == ("a b", "Hi", 2)
    # a tag split over tokens: the tokens of the tag are held back, then not counted
    assert count([("<th", [1]), ("ink>", [2]), ("a", [3]), ("</", [4]), ("think>", [5]), ("b", [6])]) == ("a", "b", 1)
    # held back as a possible tag, then reasoning after all: counted
    assert count([("<think>a", [1, 2]), ("</", [3]), ("b", [4])]) == ("a</b", "", 4)
    assert count([("x", [1]), ("y", [2])], starts_inside=True) == ("xy", "", 2)  # cut off inside: all of it
    assert count([("Hello", [1, 2])]) == ("", "Hello", 0)


def test_a_delta_across_the_closing_tag_counts_its_tokens_up_to_it():
    vocab = {1: "ab", 2: "c", 3: "</think>", 4: "\n\n", 5: "Hi", 6: "b"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    assert count([("abc</think>\n\nHi", [1, 2, 3, 4, 5])], True, decode) == ("abc", "Hi", 2)
    assert count([("a", [9]), ("bc</think>", [6, 2, 3]), ("Hi", [5])], True, decode) == ("abc", "Hi", 3)


QWEN3_TEMPLATE = "{% for m in messages %}...{% endfor %}{% if add_generation_prompt %}<think>{% endif %}"


def test_the_setting_resolved_against_the_chat_template():
    assert ReasoningParser("auto", QWEN3_TEMPLATE).name == "qwen3"
    assert ReasoningParser("auto", {"default": "x", "tool_use": "</think>"}).name == "qwen3"
    assert ReasoningParser("auto", "{{ messages }}").name == "none"
    assert ReasoningParser("auto", None).name == "none"
    assert ReasoningParser("none", QWEN3_TEMPLATE).for_prompt("<think>\n") is None
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        ReasoningParser("o1", QWEN3_TEMPLATE)


def test_the_prompt_says_whether_the_answer_starts_inside_the_reasoning():
    qwen3, r1 = ReasoningParser("qwen3", None), ReasoningParser("deepseek_r1", None)
    assert qwen3.for_prompt("<|im_start|>assistant\n<think>\n").starts_inside
    assert not qwen3.for_prompt("<|im_start|>assistant\n").starts_inside
    # Qwen3 with enable_thinking false: an empty pair in the prompt, the answer follows
    assert not qwen3.for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n").starts_inside
    assert not qwen3.for_prompt([1, 2, 3]).starts_inside
    assert r1.for_prompt("<｜Assistant｜>").starts_inside
