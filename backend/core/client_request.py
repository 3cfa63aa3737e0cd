"""What a client asked, as one immutable record: built on the transport's thread, read by the engine thread.

The engine keeps its own state of a request apart (`request.Request`: its sequences, what it has sent, its
statistics), and the output sender keeps the transport's handles (`output_sender.Transport`), so nothing here is
written once the record crosses to the engine thread (vLLM's `EngineCoreRequest`).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from backend.protocol.sampling_params import SamplingParams

_request_keys = itertools.count(1)


@dataclass(frozen=True, eq=False)
class ClientRequest:
    """A prompt and its parameters, validated and tokenized (`LLMEngine.build_request`). Its lists are not changed
    after it is built."""

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    base_seed: int = 0  # seeds the samples' generators when params.seed is None
    grammar: Future | None = None  # its output constraint, compiling off the engine thread (structured_output.py)
    tracks_cumulative_logprob: bool = False  # sum each sample's logprobs even without params.logprobs
    lora_name: str | None = None  # the LoRA adapter it asks for (None: the base model)
    arrival_time: float = field(default_factory=time.perf_counter)
    arrival_ns: int = field(default_factory=time.time_ns)  # wall clock, for the request's statistics
    key: int = field(default_factory=lambda: next(_request_keys))  # unique in this process, unlike request_id

    def seed_for(self, sample_index: int) -> int:
        """Each sample draws from its own generator; a seeded request reproduces whatever the batch."""
        seed = self.params.seed if self.params.seed is not None else self.base_seed
        return (seed + sample_index * 0x9E3779B97F4A7C15) % (1 << 63)
