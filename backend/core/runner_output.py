"""What a step produced, for `Scheduler.update_from_output`: plain records, by sequence id.

The engine fills it after the forward pass (prompt outputs, sampling, verifying drafts); nothing in it has changed a
sequence or a request yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SampledTokens:
    """The tokens one sequence gets this step, in order: one sampled token, or the accepted drafts and the
    token after them. `rows[i]`: the row of the step's logits token i was chosen from, the row of position
    `position + i` (`position`: the sequence's last token before this step's); `logprobs[i]`: its entry where the
    request tracks logprobs (filled by `OutputProcessor.add_logprobs`)."""

    seq_id: int
    token_ids: list[int]
    rows: list[int]
    position: int
    logprobs: list[dict] | None = None


@dataclass
class PromptOutput:
    """What a prefill chunk adds to its request's prompt outputs: the logprobs entries of prompt positions not yet
    recorded, and its rows of context logits [positions, V] (each None where not asked for or nothing is new)."""

    seq_id: int
    logprobs: list[dict] | None = None
    context_logits: torch.Tensor | None = None


@dataclass
class ModelRunnerOutput:
    logits: torch.Tensor | None = None  # the step's sampled rows [rows, V] (prompt rows taken out)
    sampled: list[SampledTokens] = field(default_factory=list)
    num_accepted: dict[int, int] = field(default_factory=dict)  # draft tokens accepted, by seq_id (verified only)
    prompt_outputs: list[PromptOutput] = field(default_factory=list)
