"""Adaptive draft length per sequence: speculate where drafts are accepted, stop where they are not.

A rejected draft is paid for (the target verifies k + 1 positions instead of one) and buys nothing, so on
open chat, where n-gram drafts are found but mostly rejected, fixed-k speculation is slower than none;
on input-grounded output (copying, rewriting, editing the prompt) drafts are accepted in runs and it pays.
Each sequence therefore keeps three numbers:

- `k`, its draft length: one more after a fully accepted draft (up to the cap), the accepted length plus one
  after a rejection (a draft rejected at its first token drops it to 1);
- `rate`, an exponentially weighted acceptance rate (accepted / drafted per verification);
- when `rate` falls below `min_acceptance` after a rejection, `k` becomes 0 (off) and the sequence decodes
  plainly; every `probe_interval` decode steps it drafts one token again (a probe). A probe that is accepted
  turns speculation back on (output that starts copying its input), a rejected one costs one extra position
  once per interval. A probe for which the proposer finds nothing (n-gram: no match, free) is retried at the
  next step, so the probe is spent only on a real draft.

A proposer that sizes its own drafts (suffix decoding stops where a continuation's probability does;
`Proposer.sizes_drafts`) is asked for the cap whenever its sequence is on: a short or rejected draft says how
much evidence the context had, not how long the next one should be. Switching off below `min_acceptance` and
the probes are the same.

The cap is the configured k, the request's own `num_speculative_tokens` and its remaining output; the batch
rule (`spec_max_batch_size`) is applied by the caller for the whole step.
"""

from __future__ import annotations

import weakref

SMOOTHING = 0.3  # weight of the latest verification in the acceptance rate (about the last 3 drafts count)
INITIAL_K = 2  # a new sequence's draft length: cheap if it is rejected, grows fast if it is accepted
INITIAL_RATE = 0.5  # a new sequence's acceptance rate: two fully rejected drafts turn it off at 0.3


class SeqSpecState:
    __slots__ = ("k", "rate", "idle")

    def __init__(self, k: int, rate: float):
        self.k = k  # draft length; 0: off, waiting for a probe
        self.rate = rate  # weighted acceptance rate
        self.idle = 0  # decode steps since speculation turned off


class AdaptivePolicy:
    def __init__(self, max_k: int, min_acceptance: float, probe_interval: int, full_length: bool = False):
        self.max_k = max_k
        self.full_length = full_length  # the proposer sizes its drafts: k is the cap while on
        self.min_acceptance = min_acceptance
        self.probe_interval = probe_interval
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> SeqSpecState

    def state(self, seq) -> SeqSpecState:
        st = self._states.get(seq)
        if st is None:
            k = self.max_k if self.full_length else min(INITIAL_K, self.max_k)
            st = self._states[seq] = SeqSpecState(k, INITIAL_RATE)
        return st

    def draft_length(self, seq, cap: int) -> int:
        """Draft tokens this decode asks for, at most `cap`; called once per decode step of the sequence. A probe
        that gets no draft is not observed, so `idle` stays past the interval and the next step probes again."""
        if cap <= 0:
            return 0
        st = self.state(seq)
        if st.k == 0:
            st.idle += 1
            return 1 if st.idle >= self.probe_interval else 0
        return min(st.k, cap)

    def observe(self, seq, drafted: int, accepted: int) -> None:
        """Record a step's outcome: `drafted` tokens proposed and verified, `accepted` of them kept."""
        if drafted == 0:
            return
        st = self.state(seq)
        st.rate += SMOOTHING * (accepted / drafted - st.rate)
        if accepted == drafted:  # a probe that is accepted turns it back on
            st.k = self.max_k if self.full_length else min(self.max_k, max(st.k, drafted) + 1)
            return
        if not self.full_length:
            st.k = min(st.k, accepted + 1)  # a rejected probe (k 0) stays off
        if st.k == 0 or st.rate < self.min_acceptance:
            st.k, st.idle = 0, 0
