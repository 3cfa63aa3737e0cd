"""The engine: admits requests, runs one scheduled step at a time, and reports what each step produced.

It is synchronous and single-threaded; `EngineLoop` runs it on its own thread for the Triton model.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
from transformers import AutoTokenizer, GenerationConfig

from .block_manager import BlockManager
from .config import ConfigError, EngineConfig
from .detokenizer import IncrementalDetokenizer
from .metrics import EngineMetrics
from .model_runner import DTYPES, ForwardItem, ModelRunner
from .proposers import DraftModelProposer, NgramProposer, Proposer
from .rejection_sampler import verify_greedy, verify_sampled
from .request import FinishReason, Request, RequestOutput, SampleOutput, Sequence, SequenceStatus
from .sampler import Sampler
from .sampling_params import InvalidRequest, SamplingParams
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics | None = None):
        self.config = config
        self.metrics = metrics or EngineMetrics()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        shape = ModelRunner.read_shape(config.model)
        self.max_model_len = min(config.max_model_len or shape.max_model_len, shape.max_model_len)
        num_blocks = config.kv_cache_blocks or config.kv_cache_memory_bytes // (
            shape.kv_bytes_per_token(DTYPES[config.dtype]) * config.block_size
        )
        if num_blocks < 1:
            raise ConfigError("parameter 'kv_cache_memory_bytes' is too small for a single KV block")
        self.runner = ModelRunner(config.model, config.dtype, config.block_size, num_blocks, config.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)  # the engine thread's (decoding)
        self.input_tokenizer = AutoTokenizer.from_pretrained(config.model)  # callers' thread (encoding)
        self.eos_token_ids = _eos_token_ids(config.model, self.tokenizer)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(shape.vocab_size, self.eos_token_ids)
        self.vocab_size = shape.vocab_size
        self.proposer = self._make_proposer(num_blocks)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_lookahead_tokens = config.num_speculative_tokens if config.speculative else 0
        self._seed_source = np.random.default_rng(config.seed or None)
        self._reported_prefix = (0, 0)
        self._last_cancel_poll = 0.0
        self.cancel_poll_interval_s = 0.05  # how often clients' cancellations are checked
        capacity = num_blocks * config.block_size
        log.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB); max concurrency for %d-token sequences: %.2fx",
            num_blocks, config.block_size, capacity, self.runner.kv_cache.numel()
            * self.runner.kv_cache.element_size() / 2**20, self.max_model_len, capacity / self.max_model_len,
        )
        self.metrics.set("llm_kv_cache_blocks_total", num_blocks)
        self._update_gauges()

    def _make_proposer(self, num_blocks: int) -> Proposer | None:
        config = self.config
        if not config.speculative:
            return None
        if config.draft_model == "ngram":
            return NgramProposer(config.ngram_min, config.ngram_max)
        path = config.model if config.draft_model == "self" else config.draft_model
        runner = ModelRunner(path, config.draft_dtype, config.block_size, num_blocks, config.device)
        if runner.shape.vocab_size < self.vocab_size:
            raise ConfigError(
                f"parameter 'draft_model': its vocabulary ({runner.shape.vocab_size}) is smaller than the "
                f"target's ({self.vocab_size}); the draft must share the target's tokenizer"
            )
        return DraftModelProposer(runner, self.sampler)

    def _num_spec_tokens(self, seq: Sequence) -> int:
        """Draft tokens this decode may verify: the request's k (never above the configured k), no more than
        its remaining output allows."""
        params = seq.params
        k = self.config.num_speculative_tokens
        if params.num_speculative_tokens is not None:
            k = min(k, params.num_speculative_tokens)
        remaining = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(k, remaining))

    # ---- admission ------------------------------------------------------------------------------------
    def build_request(self, request_id: str, prompt: str, params: SamplingParams, **kwargs) -> Request:
        """Tokenize and check a request against the model and the pool; raises InvalidRequest. Thread-safe
        with respect to the engine thread (it uses its own tokenizer)."""
        if not prompt:
            raise InvalidRequest("text_input must be a non-empty string")
        token_ids = self.input_tokenizer(prompt).input_ids
        if not token_ids:
            raise InvalidRequest("text_input produced no tokens")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(token_ids)} tokens and max_tokens is {params.max_tokens}: together they "
                f"exceed the model's limit of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        if self.block_manager.blocks_needed(total + self.num_lookahead_tokens) > self.block_manager.num_blocks:
            self.metrics.inc("llm_requests_rejected_total")
            self.metrics.flush()
            raise InvalidRequest(
                f"the prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) can never fit the KV "
                f"cache of {self.block_manager.num_blocks * self.config.block_size} tokens"
            )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequest(
                f"n must be at most {self.config.max_num_seqs} (max_num_seqs: the samples run together), got {params.n}"
            )
        bad_ids = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_ids:
            raise InvalidRequest(f"stop_token_ids must be token ids below {self.vocab_size}, got {bad_ids}")
        base_seed = int(self._seed_source.integers(0, 2**62))
        return Request(request_id, prompt, token_ids, params, base_seed=base_seed, **kwargs)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already in flight")
        params = request.params
        request.sequences = [
            Sequence(request, i, IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.stop, params.include_stop_str_in_output,
                params.skip_special_tokens,
            ))
            for i in range(params.n)
        ]
        request.unforked = request.sequences[1:]
        self.requests[request.request_id] = request
        self.scheduler.add(request.sequences[0])
        self.metrics.inc("llm_prompt_tokens_total", len(request.prompt_token_ids))

    def has_work(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._abort(request)
        return self._collect(request)

    def _abort(self, request: Request, error: str | None = None) -> None:
        request.error = request.error or error
        self.scheduler.release_reservation(request)
        for seq in request.sequences:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)

    # ---- one step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that has something to say."""
        touched: dict[str, Request] = {}
        now = time.monotonic()
        poll_all = now - self._last_cancel_poll >= self.cancel_poll_interval_s  # a poll is a round trip to Triton
        if poll_all:
            self._last_cancel_poll = now
        for request in list(self.requests.values()):
            if (poll_all or not request.polled) and request.is_cancelled():
                self._abort(request)
                touched[request.request_id] = request
            request.polled = True
        speculate = self.proposer is not None and len(self.scheduler.running) <= self.config.spec_max_batch_size
        sched = self.scheduler.schedule(self._num_spec_tokens if speculate else lambda seq: 0)
        if sched.preempted:
            self.metrics.inc("llm_requests_preempted_total", len(sched.preempted))
        if sched.scheduled:
            self.num_steps += 1
            try:
                self._run(sched)
            except Exception as exc:  # fail this step's requests, keep serving the others
                log.exception("engine step failed")
                for item in sched.scheduled:
                    self._abort(item.seq.request, f"internal error while generating: {exc}")
            for item in sched.scheduled:
                touched[item.seq.request.request_id] = item.seq.request
            self._record_step(sched)
        outputs = [out for r in touched.values() if (out := self._collect(r)) is not None]
        self._update_gauges()
        self.metrics.flush()
        return outputs

    def _run(self, sched: SchedulerOutput) -> None:
        copies = self.block_manager.take_pending_copies()
        self.runner.copy_blocks(copies)
        if self.proposer is not None:
            self.proposer.copy_blocks(copies)
            self._propose(sched)
        items = []
        for s in sched.scheduled:
            seq = s.seq
            tokens = seq.token_ids[s.start : s.start + s.num_new_tokens - s.num_spec_tokens] + seq.spec_token_ids
            items.append(ForwardItem(tokens, s.start, seq.block_table, s.num_spec_tokens + 1 if s.samples else 0))
        logits = self.runner.forward(items)
        row = 0
        for s in sched.scheduled:
            seq = s.seq
            if s.num_spec_tokens:
                self._verify(s, logits[row : row + s.num_spec_tokens + 1])
                row += s.num_spec_tokens + 1
                continue
            seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.commit(seq)
            if s.samples:
                self._sample(s, logits[row])
                row += 1

    def _propose(self, sched: SchedulerOutput) -> None:
        """Ask the proposer for drafts; a sequence that gets fewer than asked verifies fewer."""
        speculating = [s for s in sched.scheduled if s.num_spec_tokens]
        for s in sched.scheduled:
            s.seq.spec_token_ids = []
        self.proposer.propose([(s.seq, s.num_spec_tokens) for s in speculating])
        for s in speculating:
            unused = s.num_spec_tokens - len(s.seq.spec_token_ids)
            s.num_new_tokens -= unused
            s.num_spec_tokens -= unused

    def _verify(self, s: ScheduledSeq, logits: torch.Tensor) -> None:
        """Accept a prefix of the draft, roll the KV back past it, and append the emitted tokens."""
        seq = s.seq
        drafts = seq.spec_token_ids
        num_tokens = seq.num_tokens
        rows = [self.sampler.process_logits(logits[i], seq, seq.token_ids + drafts[:i]) for i in range(len(drafts) + 1)]
        if seq.params.greedy:
            result = verify_greedy([int(torch.argmax(r)) for r in rows], drafts)
        else:
            target_probs = torch.stack([self.sampler.probs(r, seq) for r in rows])
            result = verify_sampled(target_probs, drafts, seq.spec_draft_probs, seq.generator)
        seq.num_computed_tokens = num_tokens + result.num_accepted  # KV of rejected positions is dropped
        seq.draft_num_computed = min(seq.draft_num_computed, seq.num_computed_tokens)
        seq.spec_token_ids = []
        self.block_manager.trim(seq)
        self.block_manager.commit(seq)
        self.metrics.inc("llm_spec_decode_num_drafts_total")
        self.metrics.inc("llm_spec_decode_num_draft_tokens_total", len(drafts))
        self.metrics.inc("llm_spec_decode_num_accepted_tokens_total", result.num_accepted)
        for position in range(result.num_accepted):
            self.metrics.inc("llm_spec_decode_num_accepted_tokens_per_pos_total", labels={"position": position})
        for i, token_id in enumerate(result.tokens):
            if self._append_token(seq, token_id, logits[i]):
                break

    def _sample(self, s: ScheduledSeq, logits: torch.Tensor) -> None:
        seq = s.seq
        family = [seq]
        if seq.request.unforked and seq.sample_index == 0:  # the prompt is in: parallel samples share it
            children = seq.request.unforked
            for child in children:
                self.block_manager.fork(seq, child)
            self.scheduler.add_forked(children)
            family += children
        for member in family:
            self._append_token(member, self.sampler.sample(logits, member), logits)

    def _append_token(self, seq: Sequence, token_id: int, logits: torch.Tensor) -> bool:
        """Add a generated token and apply every stop rule; returns True if the sequence finished."""
        params = seq.params
        seq.token_ids.append(token_id)
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.observe("llm_time_to_first_token_seconds", now - seq.request.arrival_time)
        else:
            self.metrics.observe("llm_inter_token_latency_seconds", now - seq.last_token_time)
        seq.last_token_time = now
        self.metrics.inc("llm_generation_tokens_total")
        if params.logprobs is not None:
            seq.logprobs.append(self.sampler.logprobs(logits, token_id, params.logprobs))
        reason = None
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            reason = FinishReason.STOP  # its id is in output_ids; its text only if asked for
            if params.include_stop_str_in_output:
                seq.detokenizer.append(token_id)
        elif seq.detokenizer.append(token_id):
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason)
        return reason is not None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        seq.detokenizer.flush()
        self.scheduler.finish(seq)

    # ---- outputs and statistics -----------------------------------------------------------------------
    def _collect(self, request: Request) -> RequestOutput | None:
        finished = request.finished
        samples = []
        if request.stream:
            for seq in request.sequences:
                new_ids = seq.output_token_ids[seq.num_sent_tokens :]
                text = seq.detokenizer.take_new_text(seq.is_finished)
                if new_ids or text or (seq.is_finished and not seq.final_sent):
                    samples.append(self._sample_output(seq, text, new_ids, seq.logprobs[seq.num_sent_tokens :]))
                    seq.final_sent = seq.is_finished
                seq.num_sent_tokens = seq.num_output_tokens
        elif finished:
            for seq in request.sequences:
                text = seq.detokenizer.take_new_text(True)
                samples.append(self._sample_output(seq, text, seq.output_token_ids, seq.logprobs))
        if not samples and not finished:
            return None
        if finished:
            del self.requests[request.request_id]
            self.metrics.observe("llm_e2e_request_latency_seconds", time.perf_counter() - request.arrival_time)
            reason = request.sequences[0].finish_reason.value if request.sequences[0].finish_reason else "abort"
            self.metrics.inc("llm_requests_finished_total", labels={"finish_reason": reason})
        return RequestOutput(
            request.request_id, samples, len(request.prompt_token_ids), finished, request.error, request
        )

    @staticmethod
    def _sample_output(seq: Sequence, text: str, token_ids: list[int], logprobs: list[dict]) -> SampleOutput:
        return SampleOutput(
            sample_index=seq.sample_index,
            text=text,
            token_ids=list(token_ids),
            finish_reason=seq.finish_reason,
            num_output_tokens=seq.num_output_tokens,
            logprobs=list(logprobs) if seq.params.logprobs is not None else None,
        )

    def _record_step(self, sched: SchedulerOutput) -> None:
        self.metrics.inc("llm_engine_steps_total")
        self.metrics.observe("llm_step_num_sequences", len(sched.scheduled))
        self.metrics.observe("llm_step_num_tokens", sched.num_batched_tokens)
        if self.config.log_batch_visualization:
            log.info("%s", self.describe_step(sched))

    def describe_step(self, sched: SchedulerOutput) -> str:
        """One line per step: which sequences ran, prefill chunk or decode, and how many tokens each."""
        parts = []
        for s in sched.scheduled:
            seq = s.seq
            if s.is_prefill or s.num_new_tokens > 1 + s.num_spec_tokens:
                kind = f"prefill {s.start}:{s.start + s.num_new_tokens}/{seq.num_prompt_tokens}"
            else:
                kind = "decode" + (f"+{s.num_spec_tokens} draft" if s.num_spec_tokens else "")
            parts.append(f"[{seq.request.request_id}#{seq.sample_index} {kind} {s.num_new_tokens}t]")
        preempted = f" preempted {len(sched.preempted)}" if sched.preempted else ""
        return (
            f"step {self.num_steps}: {len(sched.scheduled)} seqs, {sched.num_batched_tokens}/"
            f"{self.config.max_num_batched_tokens} tokens{preempted} " + " ".join(parts)
        )

    def _update_gauges(self) -> None:
        bm = self.block_manager
        self.metrics.set("llm_requests_running", len(self.scheduler.running))
        self.metrics.set("llm_requests_waiting", len(self.scheduler.waiting))
        self.metrics.set("llm_kv_cache_blocks_used", bm.num_used_blocks)
        self.metrics.set("llm_kv_cache_blocks_free", bm.num_free_blocks)
        self.metrics.set("llm_kv_cache_blocks_cached_free", bm.num_cached_free_blocks)
        queries, hits = self._reported_prefix
        self.metrics.inc("llm_prefix_cache_queries_total", bm.prefix_queries - queries)
        self.metrics.inc("llm_prefix_cache_hits_total", bm.prefix_hits - hits)
        self._reported_prefix = (bm.prefix_queries, bm.prefix_hits)


def _eos_token_ids(model_path: str, tokenizer) -> set[int]:
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return ids
