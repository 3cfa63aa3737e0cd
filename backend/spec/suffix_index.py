"""Suffix matching over token lists, and the frequency-scored draft it yields (suffix decoding's lookup).

Every position of an indexed token list is filed under the two tokens before it, so the occurrences of a context's
last two tokens are one dictionary look-up away. Extending each occurrence backwards against the context gives its
match length; the occurrences matching at least `m` tokens are exactly the nodes a suffix tree of the lists would
reach for the context's last `m` tokens, and what follows them is that node's subtree. A draft walks it greedily:
at each step the most frequent next token among the occurrences still on the path, with its empirical probability
(its count over the count of the path so far); the path's probability is the product, and the walk stops where it
falls below `min_token_prob`. The draft's score is the sum of the path probabilities (its expected accepted length).
Each match length (longest first) gives a draft of at most `spec_factor` x its length tokens; the best score wins,
the longer match on a tie.

Only the `MAX_CANDIDATES` most recent occurrences of the two tokens are weighed, which bounds a look-up's cost and
makes the frequencies those of recent text. `SequenceIndex` is one request's (its prompt and output, indexed as the
output grows); `backend/spec/suffix_cache.py` holds many finished outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import itemgetter

MAX_CANDIDATES = 16  # occurrences of the context's last two tokens weighed per look-up, the most recent first
MIN_MATCH = 2  # tokens every candidate matches (the index key)

# a candidate: (its token list, the position its continuation starts at, its document's id or None)
Candidate = tuple[list[int], int, object]


@dataclass
class Match:
    """A scored draft: its tokens, its expected accepted length, and the documents it continued."""

    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    sources: list = field(default_factory=list)


NO_MATCH = Match()


def best_draft(
    candidates: list[Candidate], context: list[int], k: int, max_depth: int, spec_factor: float, min_token_prob: float
) -> Match:
    """The best-scoring draft of at most `k` tokens continuing `context` from `candidates`, which all match its last
    MIN_MATCH tokens (most recent first); patterns are matched up to `max_depth` tokens."""
    if not candidates or k <= 0:
        return NO_MATCH
    n = len(context)
    by_length = []
    for toks, p, source in candidates:
        limit = min(max_depth, p, n)
        if toks[p - limit : p] == context[n - limit :]:
            length = limit
        else:
            length = MIN_MATCH
            while toks[p - length - 1] == context[n - length - 1]:
                length += 1
        by_length.append((length, toks, p, source))
    by_length.sort(key=itemgetter(0), reverse=True)  # stable: the most recent first among equal lengths
    # Three groups are weighed: the longest match; the most occurrences whose match still allows k tokens; every
    # occurrence (the most evidence, a short draft).
    full = min(max_depth, math.ceil(k / spec_factor)) if spec_factor > 0 else max_depth + 1
    ends = {_group_end(by_length, by_length[0][0]), _group_end(by_length, full), len(by_length)}
    best = NO_MATCH
    for end in sorted(ends):
        if end:
            length = by_length[end - 1][0]
            draft = walk(by_length[:end], min(k, int(length * spec_factor + 1e-6)), min_token_prob)
            if draft.score > best.score:
                best = draft
    return best


def _group_end(by_length: list, length: int) -> int:
    """How many of the (sorted, longest first) candidates match at least `length` tokens."""
    end = 0
    while end < len(by_length) and by_length[end][0] >= length:
        end += 1
    return end


def walk(group: list, max_tokens: int, min_token_prob: float) -> Match:
    """Follow the most frequent continuation of `group` ((length, tokens, position, source) rows) for up to
    `max_tokens` tokens while the path's probability stays at or above `min_token_prob`."""
    distinct: dict[tuple, list] = {}  # continuation -> [occurrences, sources], the first seen first
    for _, toks, p, source in group:
        cont = tuple(toks[p : p + max_tokens])
        entry = distinct.get(cont)
        if entry is None:
            distinct[cont] = [1, [source]]
        else:
            entry[0] += 1
            entry[1].append(source)
    live = list(distinct.items())
    tokens, prob, score = [], 1.0, 0.0
    for depth in range(max_tokens):
        if len(live) == 1:  # one continuation left: every further token has its path's probability
            cont, (_, sources) = live[0]
            rest = len(cont) - depth
            if rest > 0 and prob >= min_token_prob:
                tokens.extend(cont[depth:])
                score += prob * rest
            return Match(tokens, score, sources) if tokens else NO_MATCH
        counts: dict[int, int] = {}
        for cont, (n, _) in live:
            if depth < len(cont):
                counts[cont[depth]] = counts.get(cont[depth], 0) + n
        if not counts:
            break
        token, count = max(counts.items(), key=itemgetter(1))  # the first seen (longest, latest) on a tie
        prob *= count / sum(counts.values())
        if prob < min_token_prob:
            break
        tokens.append(token)
        score += prob
        live = [item for item in live if depth < len(item[0]) and item[0][depth] == token]
    return Match(tokens, score, [s for _, (_, sources) in live for s in sources]) if tokens else NO_MATCH


class SequenceIndex:
    """One growing token list's positions by the two tokens before them; `update` files the positions added since
    the last call (the list only grows), so the cost is paid once per token, when the request next drafts."""

    __slots__ = ("positions", "indexed")

    def __init__(self):
        self.positions: dict[tuple[int, int], list[int]] = {}
        self.indexed = MIN_MATCH  # positions below this are filed

    def update(self, tokens: list[int]) -> None:
        positions = self.positions
        # a position is filed once its token exists: the context's own end never matches itself
        for i in range(self.indexed, len(tokens)):
            key = (tokens[i - 2], tokens[i - 1])
            found = positions.get(key)
            if found is None:
                positions[key] = [i]
            else:
                found.append(i)
        self.indexed = max(self.indexed, len(tokens))

    def candidates(self, tokens: list[int]) -> list[Candidate]:
        """The latest occurrences of the last two of `tokens` (after `update(tokens)`), most recent first."""
        if len(tokens) < MIN_MATCH:
            return []
        found = self.positions.get((tokens[-2], tokens[-1]))
        return [(tokens, p, None) for p in reversed(found[-MAX_CANDIDATES:])] if found else []
