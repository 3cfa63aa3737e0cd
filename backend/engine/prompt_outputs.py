"""What a prefill chunk yields besides the next token: the logits of prompt positions, for `prompt_logprobs`
(position p's logits score prompt token p + 1) and `context_logits` (every position's logits, the last prompt
position's being the row the first token is sampled from).

The model runner returns a chunk's prompt rows first, then the rows it samples from (vLLM's layout, counted once
in `ScheduledSeq`); `take_prompt_outputs` returns what the requests asked for as records (`PromptOutput`, applied by
`Scheduler.update_from_output`) and only the rows left for sampling.
"""

from __future__ import annotations

import torch

from backend.core.runner_output import PromptOutput
from backend.core.scheduler_output import SchedulerOutput
from backend.sampling.sampler import Sampler


def wanted(sched: SchedulerOutput) -> bool:
    """Whether any chunk of the step records a prompt output."""
    return any(
        s.num_prompt_rows or (s.is_prefill and sched.sequences[s.seq_id].request.computing_context_logits)
        for s in sched.scheduled
    )


def take_prompt_outputs(
    sampler: Sampler, sched: SchedulerOutput, logits: torch.Tensor
) -> tuple[torch.Tensor, list[PromptOutput]]:
    """The rows left for sampling and verification, and the prompt logprobs and context logits of the chunks that
    asked for them (each chunk's prompt rows come first in its logits). A chunk computed again after a preemption
    adds only the positions not yet recorded."""
    keep, records, row = [], [], 0
    for s in sched.scheduled:
        seq = sched.sequences[s.seq_id]
        request, num_prompt_rows = seq.request, s.num_prompt_rows
        record = PromptOutput(s.seq_id)
        if num_prompt_rows and request.computing_prompt_logprobs:
            scored = request.prompt_token_ids[s.start + 1 : s.start + 1 + num_prompt_rows]
            entries = sampler.logprobs_rows(logits[row : row + num_prompt_rows], scored, request.params.prompt_logprobs)
            record.logprobs = entries[len(request.prompt_logprobs) - 1 - s.start :]
        if s.is_prefill and request.computing_context_logits:
            ends_prompt = s.samples and s.start + s.num_new_tokens == seq.num_prompt_tokens
            chunk = logits[row : row + num_prompt_rows + int(ends_prompt)][request.num_context_logits - s.start :]
            if len(chunk):
                record.context_logits = chunk.float().clone()
        if record.logprobs or record.context_logits is not None:
            records.append(record)
        row += num_prompt_rows
        keep.extend(range(row, row + s.num_sampled_rows))
        row += s.num_sampled_rows
    return logits[keep], records
