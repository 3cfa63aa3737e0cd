"""Speculative decoding inside the running batch: how many drafts each decode may verify, asking the proposer
for them, and turning the target's logits over the k + 1 verified positions into accepted tokens.

The target verifies a sequence's k draft tokens in the same ragged forward pass that carries everyone
else's prefill chunks and decodes; the rejection sampler (`rejection_sampler.py`) keeps the output
distributed exactly as the target's, and the KV of rejected positions is rolled back (by
`Scheduler.update_from_output`, from the accepted counts). With `spec_adaptive`,
each sequence's draft length follows its own recent acceptance (`spec/policy.py`).
"""

from __future__ import annotations

import torch

from backend.core.config import EngineConfig
from backend.core.metrics import EngineMetrics
from backend.core.request import Sequence
from backend.core.runner_output import ModelRunnerOutput, SampledTokens
from backend.core.scheduler_output import ScheduledSeq, SchedulerOutput
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
        metrics: EngineMetrics,
        max_model_len: int,
    ):
        self.config = config
        self.proposer = proposer
        self.sampler = sampler
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.policy = None
        if config.spec_adaptive:
            self.policy = AdaptivePolicy(
                config.num_speculative_tokens,
                config.spec_min_acceptance,
                config.spec_probe_interval,
                proposer is not None and proposer.sizes_drafts,
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

    def propose(self, sched: SchedulerOutput) -> SchedulerOutput:
        """The step with the proposer's drafts; a sequence that gets fewer than asked verifies fewer."""
        self.proposer.copy_blocks(sched.block_copies)
        speculating = [s for s in sched.scheduled if s.num_spec_tokens]
        drafts = self.proposer.propose([(sched.sequences[s.seq_id], s.num_spec_tokens) for s in speculating])
        return sched.with_drafts({s.seq_id: draft for s, draft in zip(speculating, drafts)})

    def finish(self, seqs: list[Sequence]) -> None:
        """A request is done: the proposer learns from its sequences' output and forgets their state."""
        self.proposer.finish(seqs)

    def observe(self, output: ModelRunnerOutput) -> None:
        """The step's sampled and verified tokens, for the proposer (every step, speculating or not)."""
        self.proposer.observe(output)

    def verify(
        self,
        sched: SchedulerOutput,
        verifying: list[tuple[ScheduledSeq, int]],
        logits: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """For each (speculating sequence of `sched`, its first row of `logits`; k + 1 rows each): the accepted
        prefix of its draft and the token after it, added to `output`. The rows of every sequence are processed as
        one batch: one argmax over the greedy ones, one rejection-sampling pass over the sampled ones."""
        seqs = [sched.sequences[s.seq_id] for s, _ in verifying]
        rows = [
            seq.sampling_row(s.draft.token_ids[:i])
            for seq, (s, _) in zip(seqs, verifying)
            for i in range(s.num_spec_tokens + 1)
        ]
        processed = self.sampler.process_logits(
            torch.cat([logits[r : r + s.num_sampled_rows] for s, r in verifying]), rows
        )
        greedy = [seq.params.greedy for seq in seqs]
        results = dict.fromkeys(range(len(verifying)))
        if any(greedy):
            argmax, first = argmax_rows(processed), 0
            for i, (s, _) in enumerate(verifying):
                if greedy[i]:
                    results[i] = verify_greedy(argmax[first : first + s.num_sampled_rows], s.draft.token_ids)
                first += s.num_sampled_rows
        if not all(greedy):
            sampled_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
            probs = self.sampler.probs(processed[sampled_rows], [rows[i] for i in sampled_rows])
            sampled = [i for i in range(len(verifying)) if not greedy[i]]
            drafts = [verifying[i][0].draft for i in sampled]
            generators = [seqs[i].generator for i in sampled]
            verified = verify_sampled(probs, [d.token_ids for d in drafts], [d.probs for d in drafts], generators)
            results.update(zip(sampled, verified))
        for i, ((s, row), seq) in enumerate(zip(verifying, seqs)):
            result = results[i]
            token_rows = list(range(row, row + len(result.tokens)))
            output.sampled.append(SampledTokens(s.seq_id, result.tokens, token_rows, seq.num_tokens - 1))
            output.num_accepted[s.seq_id] = result.num_accepted
            self._observe(seq, len(s.draft.token_ids), result.num_accepted)

    def _observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """The adaptive policy and the metrics learn how a verification went (the request's statistics are the
        scheduler's to count, from the step's accepted counts)."""
        if self.policy is not None:
            self.policy.observe(seq, num_drafted, num_accepted)
        self.metrics.inc("llm_spec_decode_num_drafts_total")
        self.metrics.inc("llm_spec_decode_num_draft_tokens_total", num_drafted)
        self.metrics.inc("llm_spec_decode_num_accepted_tokens_total", num_accepted)
        for position in range(num_accepted):
            self.metrics.inc("llm_spec_decode_num_accepted_tokens_per_pos_total", labels={"position": position})
