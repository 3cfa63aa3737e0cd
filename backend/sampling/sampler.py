"""Turns logits into tokens, each sequence with its own parameters and its own seeded generator.

Processing order (as vLLM): penalties, logit_bias and min_tokens on the logits, then temperature, top-k, top-p and
min-p on the distribution. Sampling uses the exponential race (argmax of p / E with E ~ Exp(1) drawn from the
sequence's generator), which draws exactly from p and consumes a fixed amount of randomness per token, so a
seeded sequence reproduces whatever else shares its batch.
"""
from __future__ import annotations

import torch

from backend.core.request import Sequence


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def process_logits(self, logits: torch.Tensor, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        """Penalties, logit_bias and min_tokens for a row whose context is `token_ids` (prompt + output so far).
        Verification applies it too, so speculation keeps the biased distribution exact."""
        params = seq.params
        num_output = len(token_ids) - seq.num_prompt_tokens
        if params.uses_penalties:
            logits = logits.clone()
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
                values = logits[seen]
                logits[seen] = torch.where(
                    values > 0, values / params.repetition_penalty, values * params.repetition_penalty
                )
            output = token_ids[seq.num_prompt_tokens :]
            if output and (params.presence_penalty or params.frequency_penalty):
                ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
                logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            biases = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
            logits = logits.index_add(-1, ids, biases)
        if num_output < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            if banned:
                logits = logits.clone()
                logits[torch.tensor(sorted(banned), dtype=torch.long)] = float("-inf")
        return logits

    def probs(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """The distribution a sampled (temperature > 0) sequence draws from, after top-k/top-p/min-p."""
        params = seq.params
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_k > 0 and params.top_k < probs.shape[-1]:
            kth = torch.topk(probs, params.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, 0.0)
            probs = probs / probs.sum()
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop_sorted = cumulative - sorted_probs >= params.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(-1, order, torch.where(drop_sorted, 0.0, sorted_probs))
        if params.min_p > 0.0:
            probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
        return probs / probs.sum()

    @staticmethod
    def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int(torch.argmax(probs / noise))

    def sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        """One token for `seq` from its next-token logits (float32 [vocab])."""
        logits = self.process_logits(logits, seq, seq.token_ids)
        if seq.params.greedy:
            return int(torch.argmax(logits))
        return self.draw(self.probs(logits, seq), seq.generator)

    @staticmethod
    def logprobs(logits: torch.Tensor, token_id: int, top: int) -> dict:
        """The model's log-probability of the chosen token and its rank, and of its `top` most likely alternatives."""
        return Sampler.logprobs_rows(logits[None], [token_id], top)[0]

    @staticmethod
    def logprobs_rows(logits: torch.Tensor, token_ids: list[int], top: int) -> list[dict]:
        """`logprobs` for each row of logits [R, V] and its token (prompt logprobs: a whole chunk at once)."""
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, torch.tensor(token_ids, dtype=torch.long)[:, None])
        ranks = (logp > chosen).sum(-1) + 1  # 1: the most likely token (as vLLM)
        entries = [{"token_id": t, "logprob": float(c), "rank": int(r)}
                   for t, c, r in zip(token_ids, chosen[:, 0], ranks)]
        if top:
            values, ids = torch.topk(logp, top, dim=-1)
            for entry, row_ids, row_values in zip(entries, ids.tolist(), values.tolist()):
                entry["top_logprobs"] = dict(zip(row_ids, row_values))
        return entries
