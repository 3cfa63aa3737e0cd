"""What a step produced: the tokens each sequence got from its logits rows, for `Scheduler.update_from_output`.

The engine fills it after the forward pass (sampling, verifying drafts); nothing in it has changed a sequence yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.core.request import Sequence


@dataclass
class SampledTokens:
    """The tokens one sequence gets this step, in order: one sampled token, or the accepted drafts and the
    token after them. `rows[i]`: the row of the step's logits token i was chosen from; `logprobs[i]`: its entry
    where the request tracks logprobs (filled by `OutputProcessor.add_logprobs`)."""

    seq: Sequence
    token_ids: list[int]
    rows: list[int]
    logprobs: list[dict] | None = None


@dataclass
class ModelRunnerOutput:
    logits: torch.Tensor | None = None  # the step's sampled rows [rows, V] (prompt rows taken out)
    sampled: list[SampledTokens] = field(default_factory=list)
    num_accepted: dict[int, int] = field(default_factory=dict)  # draft tokens accepted, by seq_id (verified only)
