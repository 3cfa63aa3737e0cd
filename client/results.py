"""What the model answers, as the client sees it: one response (`Chunk`), a finished request (`Completion`,
with GenAI-Perf style latencies) and the errors (`ServerError`, with the error kind the model sends)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend.protocol import wire
from backend.protocol.triton_response import decode_response


class ServerError(Exception):
    """The server (or transport) reported an error for the request; str(e) is the server's message, `kind` the
    error kind it carries (backend/protocol/wire.py's ERROR_KINDS; None for transport and Triton's own errors)."""

    def __init__(self, text: str, kind: str | None = None):
        super().__init__(text)
        self.kind = kind or wire.parse_error(text)[0]


@dataclass
class Chunk:
    """One response of the model (one streaming step, or the whole answer when not streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    sample_index: int = 0
    is_final: bool = False
    received_at: float = 0.0  # time.perf_counter() when the response arrived
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None  # tokens in this response (the model sends the delta)
    cumulative_logprob: float | None = None  # of the sample's tokens so far, when asked for
    raw: dict[str, Any] = field(default_factory=dict)  # every output, as python values

    @property
    def num_tokens(self) -> int:
        """Tokens carried by this response: output_ids if sent, else num_output_tokens, else 1 if any text."""
        if self.token_ids:
            return len(self.token_ids)
        if self.num_output_tokens is not None:
            return self.num_output_tokens
        return 1 if self.text else 0


@dataclass
class Completion:
    """A finished request, with GenAI-Perf style latencies (seconds).

    With several samples (n > 1), `samples` maps sample_index -> Completion of that sample; the top-level
    text / token_ids / finish_reason are those of the lowest sample index, num_output_tokens is the total over
    samples, ttft_s the first token of any sample and itl_s every sample's gaps. With one sample, `samples` is
    empty.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    chunks: list[Chunk]
    num_input_tokens: int | None
    num_output_tokens: int
    ttft_s: float | None
    itl_s: list[float]
    e2e_s: float
    samples: dict[int, Completion] = field(default_factory=dict)

    @property
    def mean_itl_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens over end-to-end latency."""
        return self.num_output_tokens / self.e2e_s if self.e2e_s > 0 else None

    @classmethod
    def from_chunks(cls, chunks: list[Chunk], started_at: float, ended_at: float | None = None) -> Completion:
        """Collect responses (any order of samples) into a Completion; `started_at` is the perf_counter at send."""
        if ended_at is None:
            ended_at = max((c.received_at for c in chunks), default=started_at)
        indices = sorted({c.sample_index for c in chunks if not _is_empty(c)}) or [0]
        if len(indices) == 1:
            return cls._one_sample(chunks, started_at, ended_at)
        samples = {
            i: cls._one_sample([c for c in chunks if c.sample_index == i], started_at, ended_at) for i in indices
        }
        first = samples[indices[0]]
        ttfts = [s.ttft_s for s in samples.values() if s.ttft_s is not None]
        return cls(
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            chunks=chunks,
            num_input_tokens=first.num_input_tokens,
            num_output_tokens=sum(s.num_output_tokens for s in samples.values()),
            ttft_s=min(ttfts) if ttfts else None,
            itl_s=[x for s in samples.values() for x in s.itl_s],
            e2e_s=ended_at - started_at,
            samples=samples,
        )

    @classmethod
    def _one_sample(cls, chunks: list[Chunk], started_at: float, ended_at: float) -> Completion:
        data = [c for c in chunks if c.num_tokens > 0]
        itl = [(b.received_at - a.received_at) / b.num_tokens for a, b in zip(data, data[1:])]
        reported = [c.num_output_tokens for c in chunks if c.num_output_tokens is not None]
        # One data response (not streaming): its num_output_tokens is the total, whatever the ids hold.
        n_out = reported[-1] if len(data) == 1 and reported else sum(c.num_tokens for c in data)
        return cls(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            finish_reason=next((c.finish_reason for c in reversed(chunks) if c.finish_reason), None),
            chunks=chunks,
            num_input_tokens=next((c.num_input_tokens for c in chunks if c.num_input_tokens is not None), None),
            num_output_tokens=n_out,
            ttft_s=data[0].received_at - started_at if data else None,
            itl_s=itl,
            e2e_s=ended_at - started_at,
        )


def _is_empty(c: Chunk) -> bool:
    return not (c.text or c.token_ids or c.finish_reason or c.num_output_tokens)


def chunk_from_outputs(
    outputs: dict[str, Any], received_at: float, is_final: bool = False, sample_index: int | None = None
) -> Chunk:
    """Build a Chunk from a response's outputs (numpy arrays from gRPC or JSON values from HTTP), read by the
    decoder the front door uses too (backend/protocol/triton_response.py). A response that carries several samples
    (not streaming, n > 1) is one Chunk: their texts and token ids joined, the first sample's counts."""
    response = decode_response(outputs)
    first = response.samples[0] if response.samples else None
    return Chunk(
        text="".join(s.text for s in response.samples),
        token_ids=[t for s in response.samples for t in s.token_ids],
        finish_reason=next((s.finish_reason for s in response.samples if s.finish_reason), None),
        sample_index=sample_index if sample_index is not None else first.index if first else 0,
        is_final=is_final,
        received_at=received_at,
        num_input_tokens=response.num_input_tokens,
        num_output_tokens=first.num_output_tokens if first else None,
        cumulative_logprob=first.cumulative_logprob if first else None,
        raw=response.raw,
    )
