"""What a prefill chunk yields besides the next token: the logits of prompt positions, for `prompt_logprobs`
(position p's logits score prompt token p + 1) and `context_logits` (every position's logits, the last prompt
position's being the row the first token is sampled from).

The model runner returns a chunk's prompt rows first, then the rows it samples from (vLLM's layout, counted once
in `ScheduledSeq`); `take_prompt_outputs` records what the requests asked for and hands back only the rows left
for sampling.
"""

from __future__ import annotations

import torch

from backend.core.scheduler_output import ScheduledSeq
from backend.sampling.sampler import Sampler


def wanted(scheduled: list[ScheduledSeq]) -> bool:
    """Whether any chunk of the step records a prompt output."""
    return any(s.num_prompt_rows or (s.is_prefill and s.seq.request.computing_context_logits) for s in scheduled)


def take_prompt_outputs(sampler: Sampler, scheduled: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
    """Record the prompt logprobs and context logits of the chunks that asked for them (each chunk's prompt rows
    come first in its logits); returns the rows left for sampling and verification. A chunk computed again after
    a preemption adds only the positions not yet recorded."""
    keep, row = [], 0
    for s in scheduled:
        request, num_prompt_rows = s.seq.request, s.num_prompt_rows
        if num_prompt_rows and request.computing_prompt_logprobs:
            scored = request.prompt_token_ids[s.start + 1 : s.start + 1 + num_prompt_rows]
            entries = sampler.logprobs_rows(logits[row : row + num_prompt_rows], scored, request.params.prompt_logprobs)
            request.prompt_logprobs += entries[len(request.prompt_logprobs) - 1 - s.start :]
        if s.is_prefill and request.computing_context_logits:
            ends_prompt = s.samples and s.start + s.num_new_tokens == s.seq.num_prompt_tokens
            chunk = logits[row : row + num_prompt_rows + int(ends_prompt)][request.num_context_logits - s.start :]
            if len(chunk):
                request.context_logits.append(chunk.float().clone())
        row += num_prompt_rows
        keep.extend(range(row, row + s.num_sampled_rows))
        row += s.num_sampled_rows
    return logits[keep]
