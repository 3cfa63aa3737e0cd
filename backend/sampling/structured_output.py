"""Structured output: grammar-constrained decoding with llguidance.

A request may demand text that fits a JSON schema, any JSON object, a regular expression, one of a list of
strings, a grammar (Lark, or GBNF/EBNF as llama.cpp and vLLM write it), or a structural tag (free text in which
JSON fitting a schema follows each trigger). The request side turns the client's keys into one constraint
(backend/protocol/guided_decoding.py, pure). The engine side:

- `GrammarCompiler` turns each constraint into llguidance's grammar (`grammar_text`) and compiles each distinct
  one once, on a small thread pool (never on the engine thread), keeping the compiled matcher in an LRU cache
  keyed by the constraint's text; a request waits in the
  scheduler's queue until its grammar is compiled (`Request.compiling`) and fails with the compiler's message if
  it does not compile.
- every sequence (each of `n` samples) gets its own matcher, a copy of the compiled one. The matcher advances
  with each emitted token (`advance`, from the output processor); preemption keeps it, since the recomputed
  tokens are the ones it has already seen.
- `StructuredOutput.mask_logits` masks, in place, the logits rows of every constrained sequence of a step:
  the masks of all of them are computed together (in parallel, in Rust, without the GIL) and applied with one
  batched tensor operation. For a speculative decode the k + 1 verified rows get the masks of the states after
  each draft prefix, so a draft token the grammar forbids has target probability 0 and is rejected; the
  matcher itself never moves past tokens that were not emitted. The sampled distribution is thus the target's
  renormalised over the allowed tokens.

When the grammar is complete (nothing but end-of-sequence may follow) the sequence finishes with `stop`.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import numpy as np
import torch
from llguidance import LLMatcher

from backend.protocol.guided_decoding import GuidedDecoding
from backend.protocol.values import InvalidRequest
from backend.protocol.wire import INTERNAL, INVALID_REQUEST, ErrorText

# Compact JSON: flexible whitespace lets a small model pad its output with newlines forever.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_options(guided: GuidedDecoding) -> dict:
    """llguidance's JSON options for a constraint: compact (one space after each separator) unless the client
    allowed any whitespace or gave the whitespace's pattern."""
    if guided.whitespace_pattern is not None:  # the pattern, wherever JSON allows whitespace
        return {"whitespace_pattern": guided.whitespace_pattern}
    return {"whitespace_flexible": True} if guided.any_whitespace else dict(_JSON_OPTIONS)


def grammar_text(guided: GuidedDecoding) -> str:
    """llguidance's grammar for a constraint (backend/protocol/guided_decoding.py checked its shape); GBNF that
    does not convert raises InvalidRequest naming the client's key."""
    kind, spec = guided.kind, guided.spec
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=json_options(guided))
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(json.loads(spec), defaults=json_options(guided))
    if kind == "structural_tag":
        return _structural_tag_grammar(guided)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    try:
        return llguidance.grammar_from("grammar", spec)  # Lark as is; GBNF (llama.cpp / vLLM) converted
    except ValueError as exc:
        raise InvalidRequest(f"{guided.key} is not a valid grammar: {exc}") from None


def _structural_tag_grammar(guided: GuidedDecoding) -> str:
    """Free text in which each structure, once its trigger is generated, continues with its begin text, JSON that
    fits its schema (written as json_options says: llguidance reads them from the schema's `x-guidance`) and its
    end text."""
    options = json_options(guided)
    tags = []
    for structure in json.loads(guided.spec)["structures"]:  # each schema an object (guided_decoding.py)
        schema = {**structure["schema"], "x-guidance": options}
        tags.append(
            llguidance.StructTag(
                trigger=structure["trigger"], begin=structure["begin"], grammar=schema, end=structure["end"]
            )
        )
    return llguidance.StructTag.to_grammar(tags)


class GrammarCompiler:
    """Compiles grammars off the engine thread, each distinct text once (LRU cache of compiled matchers)."""

    def __init__(self, model_path: str, vocab_size: int, max_workers: int = 2, cache_size: int = 256):
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # held while the tokenizer is built (about a second), once
        self._tokenizer: llguidance.LLTokenizer | None = None

    def compile(self, guided: GuidedDecoding) -> concurrent.futures.Future:
        """A future of the compiled matcher (in its start state); raises InvalidRequest when it is resolved if
        the grammar does not compile."""
        with self._lock:
            key = (guided.kind, guided.spec, guided.any_whitespace, guided.whitespace_pattern)
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._compile, guided)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return future

    def _compile(self, guided: GuidedDecoding) -> LLMatcher:
        try:
            grammar = grammar_text(guided)
        except InvalidRequest:
            raise
        except ValueError as exc:  # llguidance refused the schema or pattern outright
            raise InvalidRequest(f"the {_WHAT[guided.kind]} does not compile: {exc}") from None
        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the {_WHAT[guided.kind]} does not compile: {matcher.get_error().strip()}")
        return matcher

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's vocabulary, built on first use from the local tokenizer files."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                # its own tokenizer instance: the conversion switches padding and truncation off
                hf_tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size)
            return self._tokenizer


_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def advance(matcher: LLMatcher, token_id: int) -> bool:
    """Feed an emitted token to a sequence's matcher; True when the sequence must stop: the grammar is complete,
    or (never expected, as the logits were masked) the token broke it."""
    return not matcher.consume_token(token_id) or matcher.is_stopped()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [R, V] in place: -inf wherever bit v of row r of `bitmask` ([R, ceil(V / 32)] int32) is 0.
    One pass over the logits: the bits are unpacked (inverted) by numpy, a fraction of the pass's cost."""
    packed = np.invert(bitmask.numpy().view(np.uint8))
    forbidden = np.unpackbits(packed, axis=1, count=logits.shape[1], bitorder="little").view(np.bool_)
    logits.masked_fill_(torch.from_numpy(forbidden).to(logits.device), float("-inf"))


class StructuredOutput:
    """The engine's side: compiles requests' grammars, gives their sequences matchers, masks their logits."""

    def __init__(self, model_path: str, vocab_size: int):
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(model_path, vocab_size)
        self._executor: llguidance.LLExecutor | None = None

    def compile(self, guided: GuidedDecoding | None) -> concurrent.futures.Future | None:
        return None if guided is None else self.compiler.compile(guided)

    def prepare(self, requests: Iterable) -> None:
        """Give the sequences of every request whose grammar has just compiled their own matchers; a request
        whose grammar failed gets the compiler's message as its error (the engine then ends it)."""
        for request in requests:
            if not request.compiling or not request.grammar.done():
                continue
            try:
                compiled = request.grammar.result()
            except InvalidRequest as exc:
                request.error = ErrorText(str(exc), INVALID_REQUEST)
                continue
            except Exception as exc:  # not the client's fault, but only this request's
                request.error = ErrorText(f"the output constraint could not be compiled: {exc}", INTERNAL)
                continue
            for seq in request.sequences:
                seq.matcher = compiled.deep_copy()

    @staticmethod
    def wait(requests: Iterable, timeout_s: float) -> None:
        """Block until a compiling grammar is ready (or the timeout): the engine's idle wait while it has
        nothing to run but requests whose grammars are compiling."""
        pending = [r.grammar for r in requests if r.compiling]
        if pending:
            concurrent.futures.wait(pending, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def mask_logits(self, sched, logits: torch.Tensor) -> None:
        """Mask, in place, the rows of `logits` (a step's sampled rows: `sched.sample_rows[i]` is where scheduled
        sequence i's k + 1 rows start) that belong to constrained sequences. Each matcher is left in the state it
        was in: llguidance steps through a verified sequence's drafts and back within the call."""
        entries = [
            (matcher, row, list(s.draft.token_ids))
            for s, row in zip(sched.scheduled, sched.sample_rows)
            if s.samples and (matcher := sched.sequences[s.seq_id].matcher) is not None
        ]
        if entries:  # inference mode only then: entering it cost a one-row step about 30 us (docs/benchmarks.md)
            self._mask(entries, logits)

    @torch.inference_mode()  # the runner's logits are inference tensors
    def _mask(self, entries: list, logits: torch.Tensor) -> None:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # all allowed, then the constrained rows filled in; rows past a draft token the grammar forbids are
        # never used (that draft is rejected), so they stay unmasked
        # (not through llguidance.torch: importing it runs torch.compile, which loads all of inductor)
        bitmask = torch.full((logits.shape[0], (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        target = (bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])  # where, bytes per row, rows
        plain = [(matcher, first) for matcher, first, drafts in entries if not drafts]
        drafted = [entry for entry in entries if entry[2]]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, *target)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, *target)
        apply_token_bitmask(logits, bitmask)
