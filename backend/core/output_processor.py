"""What happens to a token after it is chosen: stop rules, latency metrics, and the outputs clients receive.

`on_token` accounts for a token the scheduler just appended and says whether it ends the sequence: EOS, a stop
token, a stop string (the detokenizer holds back text that may become one), a completed grammar, max_tokens or
the model's length.
`collect` turns a request's state into a `RequestOutput`: the new text, token ids and logprobs of every sample
for a stream, everything at the end otherwise, with each sample's cumulative logprob so far when it is
tracked, and the prompt's logprobs (when asked for) once, in the first output after the prompt is computed.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from backend.core.metrics import EngineMetrics
from backend.core.request import (
    FinishReason,
    Request,
    RequestOutput,
    SampleOutput,
    Sequence,
)
from backend.core.runner_output import ModelRunnerOutput, SampledTokens
from backend.sampling.sampler import Sampler, take_rows
from backend.sampling.structured_output import advance


@dataclass
class SampleProgress:
    """What has been emitted and sent of one sequence: the output side's bookkeeping, kept here."""

    logprobs: list[dict] = field(default_factory=list)
    generation_logits: list[torch.Tensor] = field(default_factory=list)  # each token's logits, when asked for
    cumulative_logprob: float = 0.0  # sum of the sampled tokens' logprobs, when tracked
    num_sent_tokens: int = 0  # output tokens already in a stream's outputs
    final_sent: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None


class OutputProcessor:
    def __init__(
        self,
        sampler: Sampler,
        metrics: EngineMetrics,
        eos_token_ids: set[int],
        max_model_len: int,
    ):
        self.sampler = sampler
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._progress: dict[int, SampleProgress] = {}  # by seq_id, until its request's last output

    def progress(self, seq: Sequence) -> SampleProgress:
        progress = self._progress.get(seq.seq_id)
        if progress is None:
            progress = self._progress[seq.seq_id] = SampleProgress()
        return progress

    def add_logprobs(self, output: ModelRunnerOutput, sequences: dict[int, Sequence]) -> None:
        """Fill in the logprobs entries of every token the step chose for a sequence that tracks them (`sequences`:
        the step's, by seq_id), computed together: one log-softmax over those rows per distinct `logprobs` count,
        not one per token."""
        by_top: dict[int, list[tuple[SampledTokens, int]]] = {}
        for result in output.sampled:
            seq = sequences[result.seq_id]
            if _tracks_cumulative(seq):
                result.logprobs = [None] * len(result.token_ids)
                by_top.setdefault(seq.params.logprobs or 0, []).extend(
                    (result, i) for i in range(len(result.token_ids))
                )
        for top, tokens in by_top.items():
            rows = take_rows(output.logits, [result.rows[i] for result, i in tokens])
            token_ids = [result.token_ids[i] for result, i in tokens]
            for (result, i), entry in zip(tokens, self.sampler.logprobs_rows(rows, token_ids, top)):
                result.logprobs[i] = entry

    def on_token(
        self, seq: Sequence, token_id: int, logits: torch.Tensor, row: int, entry: dict | None
    ) -> FinishReason | None:
        """Account for a token just appended to `seq` (latency metrics, logprobs, generation logits, its text) and
        apply every stop rule: the reason it ends the sequence, or None. `logits[row]` its logits (indexed only
        where kept: a tensor op per token, run with the caches the step's pass flushed, is tens of us), `entry` its
        logprobs, when tracked."""
        params = seq.params
        progress = self.progress(seq)
        now = time.perf_counter()
        if progress.first_token_time is None:
            progress.first_token_time = now
            self.metrics.observe("llm_time_to_first_token_seconds", now - seq.request.arrival_time)
        else:
            self.metrics.observe("llm_inter_token_latency_seconds", now - progress.last_token_time)
        progress.last_token_time = now
        seq.request.stats.token()
        self.metrics.inc("llm_generation_tokens_total")
        if entry is not None:
            progress.cumulative_logprob += entry["logprob"]
            if params.logprobs is not None:
                progress.logprobs.append(entry)
        if params.generation_logits:
            progress.generation_logits.append(logits[row].detach().float().clone())  # a copy: not a view
        if (
            token_id in params.stop_token_ids
            or (not params.ignore_eos and token_id in self.eos_token_ids)
            or (
                seq.num_output_tokens >= params.min_tokens
                and _ends_with_any(seq.output_token_ids, params.stop_word_ids)
            )
        ):
            if params.include_stop_str_in_output:
                seq.detokenizer.append(token_id)
            return FinishReason.STOP  # its id is in output_ids; its text only if asked for
        if seq.detokenizer.append(token_id):
            return FinishReason.STOP
        if seq.matcher is not None and advance(seq.matcher, token_id):
            return FinishReason.STOP  # the grammar is complete
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def collect(self, request: Request) -> RequestOutput | None:
        """The request's output for this step, or None when it has nothing to say."""
        finished = request.finished
        samples = []
        if request.stream:
            for seq in request.sequences:
                progress = self.progress(seq)
                new_ids = seq.output_token_ids[progress.num_sent_tokens :]
                if seq.is_finished:
                    seq.detokenizer.flush()
                text = seq.detokenizer.take_new_text(seq.is_finished)
                if new_ids or text or (seq.is_finished and not progress.final_sent):
                    samples.append(_sample_output(seq, progress, text, new_ids, progress.num_sent_tokens))
                    progress.final_sent = seq.is_finished
                progress.num_sent_tokens = seq.num_output_tokens
        elif finished:
            for seq in request.sequences:
                progress = self.progress(seq)
                seq.detokenizer.flush()
                text = seq.detokenizer.take_new_text(True)
                samples.append(_sample_output(seq, progress, text, seq.output_token_ids, 0))
        if not samples and not finished:
            return None
        if finished:
            for seq in request.sequences:
                self._progress.pop(seq.seq_id, None)
            self.metrics.observe("llm_e2e_request_latency_seconds", time.perf_counter() - request.arrival_time)
            self.metrics.observe("llm_request_prompt_tokens", len(request.prompt_token_ids))
            self.metrics.observe("llm_request_generation_tokens", sum(s.num_output_tokens for s in request.sequences))
            self.metrics.observe("llm_request_params_n", request.params.n)
            reason = request.sequences[0].finish_reason.value if request.sequences[0].finish_reason else "abort"
            self.metrics.inc("llm_requests_finished_total", labels={"finish_reason": reason})
        prompt_logprobs = context_logits = None
        if samples and not request.computing_prompt_outputs and not request.prompt_outputs_sent:
            prompt_logprobs, context_logits = request.prompt_logprobs, request.context_logits
            request.prompt_outputs_sent = True
        return RequestOutput(
            request.request_id,
            samples,
            len(request.prompt_token_ids),
            finished,
            request.error,
            request.key,
            prompt_logprobs,
            context_logits,
            dataclasses.replace(request.stats),
            request.num_cached_tokens or 0,
        )


def _sample_output(
    seq: Sequence, progress: SampleProgress, text: str, token_ids: list[int], first: int
) -> SampleOutput:
    """The sample's output carrying `token_ids`, its tokens from index `first` on."""
    return SampleOutput(
        sample_index=seq.sample_index,
        text=text,
        token_ids=list(token_ids),
        finish_reason=seq.finish_reason,
        num_output_tokens=seq.num_output_tokens,
        logprobs=progress.logprobs[first:] if seq.params.logprobs is not None else None,
        cumulative_logprob=progress.cumulative_logprob if _tracks_cumulative(seq) else None,
        generation_logits=progress.generation_logits[first:] if seq.params.generation_logits else None,
    )


def _ends_with_any(tokens: list[int], suffixes: list[list[int]]) -> bool:
    return any(len(tokens) >= len(s) and tokens[len(tokens) - len(s) :] == s for s in suffixes)


def _tracks_cumulative(seq: Sequence) -> bool:
    """Whether the sampled tokens' logprobs are computed: for the logprobs output or the cumulative logprob."""
    return seq.params.logprobs is not None or seq.request.tracks_cumulative_logprob
