"""The engine: admits requests, runs one scheduled step at a time, and reports what each step produced.

It is synchronous and single-threaded; `EngineLoop` runs it on its own thread for the Triton model.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Iterable

import numpy as np
import torch
from transformers import AutoTokenizer

from backend.core.block_manager import BlockManager
from backend.core.client_request import ClientRequest
from backend.core.config import ConfigError, EngineConfig
from backend.core.detokenizer import IncrementalDetokenizer
from backend.core.fault_injection import FaultInjector
from backend.core.metrics import EngineMetrics
from backend.core.output_processor import OutputProcessor
from backend.core.request import FinishReason, Request, RequestOutput, Sequence
from backend.core.runner_output import ModelRunnerOutput, SampledTokens
from backend.core.scheduler import Scheduler
from backend.core.scheduler_output import SchedulerOutput
from backend.engine import prompt_outputs, request_checks
from backend.engine.adapters import Adapters
from backend.engine.model_loading import eos_token_ids, make_proposer, model_folder, resolve_weights
from backend.engine.step_records import StepWatchers, describe, step_record
from backend.model import memory_plan
from backend.model.hardware import serving_threads
from backend.model.kv_formats import KV_DTYPES
from backend.model.runner import ForwardItem, ModelRunner
from backend.protocol.sampling_params import SamplingParams
from backend.protocol.values import InvalidRequest
from backend.protocol.wire import INTERNAL, ErrorText
from backend.sampling.sampler import Sampler, take_rows
from backend.sampling.structured_output import StructuredOutput
from backend.spec.decoder import SpeculativeDecoder

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics | None = None):
        self.requested_quantization = config.quantization  # the draft model resolves its own from it
        config = dataclasses.replace(config, model=model_folder(config.model, "model"))
        dtype, quantization = resolve_weights(config, config.model, config.dtype, config.quantization)
        config = self.config = dataclasses.replace(config, dtype=dtype, quantization=quantization)
        self.metrics = metrics or EngineMetrics()
        self.threads = config.num_threads or serving_threads()
        torch.set_num_threads(self.threads)
        log.info(
            "threads: %d for every step (%s)",
            self.threads,
            "num_threads in the configuration" if config.num_threads else "every core this process may use",
        )
        shape = ModelRunner.read_shape(config.model)
        self.max_model_len = min(config.max_model_len or shape.max_model_len, shape.max_model_len)
        self.max_prompt_bytes = config.max_prompt_bytes or request_checks.PROMPT_BYTES_PER_TOKEN * self.max_model_len
        self.faults = FaultInjector(config.fault_injection)
        kv_dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        try:
            kv_bytes = shape.kv_bytes_per_token(KV_DTYPES[kv_dtype])
        except ValueError as exc:  # q8_0 of a head_dim that is no multiple of 32
            raise ConfigError(f"parameter 'kv_cache_dtype': {exc}") from None
        num_blocks = config.kv_cache_blocks or config.kv_cache_memory_bytes // (kv_bytes * config.block_size)
        if num_blocks < 1:
            raise ConfigError("parameter 'kv_cache_memory_bytes' is too small for a single KV block")
        try:
            self.runner = ModelRunner(
                config.model,
                config.dtype,
                config.block_size,
                num_blocks,
                config.device,
                config.model_impl,
                config.quantization,
                config.max_lowbit_rows,
                self.threads,
                config.max_num_batched_tokens,
                kv_dtype,
            )
        except MemoryError as exc:
            raise ConfigError(str(exc)) from None
        log.info("model path %s; linear layers: %s; %s", self.runner.impl, self.runner.kernel, self.runner.memory)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)  # the engine thread's (decoding)
        self.input_tokenizer = AutoTokenizer.from_pretrained(config.model)  # callers' thread (encoding)
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_loras
        )
        self.adapters = Adapters(config, self.runner.model, self.runner.impl == "fused")
        self.sampler = Sampler(shape.vocab_size, self.eos_token_ids)
        self.vocab_size = shape.vocab_size
        self.structured = StructuredOutput(config.model, shape.vocab_size)
        self.outputs = OutputProcessor(self.sampler, self.metrics, self.eos_token_ids, self.max_model_len)
        proposer = make_proposer(
            config, self.requested_quantization, num_blocks, self.vocab_size, self.sampler, self.runner
        )
        self.spec: SpeculativeDecoder | None = None
        if proposer is not None:
            self.spec = SpeculativeDecoder(config, proposer, self.sampler, self.metrics, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._aborting: set[int] = set()  # keys of requests to abort at the top of the next step (`abort_requests`)
        self.num_steps = 0
        self.watchers = StepWatchers()  # live viewers of the batch (step_records.py)
        self.num_lookahead_tokens = config.num_speculative_tokens if config.speculative else 0
        self._seed_source = np.random.default_rng(config.seed or None)
        self._reported_prefix = (0, 0)
        capacity = num_blocks * config.block_size
        log.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB of %s); max concurrency for %d-token sequences: "
            "%.2fx",
            num_blocks,
            config.block_size,
            capacity,
            self.runner.kv_cache.numel() * self.runner.kv_cache.element_size() / 2**20,
            kv_dtype,
            self.max_model_len,
            capacity / self.max_model_len,
        )
        log.info("resident after loading: %.0f MiB", memory_plan.resident_bytes() / 2**20)
        self.metrics.set("llm_kv_cache_blocks_total", num_blocks)
        self.metrics.set("llm_kv_cache_block_tokens", config.block_size)
        self.metrics.set("llm_max_num_seqs", config.max_num_seqs)
        self.metrics.set("llm_engine_alive", 1)
        self.update_gauges()

    # ---- admission ------------------------------------------------------------------------------------
    def build_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_name: str | None = None,
        lora_task_id: int = 0,
        **kwargs,
    ) -> ClientRequest:
        """Tokenize (or, for token ids, check and decode) and check a request against the model, the pool and the
        loaded LoRA adapters (named, or by TensorRT-LLM's task id); raises InvalidRequest. Thread-safe with respect
        to the engine thread (it uses its own tokenizer); the record it returns is not changed after."""
        if lora_task_id and lora_name is None:
            lora_name = self.adapters.name_of_task(lora_task_id)
        if lora_name is not None:
            self.adapters.check(lora_name)
        if isinstance(prompt, str):
            token_ids = request_checks.tokenize(self.input_tokenizer, prompt, self.max_prompt_bytes, self.max_model_len)
        else:
            token_ids = request_checks.check_token_ids(prompt, self.max_model_len, self.vocab_size)
            prompt = self.input_tokenizer.decode(token_ids)
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
        request_checks.check_logits_size(params, len(token_ids), self.vocab_size, self.config.max_logits_mb)
        request_checks.check_token_id_fields(params, self.vocab_size)
        params = request_checks.tokenize_words(self.input_tokenizer, params)
        base_seed = int(self._seed_source.integers(0, 2**62))
        grammar = self.structured.compile(params.guided_decoding)  # starts now, on the compiler's threads
        return ClientRequest(
            request_id, prompt, token_ids, params, base_seed=base_seed, grammar=grammar, lora_name=lora_name, **kwargs
        )

    def add_request(self, client: ClientRequest) -> Request:
        """Admit what a client asked: the engine's own state of it (its sequences) starts here."""
        if client.request_id in self.requests:
            raise InvalidRequest(f"request id {client.request_id!r} is already in flight")
        request = Request(client)
        if request.lora_name is not None:  # unloaded since build_request checked it: refused here
            request.adapter = self.adapters.acquire(request.lora_name)
        params = request.params
        request.sequences = [
            Sequence(
                request,
                i,
                IncrementalDetokenizer(
                    self.tokenizer,
                    request.prompt_token_ids,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                ),
            )
            for i in range(params.n)
        ]
        self.requests[request.request_id] = request
        self.scheduler.add(request.sequences[0], parallel=request.sequences[1:])
        self.metrics.inc("llm_prompt_tokens_total", len(request.prompt_token_ids))
        return request

    def has_work(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._abort(request)
        return self._collect(request)

    def abort_requests(self, keys: Iterable[int]) -> None:
        """Abort these requests (by `ClientRequest.key`) at the top of the next step: their blocks freed, a final
        "abort" output each. A key not in flight is ignored. Engine thread only: other threads send the engine
        loop a message (`EngineLoop.abort_requests`)."""
        self._aborting.update(keys)

    def _abort(self, request: Request, error: str | None = None) -> None:
        request.error = request.error or error
        self.scheduler.release_reservation(request)
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)

    # ---- one step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that has something to say."""
        started = time.perf_counter()
        touched: dict[str, Request] = {}
        self.structured.prepare(self.requests.values())  # matchers for compiled grammars; errors for bad ones
        self.faults.before_step(r.prompt for r in self.requests.values())
        for request in list(self.requests.values()):
            if request.key in self._aborting or request.error:
                self._abort(request)
                touched[request.request_id] = request
        self._aborting.clear()
        speculate = self.spec is not None and self.spec.active(len(self.scheduler.running))
        sched = self.scheduler.schedule(self.spec.num_draft_tokens if speculate else lambda seq: 0)
        if sched.preempted:
            self.metrics.inc("llm_requests_preempted_total", len(sched.preempted))
        if sched.scheduled:
            self.num_steps += 1
            output = ModelRunnerOutput()
            try:
                sched, output = self._run(sched)
                self.scheduler.update_from_output(sched, output, self.outputs.on_token)
            except Exception as exc:  # fail this step's requests, keep serving the others
                log.exception("engine step failed")
                for item in sched.scheduled:
                    request = sched.sequences[item.seq_id].request
                    self._abort(request, ErrorText(f"internal error while generating: {exc}", INTERNAL))
            for item in sched.scheduled:
                request = sched.sequences[item.seq_id].request
                touched[request.request_id] = request
            self._record_step(sched, output, started)
        else:  # nothing to run: perhaps only grammars compiling
            self.structured.wait(self.requests.values(), timeout_s=0.05)
        outputs = [out for r in touched.values() if (out := self._collect(r)) is not None]
        self.update_gauges()
        self.metrics.flush()
        return outputs

    def _run(self, sched: SchedulerOutput) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Propose drafts, run the forward pass, take prompt outputs, sample and verify: the step as it ran (its
        drafts in) and what it produced, as plain records. Changes no sequence: `Scheduler.update_from_output`
        applies it."""
        self.runner.copy_blocks(sched.block_copies)
        if self.spec is not None:
            sched = self.spec.propose(sched)
        seqs = sched.sequences
        self.faults.before_forward(seqs[s.seq_id].request.prompt for s in sched.scheduled)
        items = []
        for s in sched.scheduled:
            seq = seqs[s.seq_id]
            items.append(ForwardItem(s.token_ids, s.start, seq.block_table, s.num_logits, seq.request.adapter))
        logits = self.runner.forward(items)
        output = ModelRunnerOutput()
        if prompt_outputs.wanted(sched):
            logits, output.prompt_outputs = prompt_outputs.take_prompt_outputs(self.sampler, sched, logits)
        output.logits = logits
        self.structured.mask_logits(sched, logits)
        verifying = [(s, row) for s, row in zip(sched.scheduled, sched.sample_rows) if s.num_spec_tokens]
        if verifying:
            self.spec.verify(sched, verifying, logits, output)
        if sched.draws:
            rows = [row for _, row in sched.draws]
            drawing = [seqs[seq_id] for seq_id, _ in sched.draws]
            tokens = self.sampler.sample(take_rows(logits, rows), [seq.sampling_row() for seq in drawing])
            output.sampled += [
                SampledTokens(seq.seq_id, [token], [row], seq.num_tokens - 1)
                for seq, row, token in zip(drawing, rows, tokens)
            ]
        self.outputs.add_logprobs(output, seqs)
        if self.spec is not None:
            self.spec.observe(output)
        return sched, output

    # ---- outputs and statistics -----------------------------------------------------------------------
    def _collect(self, request: Request) -> RequestOutput | None:
        output = self.outputs.collect(request)
        if output is not None and output.finished:
            del self.requests[request.request_id]
            if self.spec is not None:
                self.spec.finish(request.sequences)
            if request.adapter is not None:
                self.adapters.release(request.adapter)
        return output

    def _record_step(self, sched: SchedulerOutput, output: ModelRunnerOutput, started: float) -> None:
        self.metrics.inc("llm_engine_steps_total")
        self.metrics.observe("llm_step_num_sequences", len(sched.scheduled))
        self.metrics.observe("llm_step_num_tokens", sched.num_batched_tokens)
        prefills = [s for s in sched.scheduled if s.is_prefill]
        self.metrics.set("llm_step_prefill_sequences", len(prefills))
        self.metrics.set("llm_step_prefill_tokens", sum(s.num_new_tokens for s in prefills))
        self.metrics.set("llm_step_decode_sequences", len(sched.scheduled) - len(prefills))
        self.metrics.set("llm_step_timestamp_seconds", int(time.time()))
        if self.watchers.active or self.config.log_batch_visualization:  # no record unless someone looks
            record = step_record(
                self.num_steps,
                sched,
                output.num_accepted,
                self.scheduler,
                self.config.max_num_batched_tokens,
                time.perf_counter() - started,
            )
            self.watchers.publish(record)
            if self.config.log_batch_visualization:
                log.info("%s", describe(record))

    def update_gauges(self) -> None:
        bm = self.block_manager
        self.metrics.set("llm_requests_running", len(self.scheduler.running))
        self.metrics.set("llm_requests_waiting", len(self.scheduler.waiting))
        self.metrics.set("llm_requests_in_flight", len(self.scheduler.running) + len(self.scheduler.waiting))
        for state, seqs in (("running", self.scheduler.running), ("waiting", self.scheduler.waiting)):
            self.metrics.set_counts(f"llm_requests_{state}_by_priority", Counter(seq.priority for seq in seqs))
        self.metrics.set("llm_kv_cache_blocks_used", bm.num_used_blocks)
        self.metrics.set("llm_kv_cache_usage_ratio", bm.num_used_blocks / bm.num_blocks)
        self.metrics.set("llm_kv_cache_blocks_free", bm.num_free_blocks)
        self.metrics.set("llm_kv_cache_blocks_cached_free", bm.num_cached_free_blocks)
        queries, hits = self._reported_prefix
        self.metrics.inc("llm_prefix_cache_queries_total", bm.prefix_queries - queries)
        self.metrics.inc("llm_prefix_cache_hits_total", bm.prefix_hits - hits)
        self._reported_prefix = (bm.prefix_queries, bm.prefix_hits)
        # what the inference gateway's LoRA-affinity routing reads (vLLM's labels; max_lora 0 without LoRA)
        running = {s.request.lora_name for s in self.scheduler.running} - {None}
        waiting = {s.request.lora_name for s in self.scheduler.waiting} - {None}
        labels = {
            "running_lora_adapters": ",".join(sorted(running)),
            "waiting_lora_adapters": ",".join(sorted(waiting)),
            "max_lora": str(self.config.max_loras if self.adapters.enabled else 0),
        }
        self.metrics.info("llm_lora_requests_info", labels)
