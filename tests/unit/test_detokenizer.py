"""backend/core/detokenizer.py: incremental detokenization with the real SmolLM2 tokenizer (multi-byte characters
split across tokens), and stop strings (cut, held back while undecided, never leaked to a stream)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.core.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"


def stream(detok: IncrementalDetokenizer, ids, finish=True):
    """Feed ids one by one as the engine does; returns (deltas, index of the token that hit a stop or None)."""
    deltas, stopped_at = [], None
    for i, token_id in enumerate(ids):
        if detok.append(token_id):
            stopped_at = i
            break
        deltas.append(detok.take_new_text(False))
    if finish:
        detok.flush()
        deltas.append(detok.take_new_text(True))
    return deltas, stopped_at


# ------------------------------------------------------------------------------- multi-byte characters


def test_utf8_characters_split_across_tokens(tokenizer):
    text = "héllo 日本語 🙂 emoji"
    ids = tokenizer(text).input_ids
    # the premise: some tokens hold only part of a character
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)
    prompt = tokenizer("Say:").input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas, stopped = stream(detok, ids)
    assert stopped is None
    for delta in deltas:
        assert REPLACEMENT not in delta
        delta.encode("utf-8")  # valid text
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.text == text
    # a character is emitted whole, the moment its last byte arrives
    assert " 日" in deltas and "語" in deltas
    assert [d for d in deltas if "🙂" in d] == [" 🙂"]


def test_leading_space_is_rendered(tokenizer):
    prompt = tokenizer("Hello").input_ids
    ids = tokenizer(" world, again").input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas, _ = stream(detok, ids)
    assert deltas[0] == " world"
    assert "".join(deltas) == " world, again"


def test_prompt_ending_mid_window_of_multibyte_tokens(tokenizer):
    prompt = tokenizer("日本語の文章です。🙂🙂").input_ids  # the 6-token context starts mid-character
    ids = tokenizer("語🙂 ok").input_ids
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(deltas) == "語🙂 ok"
    assert all(REPLACEMENT not in d for d in deltas)


def test_incomplete_bytes_at_the_end_are_flushed_like_a_full_decode(tokenizer):
    ids = tokenizer("ok 日").input_ids
    assert tokenizer.decode(ids[-1:]).endswith(REPLACEMENT) or len(ids) >= 3
    # cut the last character's bytes: the sequence ends (max_tokens) in the middle of it
    partial = []
    for n in range(1, len(ids) + 1):
        if tokenizer.decode(ids[:n]).endswith(REPLACEMENT):
            partial = ids[:n]
            break
    assert partial, "the premise: some prefix of the ids ends inside a character"
    detok = IncrementalDetokenizer(tokenizer, tokenizer("x").input_ids)
    deltas, _ = stream(detok, partial)
    assert "".join(deltas) == tokenizer.decode(partial)
    assert deltas[-1].endswith(REPLACEMENT)  # only the final flush shows the broken character


def test_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer("Hi").input_ids + [eos]
    skip, _ = stream(IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=True), ids)
    keep, _ = stream(IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False), ids)
    assert "".join(skip) == "Hi"
    assert "".join(keep) == "Hi" + tokenizer.eos_token


ALPHABET = "ab é日本語🙂\n"


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=30), prompt=st.text(alphabet=ALPHABET, max_size=10))
def test_incremental_equals_full_decode(tokenizer, text, prompt):
    ids = tokenizer(text).input_ids
    prompt_ids = tokenizer(prompt).input_ids if prompt else [1]
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, prompt_ids), ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all(REPLACEMENT not in d for d in deltas)


# ------------------------------------------------------------------------------------------ stop strings


def test_stop_string_spanning_tokens(tokenizer):
    ids = tokenizer(" fooSTOPbar and more").input_ids
    assert [tokenizer.decode([i]) for i in ids[:3]] == [" foo", "STOP", "bar"]
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["Pba"])
    deltas, stopped = stream(detok, ids)
    assert stopped == 2  # found when "bar" arrives
    streamed = "".join(deltas)
    assert streamed == " fooSTO"
    assert detok.text == " fooSTO"
    for i in range(len(deltas)):
        assert "Pba" not in "".join(deltas[: i + 1])
    # the "P" was held back while it could still start the stop string
    assert deltas[:2] == [" foo", "STO"]


def test_held_back_text_is_released_when_the_match_fails(tokenizer):
    ids = tokenizer(" fooSTOPbar").input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["Pbaz"])
    deltas, stopped = stream(detok, ids, finish=False)
    assert stopped is None
    assert deltas == [" foo", "STO", "Pbar"]  # "P" held until "bar" shows it is not "Pbaz"


def test_undecided_tail_goes_out_when_the_sequence_ends(tokenizer):
    ids = tokenizer(" fooSTOPbar").input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["Pbarz"])
    deltas, stopped = stream(detok, ids, finish=False)
    assert stopped is None
    assert deltas == [" foo", "STO", ""]  # "Pbar" could still become "Pbarz": held
    detok.flush()
    assert detok.take_new_text(True) == "Pbar"  # the sequence ended (say max_tokens): everything goes out


def test_stop_string_inside_one_token(tokenizer):
    ids = tokenizer("The stop word END here").input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["ND"])
    deltas, stopped = stream(detok, ids)
    assert "".join(deltas) == "The stop word E"
    assert tokenizer.decode([ids[stopped]]) == " END"


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer(" fooSTOPbar and more").input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["Pba"], include_stop_str_in_output=True)
    deltas, stopped = stream(detok, ids)
    assert stopped == 2
    assert "".join(deltas) == " fooSTOPba"  # the stop string, and nothing after it


def test_earliest_of_several_stop_strings(tokenizer):
    ids = tokenizer("one two three four").input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["four", " tw", "three"])
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == "one"


def test_stop_string_with_multibyte_characters(tokenizer):
    ids = tokenizer("héllo 日本語 🙂 emoji").input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["語 🙂"])
    deltas, stopped = stream(detok, ids)
    assert "".join(deltas) == "héllo 日本"
    assert all(REPLACEMENT not in d and "語" not in d for d in deltas)


def test_stop_string_at_the_very_start(tokenizer):
    ids = tokenizer("STOP now").input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["STOP"])
    deltas, stopped = stream(detok, ids)
    assert stopped == 0 and "".join(deltas) == ""


class PieceTokenizer:
    """A tokenizer whose ids decode to fixed text pieces: lets hypothesis pick any tokenisation."""

    PIECES = ["a", "b", "c", "ab", "ba", "abc", "cab", " ", "x", "aa", "\n", "bcb"]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.PIECES[i] for i in ids)


def reference_stop(pieces, stops, include):
    """The text a client should get: grow the text piece by piece, cut at the first stop string to complete."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            index, stop = min(hits)
            return (text[: index + len(stop)] if include else text[:index]), True
    return text, False


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(PieceTokenizer.PIECES) - 1), min_size=1, max_size=25),
    stops=st.lists(st.text(alphabet="abc x", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_strings_property(ids, stops, include):
    tok = PieceTokenizer()
    detok = IncrementalDetokenizer(tok, [7], stop=stops, include_stop_str_in_output=include)
    expected, should_stop = reference_stop([tok.PIECES[i] for i in ids], stops, include)
    sent = ""
    stopped = False
    for token_id in ids:
        if detok.append(token_id):
            stopped = True
            break
        sent += detok.take_new_text(False)
        # nothing sent is ever taken back, and no stop string is ever sent
        assert expected.startswith(sent)
        assert not any(s in sent for s in stops)
    detok.flush()
    sent += detok.take_new_text(True)
    assert stopped == should_stop
    assert sent == expected == detok.text


def test_no_stop_strings_no_hold_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1])
    assert detok.hold_back == 0
    detok.append(tokenizer("S").input_ids[0])
    assert detok.take_new_text(False) == "S"


def test_take_new_text_is_idempotent(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["zzz"])
    for token_id in tokenizer("abc").input_ids:
        detok.append(token_id)
    first = detok.take_new_text(False)
    assert detok.take_new_text(False) == ""
    assert first == "abc"
    assert detok.take_new_text(True) == ""


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_never_leaks_into_deltas_token_by_token(tokenizer, include):
    text = "Answer: 42.\n\nQuestion: next?"
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["\n\nQuestion"], include_stop_str_in_output=include)
    deltas, stopped = stream(detok, ids)
    assert stopped is not None
    joined = "".join(deltas)
    assert joined == ("Answer: 42.\n\nQuestion" if include else "Answer: 42.")
    if not include:
        assert all("\n" not in d for d in deltas)  # even the newlines that might start it were held
