"""The global store of suffix decoding: recent finished outputs of every request, indexed for suffix matching
(`suffix_index.py`), bounded in tokens and evicted least recently used.

Each output is stored after a lead-in, the last prompt tokens before it (at most the pattern length), so that a
new request's first output tokens can match how earlier outputs began after the same prompt ending (a chat
template's assistant header, a tool-call instruction); only positions inside the output are continuations. A
stored output is used when a draft follows it, which makes it the most recently used; adding one past the cap
evicts the least recently used until the store fits, each eviction removing that output's positions from the
index, so the index never holds more than the stored tokens.
"""

from __future__ import annotations

from collections import OrderedDict

from backend.spec.suffix_index import MAX_CANDIDATES, MIN_MATCH, Candidate


class SuffixCache:
    def __init__(self, max_tokens: int, lead_in: int):
        self.max_tokens = max_tokens  # the cap: lead-ins and outputs, in tokens
        self.lead_in = lead_in
        self.num_tokens = 0
        self._docs: OrderedDict[int, tuple[list[int], int]] = OrderedDict()  # id -> (tokens, first continuation)
        # (two tokens) -> {document id: positions after them}; documents in the order they were added
        self._positions: dict[tuple[int, int], dict[int, list[int]]] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, tokens: list[int], num_prompt_tokens: int) -> None:
        """Store the output `tokens[num_prompt_tokens:]` after its lead-in; evict to stay within the cap."""
        start = max(0, num_prompt_tokens - self.lead_in)
        doc = tokens[max(start, len(tokens) - self.max_tokens) :]
        first = max(MIN_MATCH, num_prompt_tokens - start - (len(tokens) - start - len(doc)))
        if len(doc) <= first:  # no output to learn from
            return
        doc_id, self._next_id = self._next_id, self._next_id + 1
        self._docs[doc_id] = (doc, first)
        self.num_tokens += len(doc)
        positions = self._positions
        for i in range(first, len(doc)):
            key = (doc[i - 2], doc[i - 1])
            by_doc = positions.get(key)
            if by_doc is None:
                positions[key] = {doc_id: [i]}
            elif doc_id in by_doc:
                by_doc[doc_id].append(i)
            else:
                by_doc[doc_id] = [i]
        while self.num_tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        doc_id, (doc, first) = self._docs.popitem(last=False)
        self.num_tokens -= len(doc)
        positions = self._positions
        for i in range(first, len(doc)):
            key = (doc[i - 2], doc[i - 1])
            by_doc = positions.get(key)
            if by_doc is not None and by_doc.pop(doc_id, None) is not None and not by_doc:
                del positions[key]

    def candidates(self, tokens: list[int]) -> list[Candidate]:
        """The latest stored occurrences of the last two of `tokens`, the most recently added outputs first."""
        if len(tokens) < MIN_MATCH:
            return []
        by_doc = self._positions.get((tokens[-2], tokens[-1]))
        if not by_doc:
            return []
        found: list[Candidate] = []
        for doc_id in reversed(by_doc):
            doc = self._docs[doc_id][0]
            for p in reversed(by_doc[doc_id]):
                found.append((doc, p, doc_id))
                if len(found) == MAX_CANDIDATES:
                    return found
        return found

    def touch(self, doc_ids) -> None:
        """The outputs a draft followed become the most recently used."""
        for doc_id in set(doc_ids):
            if doc_id in self._docs:
                self._docs.move_to_end(doc_id)

    def num_index_entries(self) -> int:
        """Positions filed in the index (every stored output's continuations)."""
        return sum(len(p) for by_doc in self._positions.values() for p in by_doc.values())
