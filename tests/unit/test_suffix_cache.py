"""backend/spec/suffix_cache.py: the global store of finished outputs: matches across outputs and from their
lead-in, frequency order across requests, the token cap, least-recently-used eviction, and an index that holds
exactly the stored outputs' continuations."""

import random

from backend.spec.suffix_cache import SuffixCache
from backend.spec.suffix_index import best_draft

HEADER = [90, 91, 92]  # a prompt's ending shared by every request (a chat template's assistant header)


def draft(cache: SuffixCache, context: list[int], k: int = 6, min_token_prob: float = 0.1):
    return best_draft(cache.candidates(context), context, k, 24, 1.0, min_token_prob)


def stored_continuations(cache: SuffixCache) -> int:
    return sum(len(doc) - first for doc, first in cache._docs.values())


def test_a_new_output_continues_as_earlier_ones_did_from_the_prompt_ending():
    cache = SuffixCache(1000, lead_in=8)
    cache.add([1, 2, 3, *HEADER, 10, 11, 12, 13], num_prompt_tokens=6)
    assert draft(cache, [7, 8, *HEADER]).tokens == [10, 11, 12]  # a 3-token match drafts 3
    assert draft(cache, [7, 8, 9, 91, 92, 10, 11]).tokens == [12, 13]
    assert draft(cache, [1, 2, 3]).tokens == []  # the prompt itself is no continuation


def test_frequency_across_outputs_decides():
    cache = SuffixCache(1000, lead_in=8)
    for value in (20, 21, 21, 21):
        cache.add([*HEADER, 10, 11, value], num_prompt_tokens=3)
    result = draft(cache, [5, *HEADER, 10, 11], k=1)
    assert result.tokens == [21]
    assert abs(result.score - 0.75) < 1e-9
    assert draft(cache, [5, *HEADER, 10, 11], k=1, min_token_prob=0.8).tokens == []


def test_the_cap_is_respected_and_the_least_recently_used_goes_first():
    cache = SuffixCache(30, lead_in=2)
    for name in (10, 20, 30):
        cache.add([*HEADER, *range(name, name + 7)], num_prompt_tokens=3)  # 2 + 7 tokens each
    assert (len(cache), cache.num_tokens) == (3, 27)
    used = draft(cache, [0, 10, 11])
    cache.touch(used.sources)  # the oldest is used (the proposer touches what its drafts follow): now the latest
    cache.add([*HEADER, 40, 41, 42, 43, 44, 45, 46], num_prompt_tokens=3)
    assert cache.num_tokens <= 30 and len(cache) == 3
    assert draft(cache, [0, 20, 21]).tokens == []  # 20's output was the least recently used
    assert draft(cache, [0, 10, 11]).tokens == [12, 13]
    assert draft(cache, [0, 40, 41]).tokens == [42, 43]


def test_an_output_longer_than_the_cap_keeps_its_end():
    cache = SuffixCache(8, lead_in=4)
    cache.add([*HEADER, *range(100, 120)], num_prompt_tokens=3)
    assert cache.num_tokens == 8
    assert draft(cache, [0, 113, 114]).tokens == [115, 116]
    assert draft(cache, [0, 100, 101]).tokens == []


def test_nothing_is_stored_without_output():
    cache = SuffixCache(100, lead_in=4)
    cache.add([1, 2, 3], num_prompt_tokens=3)
    assert len(cache) == 0 and cache.num_tokens == 0


def test_the_index_holds_exactly_the_stored_continuations_through_evictions():
    rng = random.Random(5)
    cache = SuffixCache(500, lead_in=6)
    for _ in range(200):
        prompt = [rng.randrange(8) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(8) for _ in range(rng.randrange(1, 40))]
        cache.add(prompt + output, num_prompt_tokens=len(prompt))
        if rng.random() < 0.3:
            cache.touch(draft(cache, [rng.randrange(8) for _ in range(6)]).sources)
        assert cache.num_tokens <= 500
        assert cache.num_tokens == sum(len(doc) for doc, _ in cache._docs.values())
        assert cache.num_index_entries() == stored_continuations(cache)
    assert 10 < len(cache) < 200
