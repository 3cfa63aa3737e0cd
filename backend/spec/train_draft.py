"""Train an EAGLE-style draft head (`eagle_head.py`) for a served model, on this machine's CPU, from the target's own
generations (`draft_data.py`); the folder it writes is what the `draft_model` parameter names.

    python -m backend.spec.train_draft [--model DIR] [--out DIR] [--minutes 60] [--seed 0] [--prompts FILE]
                                                                                    (make draft)

The budget runs from `--started` (a Unix time: `make draft` passes when it was typed, so setting up the environment
counts) to the saved folder, and is split between generating (`--data-share` of it) and training; progress lines
show the data rate,
then per interval the training rate (rows/s), the loss and the held-out acceptance: the fraction of held-out
positions where the head's first token is the target's greedy one, and the mean accepted length of a chain of
`--eval-k` draft tokens (what greedy verification would accept), measured on greedy generations of prompts
training never saw.
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.model.hardware import native_bf16
from backend.spec import draft_data, eagle_head
from backend.spec.eagle_head import EagleHead, HeadShape

DEFAULT_MODEL = "models/smollm2-135m-instruct"
DEFAULT_OUT = ".cache/draft/eagle-smollm2-135m"
REGRESSION_WEIGHT = 0.2  # EAGLE's feature regression beside the token loss (features are ~1.7 per dimension)
STEP_DECAY = 0.8  # chain step s's loss weighs 0.8 ** (s - 1)


def draft_vocabulary(data, vocab: int, size: int, always: set[int]) -> torch.Tensor:
    """The `size` tokens the generations use most (ties and unseen tokens by id), with `always` (EOS) in."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for _, tokens in data:
        counts += torch.bincount(tokens, minlength=vocab)
    counts[list(always)] = counts.max() + 1
    order = sorted(range(vocab), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(order[:size]))


class Chunks:
    """[B, L + 1] windows of the generations: row i's feature and token, the next row's as the targets."""

    def __init__(self, data, length: int, rows: torch.Tensor, seed: int):
        self.data = [(f, t) for f, t in data if len(t) > length]
        self.length, self.rows = length, rows
        self.random = random.Random(seed)
        if not self.data:
            raise ValueError(f"no generation is longer than {length} tokens: generate more")

    def batch(self, size: int):
        picks = []
        for _ in range(size):
            features, tokens = self.random.choice(self.data)
            start = self.random.randrange(0, len(tokens) - self.length)
            picks.append((features[start : start + self.length + 1], tokens[start : start + self.length + 1]))
        return self.stack(picks)

    def all(self):
        """Every non-overlapping window, in order (the held-out set)."""
        picks = [
            (f[s : s + self.length + 1], t[s : s + self.length + 1])
            for f, t in self.data
            for s in range(0, len(t) - self.length, self.length)
        ]
        return self.stack(picks)

    def stack(self, picks):
        features = torch.stack([f for f, _ in picks]).float()
        tokens = torch.stack([t for _, t in picks])
        return self.rows[tokens[:, :-1]], features, tokens


def losses(head: EagleHead, embeds, features, depth: int, vocab_index: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Soft cross-entropy against the target's distribution over the draft vocabulary, plus feature regression,
    for each unrolled chain step (rows with no anchor left out)."""
    steps = head.unroll(embeds, features[:, :-1], depth)
    target_feat = features[:, 1:]
    target = torch.softmax(target_feat @ head.head.T, dim=-1)
    total, parts = 0.0, {}
    for s, (guessed, logits) in enumerate(steps):
        g, lg, t, p = guessed[:, s:], logits[:, s:], target_feat[:, s:], target[:, s:]
        token = -(p * torch.log_softmax(lg, dim=-1)).sum(-1).mean()
        reg = F.smooth_l1_loss(g, t)
        total = total + STEP_DECAY**s * (token + REGRESSION_WEIGHT * reg)
        parts[f"ce{s + 1}"] = float(token.detach())
    return total, parts


@torch.no_grad()
def acceptance(head: EagleHead, heldout, k: int) -> tuple[list[float], float]:
    """(first-token agreement per chain step, mean accepted length of k-token chains) on held-out windows
    (embeds, features, the target's greedy token after each row: `greedy_targets`)."""
    embeds, features, greedy = heldout
    steps = head.unroll(embeds, features[:, :-1], k)
    length = embeds.shape[1]
    hits = [head.draft_vocab[logits.argmax(-1)] == greedy for _, logits in steps]  # [B, L] per step
    per_step = [float(h[:, s:].float().mean()) for s, h in enumerate(hits)]
    anchors = length - k + 1
    run = torch.ones(embeds.shape[0], anchors, dtype=torch.bool)
    accepted = torch.zeros(embeds.shape[0], anchors)
    for s, h in enumerate(hits):  # anchor a's step s + 1 is row a + s
        run &= h[:, s : s + anchors]
        accepted += run.float()
    return per_step, float(accepted.mean())


def split_heldout(data, origins: list[draft_data.Origin], every: int):
    """The greedy answers to every `every`-th prompt answered greedily, held out, and every answer to the other
    prompts (no sampled answer to a held-out prompt trains the head)."""
    greedy_prompts = sorted({o.prompt for o in origins if o.greedy})
    held_prompts = set(greedy_prompts[:: max(1, every)])
    heldout = [d for d, o in zip(data, origins) if o.prompt in held_prompts and o.greedy]
    training = [d for d, o in zip(data, origins) if o.prompt not in held_prompts]
    return heldout, training or heldout


def greedy_targets(heldout, full_rows: torch.Tensor):
    """Held-out windows with, after each row, the target's greedy token: its full LM head's argmax over the next
    row's feature (computed once: a [rows, vocab] product)."""
    embeds, features, _ = heldout
    greedy = torch.cat([(f[1:] @ full_rows.T).argmax(-1)[None] for f in features])
    return embeds, features, greedy


def train(args, log=print) -> Path:
    from transformers import AutoConfig, AutoTokenizer

    spent = time.time() - args.started if args.started else 0.0
    if spent >= args.minutes * 60:
        raise SystemExit(
            f"the budget of {args.minutes:g} minutes was spent before training began ({spent / 60:.1f} minutes since "
            "--started, setting up included): give more minutes (DRAFT_MINUTES)"
        )
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(args.model)
    if not getattr(config, "tie_word_embeddings", False):
        raise SystemExit("the draft head reads the target's LM head rows from its embedding: a tied model is needed")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    started = time.perf_counter() - spent
    if args.data and Path(args.data).is_file():
        saved = torch.load(args.data)
        if "origins" not in saved:
            raise SystemExit(f"{args.data}: generations without the prompts they answer; remove it to generate anew")
        data, origins, recovery_rows = saved["data"], saved["origins"], saved["recovery_rows"]
        log(f"data: {len(data)} generations, {sum(len(t) for _, t in data)} tokens from {args.data}")
    else:
        data, origins, recovery = draft_data.build(
            args.model,
            args.quantization,
            tokenizer,
            args.seed,
            (args.minutes - (time.perf_counter() - started) / 60) * args.data_share,
            args.seed,
            log=log,
            prompts_file=args.prompts or None,
        )
        recovery_rows = recovery.rows
        if args.data:
            Path(args.data).parent.mkdir(parents=True, exist_ok=True)
            torch.save({"data": data, "origins": origins, "recovery_rows": recovery_rows}, args.data)
    state = _target_state(args.model)
    full_rows = state["model.embed_tokens.weight"].float()
    heldout, training = split_heldout(data, origins, args.heldout_every)
    vocab = draft_vocabulary(training, config.vocab_size, args.vocab, draft_data.stop_ids(args.model, tokenizer))
    shape = HeadShape.of_target(config, window=args.window)
    head = EagleHead(shape, vocab, full_rows[vocab])
    head.init_from_target(state, config.num_hidden_layers - 1, _residual_rms(args.model, tokenizer))
    chunks = Chunks(training, args.window, full_rows, args.seed)
    held = Chunks(heldout, args.window, full_rows, args.seed).all() if heldout else chunks.all()
    held = greedy_targets(tuple(x[: args.heldout_windows] for x in held), full_rows)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    bf16, why = native_bf16("cpu") if args.autocast == "auto" else (args.autocast == "bfloat16", "--autocast")
    log(f"train: {'bfloat16 autocast' if bf16 else 'float32'} products ({why}); fp32 weights and optimizer state")
    budget = args.minutes * 60 - (time.perf_counter() - started)
    train_started, steps, rows, last_log = time.perf_counter(), 0, 0, 0.0
    per_step, mean_len = acceptance(head, held, args.eval_k)
    budget -= 2 * (time.perf_counter() - train_started)  # the final held-out measure and the save fit the budget
    log(f"train: held-out before training: step-1 agreement {per_step[0]:.3f}, accepted length {mean_len:.2f}")
    while True:
        elapsed = time.perf_counter() - train_started
        if (steps and elapsed > budget) or (args.max_steps and steps >= args.max_steps):  # one step at least
            break
        progress = min(1.0, elapsed / max(budget, 1e-9))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (steps + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        embeds, features, _ = chunks.batch(args.batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, parts = losses(head, embeds, features, args.depth, vocab)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        steps, rows = steps + 1, rows + embeds.shape[0] * embeds.shape[1]
        if time.perf_counter() - last_log > args.log_seconds:
            last_log = time.perf_counter()
            per_step, mean_len = acceptance(head, held, args.eval_k)
            rate = rows / (time.perf_counter() - train_started)
            ce = " ".join(f"{k} {v:.3f}" for k, v in parts.items())
            log(
                f"train: step {steps}, {rate:.0f} rows/s, loss {float(loss.detach()):.3f} ({ce}); held-out "
                f"agreement by step {' '.join(f'{a:.3f}' for a in per_step)}, accepted length "
                f"(k={args.eval_k}) {mean_len:.2f}"
            )
    per_step, mean_len = acceptance(head, held, args.eval_k)
    out = Path(args.out)
    meta = {
        "target": str(args.model),
        "trained_with": {
            "command": command(args),
            "seed": args.seed,
            "minutes": args.minutes,
            "generations": len(data),
            "tokens": sum(len(t) for _, t in data),
            "steps": steps,
            "heldout_agreement_by_step": [round(a, 4) for a in per_step],
            f"heldout_accepted_length_k{args.eval_k}": round(mean_len, 3),
        },
    }
    eagle_head.save(out, head, recovery_rows, meta)
    log(f"saved {out}: held-out agreement by step {per_step}, accepted length {mean_len:.2f}")
    return out


def command(args) -> str:
    """The command line that repeats this run: every option with the value it had (defaults too), but the clock's."""
    chosen = {name: value for name, value in vars(args).items() if name != "started"}
    options = [part for name, value in chosen.items() for part in (f"--{name.replace('_', '-')}", str(value))]
    return shlex.join(["python", "-m", "backend.spec.train_draft", *options])


@torch.no_grad()
def _residual_rms(model: str, tokenizer) -> float:
    """The root mean square of the residual stream entering the target's last layer, over a short text."""
    from backend.model import model_source

    target = model_source.load_model(model_source.resolve(model), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(" ".join(draft_data.TOPICS[:20]))])
    states = target(ids, output_hidden_states=True).hidden_states[-2][0, 1:]
    return float(states.pow(2).mean(-1).sqrt().mean())


def _target_state(model: str) -> dict[str, torch.Tensor]:
    from backend.model import model_source

    folder = model_source.resolve(model)
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{folder}: the draft's initialisation reads the target's safetensors (make model)")
    from safetensors.torch import load_file

    state = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--minutes", type=float, default=60.0, help="the whole budget: generating and training")
    p.add_argument(
        "--started", type=float, default=0.0, help="Unix time the budget runs from (default: when this starts)"
    )
    p.add_argument("--data-share", type=float, default=0.5, help="share of the budget spent generating")
    p.add_argument("--data", default="", help="a file to keep the generations in (reused when it exists)")
    p.add_argument(
        "--prompts",
        default="",
        help='JSON lines of prompts to answer instead of the built-in ones (a string, {"prompt": ...} or '
        '{"messages": [...]} a line): a deployment\'s own requests',
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default="gguf", help="how the target runs while generating")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--autocast",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="training products' dtype: auto is bfloat16 where the CPU computes it natively (AMX, AVX512_BF16)",
    )
    p.add_argument("--vocab", type=int, default=8192, help="draft vocabulary size")
    p.add_argument("--window", type=int, default=32, help="rows per training window (the head's context)")
    p.add_argument("--depth", type=int, default=3, help="chain steps unrolled in training")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument(
        "--heldout-every",
        type=int,
        default=4,
        help="the greedy answer to every n-th greedily answered prompt is held out (the prompt trains nothing)",
    )
    p.add_argument("--heldout-windows", type=int, default=64)
    p.add_argument("--log-seconds", type=float, default=60.0)
    return p


def main(argv: list[str] | None = None) -> None:
    train(parser().parse_args(argv), log=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
