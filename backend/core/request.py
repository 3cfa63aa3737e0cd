"""The engine's state of a request, its sequences (one per parallel sample) and what the engine emits for them."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from backend.core.client_request import ClientRequest
from backend.core.detokenizer import IncrementalDetokenizer
from backend.model.lora import LoraAdapter
from backend.protocol.sampling_params import SamplingParams
from backend.sampling.sampler import SamplingRow


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """One generated continuation of a prompt: its tokens, its KV blocks, its sampler state."""

    def __init__(self, request: Request, sample_index: int, detokenizer: IncrementalDetokenizer):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.sample_index = sample_index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the committed full blocks
        self.num_cached_prompt_tokens = 0  # prompt tokens served by the prefix cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.detokenizer = detokenizer
        self.generator = torch.Generator().manual_seed(request.seed_for(sample_index))
        self.draft_num_computed = 0  # tokens whose KV the draft model holds
        self.matcher = None  # its own grammar state when the request constrains its output (structured_output.py)
        self.num_preemptions = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def priority(self) -> int:
        """Its request's priority: the scheduler serves lower values first."""
        return self.request.params.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cache_salt(self) -> bytes | None:
        """What keys its prefix-cache blocks apart beyond its tokens: its LoRA adapter, if any."""
        adapter = self.request.adapter
        return None if adapter is None else adapter.cache_salt

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def sampling_row(self, drafts: list[int] | None = None) -> SamplingRow:
        """What the sampler needs to choose this sequence's next token (after `drafts`, when verifying them)."""
        context = self.token_ids + drafts if drafts else self.token_ids
        return SamplingRow(self.params, context, self.num_prompt_tokens, self.generator)


@dataclass
class SampleOutput:
    """What one sample produced since its last output (streaming) or in all (non-streaming)."""

    sample_index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    num_output_tokens: int  # all of the sample's tokens so far (not just these)
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None  # so far; None unless tracked
    generation_logits: list[torch.Tensor] | None = None  # each token's logits row [V], when asked for

    def followed_by(self, later: SampleOutput) -> SampleOutput:
        """This delta and the next one of the same sample as one."""
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        logits = None if self.generation_logits is None else self.generation_logits + (later.generation_logits or [])
        return SampleOutput(
            self.sample_index,
            self.text + later.text,
            self.token_ids + later.token_ids,
            later.finish_reason or self.finish_reason,
            later.num_output_tokens,
            logprobs,
            later.cumulative_logprob,
            logits,
        )


@dataclass
class RequestOutput:
    """What the engine says of one request after a step: plain values, no live engine object (it crosses to the
    sender's thread while the engine goes on)."""

    request_id: str
    samples: list[SampleOutput]
    num_input_tokens: int
    finished: bool
    error: str | None = None
    key: int = 0  # which request it answers (`Request.key`: request ids need not be unique)
    prompt_logprobs: list[dict | None] | None = None  # once, in the first output after the prompt is computed
    context_logits: list[torch.Tensor] | None = None  # the same: chunks of [positions, V] covering the prompt
    stats: RequestStats | None = None  # the request's statistics when this output was made (a copy)
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache served (`Request.num_cached_tokens`)

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and the next one of the same request as one response (a stream's deltas concatenate)."""
        samples = {s.sample_index: s for s in self.samples}
        for sample in later.samples:
            earlier = samples.get(sample.sample_index)
            samples[sample.sample_index] = sample if earlier is None else earlier.followed_by(sample)
        return RequestOutput(
            self.request_id,
            list(samples.values()),
            later.num_input_tokens,
            later.finished,
            later.error or self.error,
            later.key,
            self.prompt_logprobs or later.prompt_logprobs,
            self.context_logits or later.context_logits,
            later.stats,
            later.num_cached_tokens,
        )


@dataclass
class RequestStats:
    """What one request cost and when (TensorRT-LLM's perf outputs): wall-clock times in ns since the epoch,
    its first sample's KV blocks, its speculation. Written by the engine thread as the request runs."""

    arrival_ns: int = field(default_factory=time.time_ns)
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    blocks_reused: int = 0  # KV blocks of the prompt found in the prefix cache
    blocks_total: int = 0  # the most KV blocks the first sample held (reused ones included)
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def token(self) -> None:
        self.last_token_ns = time.time_ns()
        self.first_token_ns = self.first_token_ns or self.last_token_ns

    def as_dict(self) -> dict[str, float]:
        """TensorRT-LLM's names: kv_cache_alloc_new_blocks is the blocks allocated, not reused."""
        return {
            "kv_cache_alloc_new_blocks": self.blocks_total - self.blocks_reused,
            "kv_cache_reused_blocks": self.blocks_reused,
            "kv_cache_alloc_total_blocks": self.blocks_total,
            "arrival_time_ns": self.arrival_ns,
            "first_scheduled_time_ns": self.first_scheduled_ns,
            "first_token_time_ns": self.first_token_ns,
            "last_token_time_ns": self.last_token_ns,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "total_accepted_draft_tokens": self.accepted_tokens,
            "total_draft_tokens": self.draft_tokens,
        }


def _asked(name: str) -> property:
    """A field of what the client asked (`Request.client`), read through."""
    return property(lambda self: getattr(self.client, name), doc=f"`ClientRequest.{name}`")


class Request:
    """The engine's own state of one request, kept on the engine thread from admission (`LLMEngine.add_request`)
    until its final output: its sequences, its prompt outputs, its statistics. What the client asked is `client`,
    read-only; where the outputs go is the output sender's (`output_sender.Transport`), not the engine's."""

    request_id = _asked("request_id")
    prompt = _asked("prompt")
    prompt_token_ids = _asked("prompt_token_ids")
    params = _asked("params")
    stream = _asked("stream")
    grammar = _asked("grammar")
    tracks_cumulative_logprob = _asked("tracks_cumulative_logprob")
    lora_name = _asked("lora_name")
    arrival_time = _asked("arrival_time")
    key = _asked("key")

    def __init__(self, client: ClientRequest):
        self.client = client
        self.sequences: list[Sequence] = []
        self.error: str | None = None
        # params.prompt_logprobs: an entry per prompt token, None for the first (nothing predicts it); filled as
        # prefill chunks are computed (such a request bypasses the prefix cache: cached blocks have no logits)
        self.prompt_logprobs: list[dict | None] | None = None if client.params.prompt_logprobs is None else [None]
        # params.context_logits: the logits of every prompt position, in chunks of rows [positions, V], filled the
        # same way (the last position's row is the one the first token is sampled from)
        self.context_logits: list[torch.Tensor] | None = [] if client.params.context_logits else None
        self.prompt_outputs_sent = False  # prompt_logprobs and context_logits went out
        self.stats = RequestStats(arrival_ns=client.arrival_ns)
        # prompt tokens whose KV came from the prefix cache (its full cached blocks x block size) at the request's
        # first admission; None until then. A preempted sequence readmitted later does not change it.
        self.num_cached_tokens: int | None = None
        self.adapter: LoraAdapter | None = None  # its LoRA adapter, held from admission until the request finishes

    def seed_for(self, sample_index: int) -> int:
        return self.client.seed_for(sample_index)

    @property
    def computing_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_context_logits(self) -> int:
        return sum(len(chunk) for chunk in self.context_logits or ())

    @property
    def computing_context_logits(self) -> bool:
        return self.context_logits is not None and self.num_context_logits < len(self.prompt_token_ids)

    @property
    def computing_prompt_outputs(self) -> bool:
        """Its prompt's positions need their logits (prompt_logprobs, context_logits): computed in full, never
        served from the prefix cache (cached blocks have no logits)."""
        return self.computing_prompt_logprobs or self.computing_context_logits

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)

    @property
    def compiling(self) -> bool:
        """Its grammar is not compiled yet (its sequences have no matchers): it waits in the queue."""
        return self.grammar is not None and self.sequences[0].matcher is None
