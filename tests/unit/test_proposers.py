"""Draft proposers: n-gram lookup rules and the draft model's agreement with the target."""

import pytest

from backend.spec.proposers import NgramProposer


@pytest.mark.parametrize(
    "tokens, k, expected",
    [
        ([1, 2, 3, 4, 1, 2], 2, [3, 4]),  # continue after the earlier "1 2"
        ([1, 2, 3, 1, 2, 9, 1, 2], 3, [9, 1, 2]),  # the latest match wins
        ([5, 6, 7, 8], 3, []),  # no earlier occurrence of the tail
        ([7, 1, 2, 3, 9, 2, 3], 2, [9, 2]),  # the longest n that matches (n=2: "2 3")
        ([4, 4, 4], 5, [4]),  # a continuation shorter than k is fine
    ],
)
def test_ngram_lookup(tokens, k, expected):
    assert NgramProposer(1, 4).lookup(tokens, k) == expected


def test_ngram_respects_min_n():
    assert NgramProposer(2, 4).lookup([1, 2, 3, 9, 1], 2) == []
    assert NgramProposer(1, 4).lookup([1, 2, 3, 9, 1], 2) == [2, 3]
