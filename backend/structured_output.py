"""Structured output: grammar-constrained decoding with llguidance.

A request may demand text that fits a JSON schema, any JSON object, a regular expression, one of a list of
strings, or a grammar (Lark, or GBNF/EBNF as llama.cpp and vLLM write it). The request side turns the client's
keys into one llguidance grammar (`pop_guided_decoding`). The engine side:

- `GrammarCompiler` compiles each distinct grammar once, on a small thread pool (never on the engine
  thread), and keeps the compiled matcher in an LRU cache keyed by the grammar's text; a request waits in the
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
from dataclasses import dataclass
from typing import Any, Iterable

import llguidance
import numpy as np
import torch
from llguidance import LLMatcher

from .sampling_params import InvalidRequest, as_bool

# vLLM's sampling-parameter keys (also the keys of its newer `structured_outputs` object, less the prefix).
_GUIDED_KEYS = {
    "guided_json": "json",
    "guided_json_object": "json_object",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_OUTPUTS_KEY = "structured_outputs"
CONSTRAINT_KEYS = sorted(_GUIDED_KEYS) + [_STRUCTURED_OUTPUTS_KEY]
# Compact JSON: flexible whitespace lets a small model pad its output with newlines forever.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GuidedDecoding:
    """One output constraint: `kind` is json, json_object, regex, choice or grammar; `grammar` is llguidance's."""

    kind: str
    grammar: str


def pop_guided_decoding(values: dict[str, Any]) -> GuidedDecoding | None:
    """Remove the structured-output keys from a request's parameters and return the constraint they ask for.

    Accepts vLLM's `guided_json` / `guided_json_object` / `guided_regex` / `guided_choice` / `guided_grammar` and
    the `structured_outputs` object (`{"json": ...}`, `{"regex": ...}`, ...); at most one constraint per request.
    """
    found = [(key, _GUIDED_KEYS[key], values.pop(key)) for key in list(values) if key in _GUIDED_KEYS]
    nested = values.pop(_STRUCTURED_OUTPUTS_KEY, None)
    if isinstance(nested, str):
        try:
            nested = json.loads(nested)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"structured_outputs must be a JSON object: {exc.msg} at position {exc.pos}") from None
    if nested is not None:
        if not isinstance(nested, dict):
            raise InvalidRequest(f"structured_outputs must be an object, got {type(nested).__name__}")
        unknown = sorted(set(nested) - set(_GUIDED_KEYS.values()))
        if unknown:
            raise InvalidRequest(
                f"unknown structured_outputs key(s) {unknown}; allowed: {sorted(_GUIDED_KEYS.values())}"
            )
        found += [(f"structured_outputs.{kind}", kind, value) for kind, value in nested.items()]
    # json_object is a flag: false (or null, for any key) asks for nothing
    found = [(key, kind, value) for key, kind, value in found
             if value is not None and (kind != "json_object" or as_bool(key, value))]
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequest(f"give at most one output constraint, got {[key for key, _, _ in found]}")
    (key, kind, value), = found
    return GuidedDecoding(kind, _grammar(key, kind, value))


def _grammar(key: str, kind: str, value: Any) -> str:
    """llguidance's grammar text for a constraint; malformed values (not well-formed JSON, wrong types) raise
    InvalidRequest here, grammars that do not compile fail later, in the compiler."""
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"{key} must be a JSON schema: {exc.msg} at position {exc.pos}") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequest(f"{key} must be a JSON schema (an object), got {type(value).__name__}")
        return LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(f"{key} must be a non-empty list of non-empty strings, got {value!r}")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{key} must be a non-empty string, got {value!r}")
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    try:
        return llguidance.grammar_from("grammar", value)  # Lark as is; GBNF (llama.cpp / vLLM) converted
    except ValueError as exc:
        raise InvalidRequest(f"{key} is not a valid grammar: {exc}") from None


class GrammarCompiler:
    """Compiles grammars off the engine thread, each distinct text once (LRU cache of compiled matchers)."""

    def __init__(self, model_path: str, vocab_size: int, max_workers: int = 2, cache_size: int = 256):
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # held while the tokenizer is built (about a second), once
        self._tokenizer: llguidance.LLTokenizer | None = None

    def compile(self, guided: GuidedDecoding) -> concurrent.futures.Future:
        """A future of the compiled matcher (in its start state); raises InvalidRequest when it is resolved if
        the grammar does not compile."""
        with self._lock:
            future = self._cache.get(guided.grammar)
            if future is None:
                future = self._cache[guided.grammar] = self._pool.submit(self._compile, guided)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(guided.grammar)
            return future

    def _compile(self, guided: GuidedDecoding) -> LLMatcher:
        matcher = LLMatcher(self.tokenizer(), guided.grammar, log_level=0)
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
    "json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
    "choice": "choice list", "grammar": "grammar",
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
                request.error = str(exc)
                continue
            except Exception as exc:  # not the client's fault, but only this request's
                request.error = f"the output constraint could not be compiled: {exc}"
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

    @torch.inference_mode()  # the runner's logits are inference tensors
    def mask_logits(self, scheduled: list, logits: torch.Tensor) -> None:
        """Mask, in place, the rows of `logits` (laid out as the runner returns them: k + 1 rows for each
        scheduled sequence that samples) that belong to constrained sequences."""
        entries, row = [], 0
        for s in scheduled:
            if not s.samples:
                continue
            if s.seq.matcher is not None:
                entries.append((s.seq.matcher, row, list(s.seq.spec_token_ids)))
            row += s.num_spec_tokens + 1
        if not entries:
            return
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
