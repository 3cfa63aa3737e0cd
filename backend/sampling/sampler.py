"""Turns a step's logits into tokens, the whole batch at once, each row with its own parameters and generator.

Processing order (as vLLM): penalties, logit_bias and min_tokens on the logits, then temperature, top-k, top-p and
min-p on the distribution; each is one tensor operation over the rows that ask for it (per-row values as [R, 1]
columns, per-row token sets scattered into [R, V] masks), so a row's result does not depend on its neighbours.
Sampling uses the exponential race (argmax of p / E with E ~ Exp(1) drawn from the row's own generator), which
draws exactly from p and consumes a fixed amount of randomness per token, so a seeded sequence reproduces
whatever else shares its batch. Greedy rows take the argmax of their processed logits and draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence as Rows
from dataclasses import dataclass

import torch

from backend.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One row of logits to turn into a token: whose parameters, after which tokens, with which generator."""

    params: SamplingParams
    context: list[int]  # the tokens before the sampled one: prompt, output so far, any draft prefix
    num_prompt_tokens: int
    generator: torch.Generator


def argmax_rows(values: torch.Tensor) -> list[int]:
    """The index of each row's largest value of [R, V] (the first, on a tie; as torch.argmax). numpy's argmax for
    float32 rows on the CPU: torch's CPU argmax took 0.11 ms on one 49152-token row and 3.1 ms on 32 rows, on one
    thread, where numpy took 0.01 and 0.2 ms (measured; docs/benchmarks.md)."""
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return values.numpy().argmax(-1).tolist()
    return torch.argmax(values, dim=-1).tolist()


def take_rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """values[rows]: `values` itself where that is every row in order (a decode step's layout: no tensor op), a
    view where the rows are consecutive and ascending, else a copy."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return values if len(rows) == len(values) else values[rows[0] : rows[0] + len(rows)]
    return values[rows]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def process_logits(self, logits: torch.Tensor, rows: Rows[SamplingRow]) -> torch.Tensor:
        """Penalties, logit_bias, min_tokens and bad words on logits [R, V] (a new tensor where any applies).
        Verification applies them too, so speculation keeps the processed distribution exact."""
        repetition = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        additive = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        banned = [(i, ids) for i, ids in ((i, self._banned(r)) for i, r in enumerate(rows)) if ids]
        if not (repetition or additive or biased or banned):
            return logits
        logits = logits.clone()
        if repetition:
            seen = torch.zeros(logits.shape, dtype=torch.bool)
            seen[_index(repetition, [set(rows[i].context) for i in repetition])] = True
            penalty = _column(
                [rows[i].params.repetition_penalty if i in repetition else 1.0 for i in range(len(rows))], logits.dtype
            )
            logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        if additive:
            outputs = [rows[i].context[rows[i].num_prompt_tokens :] for i in additive]
            row_ids, token_ids = _index(additive, outputs)
            counts = torch.zeros(logits.shape, dtype=logits.dtype)
            counts.index_put_((row_ids, token_ids), torch.ones(len(row_ids), dtype=logits.dtype), accumulate=True)
            present = counts > 0
            presence = _column([r.params.presence_penalty for r in rows], logits.dtype)
            frequency = _column([r.params.frequency_penalty for r in rows], logits.dtype)
            logits = torch.where(present, logits - (presence + frequency * counts), logits)
        if biased:
            row_ids, token_ids = _index(biased, [list(rows[i].params.logit_bias) for i in biased])
            biases = torch.tensor([b for i in biased for b in rows[i].params.logit_bias.values()], dtype=logits.dtype)
            logits.index_put_((row_ids, token_ids), biases, accumulate=True)
        if banned:
            logits[_index([i for i, _ in banned], [ids for _, ids in banned])] = float("-inf")
        return logits

    def _banned(self, row: SamplingRow) -> list[int]:
        """The tokens a row may not take next: those that would end it before its min_tokens, and the last token of
        each bad word whose other tokens end the context (a draft prefix included, so verification bans what
        sampling would)."""
        params = row.params
        banned = set()
        if len(row.context) - row.num_prompt_tokens < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        for word in params.bad_word_ids:
            if len(word) == 1 or row.context[len(row.context) - len(word) + 1 :] == word[:-1]:
                banned.add(word[-1])
        return sorted(banned)

    def probs(self, logits: torch.Tensor, rows: Rows[SamplingRow]) -> torch.Tensor:
        """The distributions [R, V] sampled (temperature > 0) rows draw from: softmax at each row's temperature,
        then each row's top-k, top-p and min-p."""
        params = [r.params for r in rows]
        probs = torch.softmax(logits / _column([p.temperature for p in params], logits.dtype), dim=-1)
        vocab = probs.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(top_k):
            ordered = torch.sort(probs, dim=-1, descending=True).values
            kth = ordered.gather(-1, torch.tensor([[max(k, 1) - 1] for k in top_k]))
            kept = torch.where(probs >= kth, probs, 0.0)
            probs = torch.where(_column([k > 0 for k in top_k], torch.bool), kept / kept.sum(-1, keepdim=True), probs)
        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            ordered, order = torch.sort(probs, dim=-1, descending=True)
            cumulative = torch.cumsum(ordered, dim=-1)
            # keep the smallest set reaching top_p; rows at 1.0 keep everything
            drop = (cumulative - ordered >= _column(top_p, probs.dtype)) & _column([p < 1.0 for p in top_p], torch.bool)
            probs = probs.scatter(-1, order, torch.where(drop, 0.0, ordered))
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            floor = _column(min_p, probs.dtype) * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs >= floor, probs, 0.0)
        return probs / probs.sum(-1, keepdim=True)

    @staticmethod
    def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
        """One token from the distribution `probs` [V], with the row's own generator."""
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return argmax_rows((probs / noise)[None])[0]

    @staticmethod
    def draw_rows(probs: torch.Tensor, rows: Rows[SamplingRow]) -> list[int]:
        """A token from each row of `probs` [R, V]: each row's noise from its own generator, one argmax for all."""
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=row.generator)
        return argmax_rows(probs / noise)

    def sample(self, logits: torch.Tensor, rows: Rows[SamplingRow]) -> list[int]:
        """A token for each row of next-token logits [R, V] (float32)."""
        return self.sample_processed(self.process_logits(logits, rows), rows)

    def sample_processed(self, logits: torch.Tensor, rows: Rows[SamplingRow]) -> list[int]:
        """`sample` on logits that `process_logits` has already seen."""
        tokens = argmax_rows(logits)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            chosen = [rows[i] for i in sampled]
            for i, token in zip(sampled, self.draw_rows(self.probs(logits[sampled], chosen), chosen)):
                tokens[i] = token
        return tokens

    @staticmethod
    def logprobs_rows(logits: torch.Tensor, token_ids: list[int], top: int) -> list[dict]:
        """For each row of logits [R, V] and its token: the token's log-probability and rank, and the row's `top` most
        likely alternatives (a step's chosen tokens, or a whole prompt chunk, at once)."""
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, torch.tensor(token_ids, dtype=torch.long)[:, None])
        ranks = (logp > chosen).sum(-1) + 1  # 1: the most likely token (as vLLM)
        entries = [
            {"token_id": t, "logprob": float(c), "rank": int(r)} for t, c, r in zip(token_ids, chosen[:, 0], ranks)
        ]
        if top:
            values, ids = torch.topk(logp, top, dim=-1)
            for entry, row_ids, row_values in zip(entries, ids.tolist(), values.tolist()):
                entry["top_logprobs"] = dict(zip(row_ids, row_values))
        return entries


def _column(values: list, dtype: torch.dtype) -> torch.Tensor:
    """Per-row values as an [R, 1] column that broadcasts over the vocabulary."""
    return torch.tensor(values, dtype=dtype)[:, None]


def _index(row_ids: list[int], token_sets: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, tokens) index tensors addressing every token of each listed row's set (or list)."""
    rows = [i for i, tokens in zip(row_ids, token_sets) for _ in tokens]
    tokens = [t for tokens in token_sets for t in tokens]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(tokens, dtype=torch.long)
