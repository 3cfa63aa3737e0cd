"""Admission of a generation's prompts as one: all of them are queued, or none is.

A completions request may carry many prompts, each one Triton request. Sent one by one into a queue that
fills part way, such a request would be half admitted and, while it waits, would starve every other client.
So before anything is sent, the front door checks the generation against the model's `max_queue_size`
(read once from the model's configuration): more prompts than the queue can ever hold is a 400; more than
it holds now (the front door's own requests that have not produced a token yet) is a 503 with `Retry-After`.
If the model still refuses one prompt (clients that bypass the front door share its queue), the other
prompts are cancelled at once (completions.py), so the answer is a 503 and nothing stays queued.
"""

from __future__ import annotations

from collections import Counter

from tritonclient.utils import InferenceServerException

from .errors import bad_request, server_busy
from .triton_stream import TritonLLM


class Admission:
    def __init__(self, llm: TritonLLM):
        self.llm = llm
        self.pending: Counter[str] = Counter()  # model -> prompts sent that have not produced a token yet

    async def capacity(self, model: str) -> int:
        """The model's max_queue_size (0: unbounded, or Triton cannot say: the model's own check applies)."""
        try:
            return int((await self.llm.model_parameters(model)).get("max_queue_size") or 0)
        except (InferenceServerException, ValueError):
            return 0

    async def admit(self, model: str, num_prompts: int) -> Ticket:
        """A ticket for `num_prompts` prompts, or the 400/503 that refuses them all."""
        capacity = await self.capacity(model)
        if capacity and num_prompts > capacity:
            raise bad_request(
                f"this request has {num_prompts} prompts; model '{model}' queues at most {capacity} "
                "requests (max_queue_size): send fewer prompts per request",
                "prompt",
                "too_many_prompts",
            )
        if capacity and self.pending[model] + num_prompts > capacity:
            raise server_busy(
                f"server busy: {self.pending[model]} prompts are already waiting for model "
                f"'{model}' (max_queue_size={capacity}) and this request has {num_prompts}; "
                "retry later"
            )
        self.pending[model] += num_prompts
        return Ticket(self, model, num_prompts)


class Ticket:
    """The queue places a generation holds; each prompt gives its place back at its first token or its end."""

    def __init__(self, admission: Admission, model: str, num_prompts: int):
        self.admission = admission
        self.model = model
        self.waiting = set(range(num_prompts))

    def started(self, prompt_index: int) -> None:
        if prompt_index in self.waiting:
            self.waiting.discard(prompt_index)
            self.admission.pending[self.model] -= 1

    def release(self) -> None:
        for prompt_index in list(self.waiting):
            self.started(prompt_index)
