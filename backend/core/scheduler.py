"""Iteration-level scheduling under a token budget and a sequence cap.

Every step: running sequences first (by priority, then decodes before unfinished prompt chunks), then waiting
ones while budget, sequence slots and blocks last. A prompt longer than the remaining budget is chunked across
steps, so prefills and decodes share a step. When blocks run out, the sequences of the lowest priority (the
largest value), the most recently admitted first, are preempted: their blocks are freed and they wait at the
front of their priority in the queue to be recomputed (from the prefix cache where it still holds their blocks).
The queue is ordered by priority, then arrival; a waiting sequence that slots or blocks cannot admit preempts
running ones of a lower priority (never of its own) to get in (docs/engine.md, "Priority").

The step is a list of plain records (`scheduler_output.py`), each sequence's tokens fixed when it is scheduled,
every sequence that draws a token listed (a request's parallel samples waiting to fork included). After the forward
pass, `update_from_output` is the one place where what the step produced (`runner_output.py`) lands on the
sequences and their requests: prompt logprobs and context logits, the draft model's computed count, computed counts,
new tokens, the drafts kept and the KV slots of rejected ones released, the full blocks registered in the prefix
cache, parallel samples forked, stop rules applied, finished sequences freed, the requests' statistics.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable

import torch

from backend.core.block_manager import BlockManager
from backend.core.request import FinishReason, Sequence, SequenceStatus
from backend.core.runner_output import ModelRunnerOutput
from backend.core.scheduler_output import SchedulerOutput

# The stop rules a new token is checked against (OutputProcessor.on_token): the reason it ends the sequence, or
# None. Called with the token already appended, its logits row and its logprobs entry (None when not tracked).
StopRule = Callable[[Sequence, int, torch.Tensor, int, "dict | None"], "FinishReason | None"]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_loras: int = 0):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras  # LoRA adapters among the running sequences (0: no limit)
        self.waiting: deque[Sequence] = deque()  # by priority; within one, preempted ones first, then by arrival
        self.running: list[Sequence] = []
        self.reserved_slots = 0  # sequence slots promised to parallel samples not yet forked
        self.num_preemptions = 0
        # a request's parallel samples wait here, by their first sequence, until its prompt is computed; the
        # slots they will take are reserved from its admission (`_reserved`: slots held, by first sequence)
        self._unforked: dict[int, list[Sequence]] = {}
        self._reserved: dict[int, int] = {}

    def add(self, seq: Sequence, parallel: list[Sequence] = ()) -> None:
        """Queue a request's first sequence; `parallel`: its other samples, forked from it once its prompt is in."""
        seq.status = SequenceStatus.WAITING
        self.waiting.insert(bisect_right(self.waiting, seq.priority, key=_priority), seq)  # last of its priority
        if parallel:
            self._unforked[seq.seq_id] = list(parallel)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_spec_tokens=lambda seq: 0) -> SchedulerOutput:
        """Pick this step's work. `num_spec_tokens(seq)` says how many draft tokens a decode may verify."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        for seq in sorted(self.running, key=lambda s: (s.priority, s.in_prefill)):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            # only a decode speculates: not a prompt (even its last token) nor a recomputation in progress
            decoding = seq.num_uncomputed_tokens == 1 and not seq.in_prefill
            spec = min(num_spec_tokens(seq), budget - 1) if decoding else 0
            num_new = min(seq.num_uncomputed_tokens + spec, budget)
            if not self._make_room(seq, num_new, scheduled_ids, out):
                continue  # it preempted itself
            out.add(seq, num_new, spec, self.unforked(seq))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
        if not out.preempted:
            self._admit_waiting(out, budget)
        out.block_copies = self.block_manager.take_pending_copies()
        return out

    def _make_room(self, seq: Sequence, num_new: int, scheduled_ids: set[int], out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate(seq, num_new):
            # the ones not scheduled yet come after `seq` in priority order: none is of a better priority
            victims = [s for s in self.running if s.seq_id not in scheduled_ids and s is not seq]
            victim = self._lowest(victims) if victims else seq
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    @staticmethod
    def _lowest(seqs: list[Sequence]) -> Sequence:
        """The one to preempt first: the lowest priority (largest value), the most recently admitted among equals
        (`seqs` in admission order, as `running` is)."""
        return max(reversed(seqs), key=_priority)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        adapters = {s.request.adapter.uid for s in self.running if s.request.adapter is not None}
        floor = None  # the best priority preempted to admit a sequence: from it on, nothing more is admitted
        for seq in [s for s in self.waiting if not s.request.compiling]:  # a grammar still compiling: it waits
            if budget <= 0 or (floor is not None and seq.priority >= floor):
                break
            request = seq.request
            adapter = request.adapter
            if (
                adapter is not None
                and adapter.uid not in adapters
                and self.max_loras
                and len(adapters) >= self.max_loras
            ):
                continue  # another adapter would pass max_loras: it waits, requests of the running ones go on
            extra = len(self._unforked.get(seq.seq_id, ())) if seq.seq_id not in self._reserved else 0
            while (room := self._room(seq, extra, budget)) is None:
                lower = [s for s in self.running if s.priority > seq.priority]
                if not lower:
                    return
                victim = self._lowest(lower)
                budget += out.remove(victim)
                self.preempt(victim)
                out.preempted.append(victim)
                floor = victim.priority if floor is None else min(floor, victim.priority)
            cached, num_new = room
            self.waiting.remove(seq)
            self.block_manager.admit(seq, cached)
            seq.num_computed_tokens = seq.num_cached_prompt_tokens
            if request.num_cached_tokens is None:  # its first admission: what usage reports as cached
                request.num_cached_tokens = seq.num_cached_prompt_tokens
                request.stats.first_scheduled_ns = time.time_ns()
            request.stats.blocks_reused = seq.num_cached_prompt_tokens // self.block_manager.block_size
            self.block_manager.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if extra:
                self.reserved_slots += extra
                self._reserved[seq.seq_id] = extra
            out.add(seq, num_new, parallel=self.unforked(seq))
            budget -= num_new
            if adapter is not None:
                adapters.add(adapter.uid)

    def _room(self, seq: Sequence, extra: int, budget: int) -> tuple[list[int], int] | None:
        """(its cached prefix blocks, the tokens it computes now) if the free slots and blocks admit `seq` with its
        `extra` parallel samples' slots, else None."""
        if len(self.running) + self.reserved_slots + 1 + extra > self.max_num_seqs:
            return None
        # prompt logprobs and context logits need every prompt position's logits: such a prompt is computed
        # whole, not read from the prefix cache (its blocks are still registered for later requests)
        cached = (
            []
            if seq.request.computing_prompt_outputs
            else self.block_manager.match_prefix(seq.token_ids, seq.cache_salt)
        )
        num_new = min(seq.num_tokens - len(cached) * self.block_manager.block_size, budget)
        return (cached, num_new) if self.block_manager.can_admit(seq, cached, num_new) else None

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and requeue it first among its priority; it will be recomputed."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(bisect_left(self.waiting, seq.priority, key=_priority), seq)

    def unforked(self, seq: Sequence) -> list[Sequence]:
        """The parallel samples waiting for `seq`'s prompt: they sample from its logits row when it first samples."""
        return self._unforked.get(seq.seq_id, [])

    def _take_unforked(self, seq: Sequence) -> list[Sequence]:
        """The parallel samples waiting for `seq`'s prompt (none once taken), their reserved slots released."""
        self.reserved_slots -= self._reserved.pop(seq.seq_id, 0)
        return self._unforked.pop(seq.seq_id, [])

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Its prompt is in: the parallel samples share its blocks and join the running batch."""
        children = self._take_unforked(parent)
        for child in children:
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.draft_num_computed = parent.draft_num_computed
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return children

    def release_reservation(self, request) -> None:
        """Forget the parallel samples a request will no longer fork (it was aborted)."""
        if request.sequences:
            self._take_unforked(request.sequences[0])

    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput, stop_rule: StopRule) -> None:
        """Apply what the step did. A chunk's prompt outputs join its request's; a verified sequence keeps the KV of
        its accepted drafts (the rest is released); a sequence that samples for the first time forks its parallel
        samples; each new token is appended and checked against `stop_rule`, and a sequence it stops is finished
        (its later tokens dropped)."""
        seqs = sched.sequences
        for record in output.prompt_outputs:
            request = seqs[record.seq_id].request
            if record.logprobs:
                request.prompt_logprobs += record.logprobs
            if record.context_logits is not None:
                request.context_logits.append(record.context_logits)
        for s in sched.scheduled:
            seq = seqs[s.seq_id]
            if s.draft.draft_num_computed is not None:
                seq.draft_num_computed = s.draft.draft_num_computed
            if s.num_spec_tokens:
                num_accepted = output.num_accepted[seq.seq_id]
                seq.num_computed_tokens = seq.num_tokens + num_accepted
                seq.draft_num_computed = min(seq.draft_num_computed, seq.num_computed_tokens)
                self.block_manager.trim(seq)
                seq.request.stats.draft_tokens += s.num_spec_tokens
                seq.request.stats.accepted_tokens += num_accepted
            else:
                seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.commit(seq)
            children = self._fork(seq) if s.samples else []
            if s.samples and seq.params.max_tokens == 0:  # a prompt scored for its logprobs: no token
                for member in [seq, *children]:
                    self.finish(member, FinishReason.LENGTH)
        for result in output.sampled:
            seq, reason = seqs[result.seq_id], None
            for i, token_id in enumerate(result.token_ids):
                seq.token_ids.append(token_id)
                entry = result.logprobs[i] if result.logprobs is not None else None
                reason = stop_rule(seq, token_id, output.logits, result.rows[i], entry)
                if reason is not None:
                    break
            if seq.seq_id in output.num_accepted:  # blocks filled by accepted drafts: their hashes need the tokens
                self.block_manager.commit(seq)
            if reason is not None:
                self.finish(seq, reason)
        for s in sched.scheduled:
            seq = seqs[s.seq_id]
            if seq.sample_index == 0:  # the request's statistics count its first sample's blocks
                seq.request.stats.blocks_total = max(seq.request.stats.blocks_total, len(seq.block_table))

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.draft_num_computed = 0


def _priority(seq: Sequence) -> int:
    return seq.priority
