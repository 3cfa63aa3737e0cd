"""Drafts from a trained EAGLE-style head (`eagle_head.py`), fed by the target's features in the running batch.

The head needs the target's feature (its LM head's input) at each sequence's last verified position. The target
pass returns logits only, and the LM head is linear: the features of every row a step sampled or verified are
recovered from those logits (`draft_data.FeatureRecovery`: a [rows, 1024] x [1024, hidden] product), so the
target's pass and kernels are unchanged. `observe` keeps only each row's 1,024 recovery columns with the token
chosen there; the product runs when the sequence next drafts, over every row kept since, so a sequence that does
not draft (under `auto`, one that suffix decoding serves) costs a column gather per step, not a product (a
product per step is about 7 % of an open-chat run at batch 1: each op after the forward pass runs cold).

The head's KV is its own and small (one layer, kv_heads x head_dim per position): per sequence it keeps the keys
and values of the last `window` true-feature rows, computed once when they are first drafted from, and attends
over them and the chain's own rows, as in training. It is not paged: the head never sees the prompt (only the
features the target produced while generating), so there is nothing to share between sequences or to keep past
the window, and the target's block tables have nothing to address.

Drafts are exact to verify: greedy drafts are the head's argmax (a target id); a sampled request's draft is drawn
from q, the head's distribution over the draft vocabulary put on the target's vocabulary (zero elsewhere), after the
request's own logit processing, and q goes to the rejection sampler unchanged.
"""

from __future__ import annotations

import torch

from backend.core.request import Sequence
from backend.core.runner_output import ModelRunnerOutput
from backend.core.scheduler_output import Draft
from backend.model import kernels
from backend.model.linear import make_linear
from backend.model.runner import ModelRunner
from backend.model.weight_blocks import quantize_q8_0
from backend.sampling.sampler import Sampler
from backend.spec import eagle_head
from backend.spec.draft_data import FeatureRecovery
from backend.spec.proposers import Proposer


class _SeqState:
    __slots__ = ("pending", "keys", "values", "last")

    def __init__(self):
        # (position, the row's recovery columns of logits, token) not yet in the KV
        self.pending: list[tuple[int, torch.Tensor, int]] = []
        self.keys = self.values = None  # [1, P, kv_heads, D] of the rows already computed
        self.last: tuple[int, int] | None = None  # (position, token) of the newest row


class _KernelLinear(torch.nn.Module):
    """A projection of [..., in] rows on the low-bit kernel, its weight re-quantized to Q8_0 (a draft needs no
    exact weights: a quarter of fp32's bytes, so the whole head stays in the last-level cache between drafts).
    The blocks are the only copy: every step runs on the kernel (a draft's steps are a chain's few rows)."""

    def __init__(self, weight: torch.Tensor, isa: int):
        super().__init__()
        self.linear = make_linear([None], [None], "none", 64, [quantize_q8_0(weight.detach().float()).packed()], isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


def _on_kernels(head: eagle_head.EagleHead) -> str:
    """Every projection of `head` and its LM head rows on the low-bit kernel where there is one for this CPU."""
    isa = kernels.best_isa()
    if not isa or head.shape.hidden % 32 or head.shape.intermediate % 32:
        return "torch"
    for name in ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        setattr(head, name, _KernelLinear(getattr(head, name).weight, isa))
    head.head_linear = _KernelLinear(head.head, isa)
    head.head = None  # the rows' fp32 copy: the kernel's blocks serve them
    return f"q8_0 on the {kernels.ISA_NAMES[isa]} kernel"


class EagleProposer(Proposer):
    def __init__(self, folder: str, target: ModelRunner, sampler: Sampler):
        if target.fused is None:
            raise ValueError("an EAGLE draft needs the target's fused (Llama-family) forward")
        self.embed = target.fused.embed
        rows = self.target_rows
        self.head, recovery_rows, self.config = eagle_head.load(folder, rows)
        if self.head.shape.hidden != self.embed.width or self.head.shape.target_vocab != self.embed.vocab_size:
            raise ValueError("the EAGLE draft was trained for another model (hidden size or vocabulary differ)")
        self.head.requires_grad_(False)
        self.kernel = _on_kernels(self.head)
        self.recovery = FeatureRecovery(rows(recovery_rows), recovery_rows)
        self.window = self.head.shape.window
        self.sampler = sampler
        self._states: dict[int, _SeqState] = {}  # seq_id -> its context, until it finishes

    def target_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's tied LM head rows of `ids` (its embedding's)."""
        return self.embed(ids.long().reshape(-1)).float().view(*ids.shape, -1)

    # ---- what the target computed ------------------------------------------------------------------------
    def observe(self, output: ModelRunnerOutput) -> None:
        """Every sampled or verified row (its recovery columns), with the token chosen from it, joins its sequence's
        context."""
        picks = [
            (s.seq_id, s.position + i, row, token)  # the row's position; the token goes at the next one
            for s in output.sampled
            for i, (row, token) in enumerate(zip(s.rows, s.token_ids))
        ]
        if not picks or output.logits is None:
            return
        columns = output.logits.index_select(1, self.recovery.rows).unbind(0)  # each row's, as views
        for seq_id, position, row, token in picks:
            state = self._states.get(seq_id)
            if state is None or (state.last is not None and position <= state.last[0]):  # new, or recomputed
                state = self._states[seq_id] = _SeqState()
            state.pending.append((position, columns[row], token))
            del state.pending[: -self.window]
            state.last = (position, token)

    def finish(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._states.pop(seq.seq_id, None)

    # ---- drafting ----------------------------------------------------------------------------------------
    def propose(self, requests: list[tuple[Sequence, int]]) -> list[Draft]:
        with torch.inference_mode():
            return [self._propose(seq, k) for seq, k in requests]

    def _propose(self, seq: Sequence, k: int) -> Draft:
        state = self._states.get(seq.seq_id)
        if state is None or not state.pending or state.last != (seq.num_tokens - 2, seq.token_ids[-1]):
            return Draft([])  # no feature of the last verified position (e.g. recomputed after preemption)
        head = self.head
        out = self._context_rows(state)
        if out is None:
            return Draft([])
        tokens, probs = [], []
        chain_k, chain_v = [], []
        position = state.last[0]
        while True:
            feature, logits = head.predict(out[:, -1:])
            token, q = self._choose(seq, tokens, logits[0, 0])
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if len(tokens) >= k:
                break
            position += 1
            x = head.rows(self.target_rows(torch.tensor([[token]])), feature)
            prior_k = torch.cat([state.keys, *chain_k], dim=1)
            prior_v = torch.cat([state.values, *chain_v], dim=1)
            mask = torch.ones(1, prior_k.shape[1] + 1, dtype=torch.bool)
            out, key, value = head.layer(x, torch.tensor([position]), prior_k, prior_v, mask)
            chain_k.append(key)
            chain_v.append(value)
        return Draft(tokens, torch.stack(probs) if probs else None)

    def _context_rows(self, state: _SeqState) -> torch.Tensor | None:
        """The layer's output for the rows not yet computed (their keys and values join the sequence's cache); None
        where the newest row has no feature. A row whose logits a grammar masked gives none (its columns are not
        finite): the context starts again after it."""
        pending, state.pending = state.pending, []
        features = self.recovery.from_columns(torch.stack([c for _, c, _ in pending]).float())
        finite = torch.isfinite(features).all(-1)
        if not bool(finite.all()):
            after = int(finite.logical_not().nonzero().max()) + 1
            pending, features = pending[after:], features[after:]
            state.keys = state.values = None
            if not pending:
                return None
        positions = torch.tensor([p for p, _, _ in pending])
        x = self.head.rows(self.target_rows(torch.tensor([[t for _, _, t in pending]])), features[None])
        prior = 0 if state.keys is None else state.keys.shape[1]
        n = len(pending)
        mask = torch.cat([torch.ones(n, prior, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
        out, keys, values = self.head.layer(x, positions, state.keys, state.values, mask)
        state.keys = keys if state.keys is None else torch.cat([state.keys, keys], dim=1)[:, -self.window :]
        state.values = values if state.values is None else torch.cat([state.values, values], dim=1)[:, -self.window :]
        return out

    def _choose(self, seq: Sequence, drafted: list[int], logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft token (a target id) and, for a sampled request, q over the target's vocabulary."""
        vocab = self.head.draft_vocab
        if seq.params.greedy:
            return int(vocab[int(logits.argmax())]), None
        row = seq.sampling_row(drafted)
        full = torch.full((1, self.sampler.vocab_size), float("-inf"))
        full[0, vocab] = logits.float()
        q = self.sampler.probs(self.sampler.process_logits(full, [row]), [row])
        return self.sampler.draw_rows(q, [row])[0], q[0]
