"""backend/spec/suffix_index.py: suffix matching over token lists and the frequency-scored draft (longest match,
most frequent continuation, path probability threshold, draft length by match length), and the per-request index
as its tokens grow."""

import random

from backend.spec.suffix_index import MAX_CANDIDATES, SequenceIndex, best_draft


def draft(tokens, k=8, max_depth=24, spec_factor=4.0, min_token_prob=0.1):
    index = SequenceIndex()
    index.update(tokens)
    return best_draft(index.candidates(tokens), tokens, k, max_depth, spec_factor, min_token_prob)


def test_continues_the_earlier_occurrence_of_the_context():
    assert draft([1, 2, 3, 4, 5, 6, 9, 1, 2], k=3).tokens == [3, 4, 5]
    assert draft([1, 2, 3, 4, 5, 6, 9, 1, 2], k=3).score == 3.0  # one occurrence: every token certain


def test_no_draft_without_an_earlier_occurrence_of_the_last_two_tokens():
    assert draft([5, 6, 7, 8]).tokens == []
    assert draft([1, 2, 3, 9, 2]).tokens == []  # one matching token is not a match
    assert draft([7]).tokens == []


def test_the_most_frequent_continuation_wins_with_its_probability():
    tokens = [5, 1, 2, 7, 6, 1, 2, 8, 9, 1, 2, 8, 3, 1, 2]  # "1 2" after different tokens: equal matches
    result = draft(tokens, k=1)
    assert result.tokens == [8]
    assert abs(result.score - 2 / 3) < 1e-9


def test_a_tie_goes_to_the_latest_occurrence():
    assert draft([5, 1, 2, 7, 6, 1, 2, 8, 9, 1, 2], k=1).tokens == [8]


def test_the_walk_stops_where_the_path_probability_falls_below_the_threshold():
    # after "1 2 3": 4 twice, then 5 or 6: the path's probability halves at the second token
    tokens = [9, 1, 2, 3, 4, 5, 0, 8, 1, 2, 3, 4, 6, 0, 7, 1, 2, 3]
    assert draft(tokens, k=4, min_token_prob=0.6).tokens == [4]
    result = draft(tokens, k=4, min_token_prob=0.5)
    assert result.tokens == [4, 6, 0, 7]  # the latest on the tie, then the one path left
    assert abs(result.score - 2.5) < 1e-9  # 1 + 0.5 + 0.5 + 0.5


def test_a_longer_match_beats_a_more_recent_shorter_one():
    # "8 1 2" was followed by 3; the latest "1 2" by 5
    tokens = [8, 1, 2, 3, 3, 3, 0, 1, 2, 5, 5, 5, 0, 8, 1, 2]
    assert draft(tokens, k=3, spec_factor=1.0).tokens == [3, 3, 3]


def test_the_draft_is_at_most_spec_factor_times_the_match_length_and_k():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert draft(tokens, k=8, spec_factor=1.0).tokens == [3, 4]  # a 2-token match drafts 2
    assert draft(tokens, k=8, spec_factor=2.0).tokens == [3, 4, 5, 6]
    assert draft(tokens, k=3, spec_factor=4.0).tokens == [3, 4, 5]
    assert draft(tokens, k=0).tokens == []


def test_patterns_are_matched_up_to_max_depth():
    # "3 10 11 12 13" was followed by 0, "4 10 11 12 13" (later) by 1
    tokens = [3, 10, 11, 12, 13, 0, 4, 10, 11, 12, 13, 1, 3, 10, 11, 12, 13]
    assert draft(tokens, k=1, max_depth=24).tokens == [0]  # the five-token match
    shallow = draft(tokens, k=1, max_depth=4)  # both match four tokens: the latest wins at 50 %
    assert (shallow.tokens, shallow.score) == ([1], 0.5)


def test_self_overlapping_repetition():
    assert draft([4, 4, 4], k=3).tokens == [4]  # the continuation runs into the context's own end
    assert draft([1, 2, 1, 2, 1, 2], k=4, spec_factor=2.0).tokens == [1, 2, 1, 2]


def test_updates_as_the_tokens_grow_equal_one_index_of_the_whole():
    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(400)]
    grown = SequenceIndex()
    for end in range(0, len(tokens), 7):
        grown.update(tokens[:end])
        whole = SequenceIndex()
        whole.update(tokens[:end])
        assert grown.positions == whole.positions
        context = tokens[:end]
        assert grown.candidates(context) == whole.candidates(context)


def test_only_the_latest_occurrences_are_weighed():
    tokens = [1, 2, 3] * (MAX_CANDIDATES + 10) + [1, 2]
    index = SequenceIndex()
    index.update(tokens)
    found = index.candidates(tokens)
    assert len(found) == MAX_CANDIDATES
    assert [p for _, p, _ in found] == sorted((p for _, p, _ in found), reverse=True)
    assert found[0][1] == len(tokens) - 3 + 2 - 2  # the latest position after "1 2"
