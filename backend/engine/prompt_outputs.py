"""What a prefill chunk yields besides the next token: the logits of prompt positions, for `prompt_logprobs`
(position p's logits score prompt token p + 1) and `context_logits` (every position's logits, the last prompt
position's being the row the first token is sampled from).

The model runner returns a chunk's prompt rows first, then the rows it samples from (vLLM's layout);
`take_prompt_outputs` records what the requests asked for and hands back only the rows left for sampling.
"""

from __future__ import annotations

import torch

from backend.core.scheduler import ScheduledSeq
from backend.sampling.sampler import Sampler


def prompt_rows(s: ScheduledSeq) -> int:
    """How many prompt rows a chunk needs: from its first position up to the one before the last prompt token
    (that one's logits pick the first output), for a request computing its prompt outputs."""
    if not s.seq.request.computing_prompt_outputs or not s.is_prefill:
        return 0
    return max(0, min(s.start + s.num_new_tokens, s.seq.num_prompt_tokens - 1) - s.start)


def wanted(scheduled: list[ScheduledSeq], rows: list[int]) -> bool:
    """Whether any chunk of the step records a prompt output."""
    return any(rows) or any(s.is_prefill and s.seq.request.computing_context_logits for s in scheduled)


def take_prompt_outputs(
    sampler: Sampler, scheduled: list[ScheduledSeq], rows: list[int], logits: torch.Tensor
) -> torch.Tensor:
    """Record the prompt logprobs and context logits of the chunks that asked for them (`rows[i]` prompt rows
    first in chunk i's logits); returns the rows left for sampling and verification. A chunk computed again
    after a preemption adds only the positions not yet recorded."""
    keep, row = [], 0
    for s, num_prompt_rows in zip(scheduled, rows):
        request = s.seq.request
        if num_prompt_rows and request.computing_prompt_logprobs:
            scored = request.prompt_token_ids[s.start + 1 : s.start + 1 + num_prompt_rows]
            entries = sampler.logprobs_rows(logits[row : row + num_prompt_rows], scored, request.params.prompt_logprobs)
            request.prompt_logprobs += entries[len(request.prompt_logprobs) - 1 - s.start :]
        num_sampled = s.num_spec_tokens + 1 if s.samples else 0
        if s.is_prefill and request.computing_context_logits:
            ends_prompt = s.samples and s.start + s.num_new_tokens == s.seq.num_prompt_tokens
            chunk = logits[row : row + num_prompt_rows + int(ends_prompt)][request.num_context_logits - s.start :]
            if len(chunk):
                request.context_logits.append(chunk.float().clone())
        row += num_prompt_rows
        keep.extend(range(row, row + num_sampled))
        row += num_sampled
    return logits[keep]
