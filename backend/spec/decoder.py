"""Speculative decoding inside the running batch: how many drafts each decode may verify, asking the proposer
for them, and turning the target's logits over the k + 1 verified positions into accepted tokens.

The target verifies a sequence's k draft tokens in the same ragged forward pass that carries everyone
else's prefill chunks and decodes; the rejection sampler (`rejection_sampler.py`) keeps the output
distributed exactly as the target's, and the KV of rejected positions is rolled back. With `spec_adaptive`,
each sequence's draft length follows its own recent acceptance (`spec/policy.py`).
"""

from __future__ import annotations

import torch

from backend.core.block_manager import BlockManager
from backend.core.config import EngineConfig
from backend.core.metrics import EngineMetrics
from backend.core.output_processor import OutputProcessor
from backend.core.request import Sequence
from backend.core.scheduler import ScheduledSeq, SchedulerOutput
from backend.sampling.sampler import Sampler, argmax_rows
from backend.spec.policy import AdaptivePolicy
from backend.spec.proposers import Proposer
from backend.spec.rejection_sampler import verify_greedy, verify_sampled


class SpeculativeDecoder:
    def __init__(
        self,
        config: EngineConfig,
        proposer: Proposer,
        sampler: Sampler,
        block_manager: BlockManager,
        outputs: OutputProcessor,
        metrics: EngineMetrics,
        max_model_len: int,
    ):
        self.config = config
        self.proposer = proposer
        self.sampler = sampler
        self.block_manager = block_manager
        self.outputs = outputs
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.policy = None
        if config.spec_adaptive:
            self.policy = AdaptivePolicy(
                config.num_speculative_tokens, config.spec_min_acceptance, config.spec_probe_interval
            )

    def active(self, num_running: int) -> bool:
        """Speculation is off for a busy batch: there the verification compute costs more than it saves."""
        return num_running <= self.config.spec_max_batch_size

    def num_draft_tokens(self, seq: Sequence) -> int:
        """Draft tokens this decode may verify: the request's k (never above the configured k), no more than
        its remaining output allows, and with the adaptive policy no more than its recent acceptance earns."""
        params = seq.params
        k = self.config.num_speculative_tokens
        if params.num_speculative_tokens is not None:
            k = min(k, params.num_speculative_tokens)
        remaining = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        cap = max(0, min(k, remaining))
        return self.policy.draft_length(seq, cap) if self.policy is not None else cap

    def propose(self, sched: SchedulerOutput, copies: list[tuple[int, int]]) -> None:
        """Ask the proposer for drafts; a sequence that gets fewer than asked verifies fewer."""
        self.proposer.copy_blocks(copies)
        speculating = [s for s in sched.scheduled if s.num_spec_tokens]
        for s in sched.scheduled:
            s.seq.spec_token_ids = []
        self.proposer.propose([(s.seq, s.num_spec_tokens) for s in speculating])
        for s in speculating:
            unused = s.num_spec_tokens - len(s.seq.spec_token_ids)
            s.num_new_tokens -= unused
            s.num_spec_tokens -= unused

    def verify(self, verifying: list[tuple[ScheduledSeq, torch.Tensor]]) -> None:
        """For each (speculating sequence, its logits [k + 1, V]): accept a prefix of the draft, roll the KV back
        past it, and append the emitted tokens. The k + 1 rows of every sequence are processed as one batch."""
        rows = [
            s.seq.sampling_row(s.seq.spec_token_ids[:i])
            for s, _ in verifying
            for i in range(len(s.seq.spec_token_ids) + 1)
        ]
        processed = self.sampler.process_logits(torch.cat([logits for _, logits in verifying]), rows)
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        probs = self.sampler.probs(processed[sampled], [rows[i] for i in sampled]) if sampled else None
        first = 0
        for s, logits in verifying:
            count = len(s.seq.spec_token_ids) + 1
            target = processed[first : first + count]
            if not s.seq.params.greedy:
                start = sampled.index(first)
                target = probs[start : start + count]
            self._accept(s, logits, target)
            first += count

    def _accept(self, s: ScheduledSeq, logits: torch.Tensor, target: torch.Tensor) -> None:
        """`target`: the processed logits (greedy) or the distributions (sampled) of the k + 1 positions."""
        seq = s.seq
        drafts = seq.spec_token_ids
        num_tokens = seq.num_tokens
        if seq.params.greedy:
            result = verify_greedy(argmax_rows(target), drafts)
        else:
            result = verify_sampled(target, drafts, seq.spec_draft_probs, seq.generator)
        s.num_accepted = result.num_accepted
        if self.policy is not None:
            self.policy.observe(seq, len(drafts), result.num_accepted)
        seq.num_computed_tokens = num_tokens + result.num_accepted  # KV of rejected positions is dropped
        seq.draft_num_computed = min(seq.draft_num_computed, seq.num_computed_tokens)
        seq.spec_token_ids = []
        self.block_manager.trim(seq)
        self.block_manager.commit(seq)
        seq.request.stats.draft_tokens += len(drafts)
        seq.request.stats.accepted_tokens += result.num_accepted
        self.metrics.inc("llm_spec_decode_num_drafts_total")
        self.metrics.inc("llm_spec_decode_num_draft_tokens_total", len(drafts))
        self.metrics.inc("llm_spec_decode_num_accepted_tokens_total", result.num_accepted)
        for position in range(result.num_accepted):
            self.metrics.inc("llm_spec_decode_num_accepted_tokens_per_pos_total", labels={"position": position})
        for i, token_id in enumerate(result.tokens):
            if self.outputs.append(seq, token_id, logits[i]):
                break
