"""The draft head's training data: the target's own generations, with its feature at every generated position.

Prompts are chat requests built from task templates over topics (`prompts`), none of them the benchmarks' own;
the target answers them (greedy and sampled; once every prompt is answered, sampled again while the budget lasts,
each pass with new seeds) through the engine's model runner in batches, and each step's
logits give the feature they were computed from: the LM head is linear, so a few hundred of its rows determine
its input (`FeatureRecovery`, the same recovery the serving proposer runs; relative error about 1e-6 in fp32).

A generation is stored as `features` [T, hidden] (fp16) and `tokens` [T]: row i is the target's feature at the
i-th position from the prompt's last one and the token it chose there.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import torch

from backend.model.runner import ForwardItem, ModelRunner

TOPICS = [
    "the solar system",
    "volcanoes",
    "the Roman Empire",
    "machine learning",
    "coffee",
    "honey bees",
    "chess",
    "climate change",
    "the human heart",
    "electric cars",
    "the printing press",
    "jazz music",
    "sleep",
    "the ocean tides",
    "bread baking",
    "black holes",
    "the immune system",
    "a city garden",
    "the stock market",
    "rainbows",
    "the internet",
    "dinosaurs",
    "friendship",
    "public speaking",
    "recycling",
    "the moon landing",
    "earthquakes",
    "a lighthouse keeper",
    "gardening tomatoes",
    "the Great Wall of China",
    "electricity",
    "learning a language",
    "time management",
    "a dragon",
    "the desert",
    "photosynthesis in algae",
    "chocolate",
    "the first airplane",
    "a lost cat",
    "mountain climbing",
    "the piano",
    "budgeting money",
    "a space station",
    "wind turbines",
    "the Olympic Games",
    "bacteria",
    "a rainy day",
    "ancient Egypt",
    "a small bakery",
    "sorting algorithms",
    "the camera",
    "penguins",
    "a job interview",
    "the water in a river",
    "magnets",
    "a birthday party",
    "the human brain",
    "volunteering",
    "a haunted house",
    "recursion in programming",
]
TEMPLATES = [
    "Write a short story about {t}.",
    "Explain {t} to a ten year old.",
    "List five interesting facts about {t}.",
    "What are the main ideas behind {t}?",
    "Write a poem about {t}.",
    "Give me three tips related to {t}.",
    "Describe {t} in a few paragraphs.",
    "Why is {t} important?",
    "Write a short essay on {t}.",
    "What would you tell a friend who wants to learn about {t}?",
    "Write a dialogue between two people about {t}.",
    "Summarize what people should know about {t}.",
    # answers of other shapes than prose (code, JSON, tables, short forms), so the draft vocabulary and the head
    # see the punctuation and structure served output has
    "Write a Python function that has something to do with {t}, with a docstring and an example call.",
    "Reply with only a JSON object describing {t}, with the keys name, category and facts (a list of three).",
    "Give a JSON list of five keywords about {t}, and nothing else.",
    "Make a markdown table with two columns comparing two aspects of {t}.",
    "Write a numbered step-by-step guide about {t}.",
    "Write one sentence about {t}, then the same sentence in the passive voice.",
    "Write a haiku about {t}.",
    "Ask three questions about {t} and answer each one.",
    "Write a short email to a colleague about {t}.",
    "Explain {t} in exactly three bullet points.",
    "Write a short product description for something inspired by {t}.",
    "Write a YAML configuration file for an app about {t}.",
]
Prompt = str | list[dict]  # a user turn, or chat messages as an OpenAI request holds them


def prompts(seed: int, path: str | None = None) -> list[Prompt]:
    """Every template over every topic, shuffled by `seed`; or the prompts of the file `path` (one JSON value a
    line: a string, {"prompt": str} or {"messages": [...]}), in its order: a deployment's own requests."""
    if path:
        return read_prompts(path)
    cases: list[Prompt] = [template.format(t=topic) for topic in TOPICS for template in TEMPLATES]
    random.Random(seed).shuffle(cases)
    return cases


def read_prompts(path: str) -> list[Prompt]:
    cases: list[Prompt] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from None
            if isinstance(value, dict):
                value = value.get("messages") or value.get("prompt")
            ok = isinstance(value, str) or (
                isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value)
            )
            if not ok or not value:
                raise ValueError(
                    f'{path}:{number}: expected a string, {{"prompt": str}} or {{"messages": [{{"role": ..., '
                    f'"content": ...}}, ...]}}'
                )
            cases.append(value)
    if not cases:
        raise ValueError(f"{path}: no prompts")
    return cases


class FeatureRecovery:
    """The LM head's input from its output: logits = W f, so f = pinv(W_S) logits_S for a well-conditioned set S of
    the head's rows (`rows`; random rows of a 49k x 576 embedding: condition about 150)."""

    def __init__(self, head_rows: torch.Tensor, rows: torch.Tensor):
        self.rows = rows
        self.inverse = torch.linalg.pinv(head_rows.double()).float().T.contiguous()  # [|S|, hidden]

    @staticmethod
    def pick_rows(vocab: int, hidden: int, seed: int) -> torch.Tensor:
        count = min(vocab, max(2 * hidden, 1024))
        return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:count].sort().values

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.from_columns(logits[:, self.rows])

    def from_columns(self, columns: torch.Tensor) -> torch.Tensor:
        """The features of rows of logits already cut to the recovery's columns ([n, |S|])."""
        return columns @ self.inverse


def generate(
    runner: ModelRunner,
    recovery: FeatureRecovery,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    eos: set[int],
    seed: int,
    deadline: float = float("inf"),
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """One batch of generations (the runner's KV cache holds len(prompt_ids) sequences of its blocks each), cut
    short at `deadline` (time.perf_counter): (the prompt's place in `prompt_ids`, features, tokens) for each of
    more than one token."""
    per_seq = runner.num_blocks // len(prompt_ids)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompt_ids))]
    generator = torch.Generator().manual_seed(seed)
    limit = per_seq * runner.block_size
    items = [ForwardItem(ids, 0, table, 1) for ids, table in zip(prompt_ids, tables)]
    lengths = [len(ids) for ids in prompt_ids]
    feats: list[list[torch.Tensor]] = [[] for _ in prompt_ids]
    toks: list[list[int]] = [[] for _ in prompt_ids]
    active = list(range(len(prompt_ids)))
    while active and time.perf_counter() < deadline:
        logits = runner.forward(items)
        features = recovery(logits).half()
        if temperature > 0:
            chosen = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        else:
            chosen = logits.argmax(-1)
        still, items = [], []
        for row, i in enumerate(active):
            token = int(chosen[row])
            feats[i].append(features[row])
            toks[i].append(token)
            if token in eos or len(toks[i]) >= max_new_tokens or lengths[i] + 1 >= limit:
                continue
            items.append(ForwardItem([token], lengths[i], tables[i], 1))
            lengths[i] += 1
            still.append(i)
        active = still
    return [(i, torch.stack(f), torch.tensor(t)) for i, (f, t) in enumerate(zip(feats, toks)) if len(t) > 1]


@dataclass(frozen=True)
class Origin:
    """What a generation answered: the prompt's index in the prompt list, and whether it was greedy."""

    prompt: int
    greedy: bool


def build(
    model: str,
    quantization: str,
    tokenizer,
    recovery_seed: int,
    minutes: float,
    seed: int,
    batch: int = 16,
    max_new_tokens: int = 192,
    log=print,
    prompts_file: str | None = None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[Origin], FeatureRecovery]:
    """Generations for `minutes` of the built-in prompts or those of `prompts_file` (in batches: in the first pass
    every third batch greedy and the others sampled at 0.8, in later passes all sampled, with new seeds), what
    each answered, and the recovery they were read with."""
    blocks_per_seq = 32  # 512 tokens: prompt + max_new_tokens
    runner = ModelRunner(model, "float32", 16, batch * blocks_per_seq, quantization=quantization)
    rows = target_head_rows(runner)
    recovery_rows = FeatureRecovery.pick_rows(rows.shape[0], rows.shape[1], recovery_seed)
    recovery = FeatureRecovery(rows[recovery_rows], recovery_rows)
    eos = stop_ids(model, tokenizer)
    longest = blocks_per_seq * 16 - 16  # room for 16 tokens of answer at least
    all_ids = [chat_ids(tokenizer, c) for c in prompts(seed, prompts_file)]
    cases = [ids for ids in all_ids if len(ids) <= longest]
    if len(cases) < len(all_ids):
        log(f"data: {len(all_ids) - len(cases)} prompts longer than {longest} tokens left out")
    if not cases:
        raise ValueError(f"no prompt of at most {longest} tokens to generate from")
    data, origins, started, tokens = [], [], time.perf_counter(), 0
    batches = [list(range(first, min(first + batch, len(cases)))) for first in range(0, len(cases), batch)]
    number = 0
    while time.perf_counter() - started <= minutes * 60:
        picks = batches[number % len(batches)]
        temperature = 0.0 if number < len(batches) and number % 3 == 0 else 0.8  # repeated passes sample
        deadline = started + minutes * 60
        answers = generate(
            runner, recovery, [cases[i] for i in picks], max_new_tokens, temperature, eos, seed + number, deadline
        )
        data += [(f, t) for _, f, t in answers]
        origins += [Origin(picks[i], temperature == 0.0) for i, _, _ in answers]
        number += 1
        tokens = sum(len(t) for _, t in data)
        elapsed = time.perf_counter() - started
        log(f"data: {len(data)} generations, {tokens} tokens, {tokens / elapsed:.0f} tok/s")
    return data, origins, recovery


def stop_ids(model: str, tokenizer) -> set[int]:
    """The ids a generation stops at: the generation config's EOS and the tokenizer's."""
    from transformers import GenerationConfig

    try:
        ids = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:
        ids = None
    ids = ids if isinstance(ids, list) else [ids]
    return {i for i in [*ids, tokenizer.eos_token_id] if isinstance(i, int)}


def chat_ids(tokenizer, prompt: Prompt) -> list[int]:
    """`prompt` as a user's chat turn, or its messages, ready for the assistant's answer (the turns' text one per
    line for a tokenizer without a chat template)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not tokenizer.chat_template:
        return tokenizer.encode("".join(f"{m['content']}\n" for m in messages), add_special_tokens=False)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def target_head_rows(runner: ModelRunner) -> torch.Tensor:
    """The target's tied LM head (its embedding) as fp32 rows [vocab, hidden]."""
    embed = runner.fused.embed if runner.fused is not None else None
    if embed is None:
        raise ValueError("the draft head needs the fused (Llama-family) forward of the target")
    return embed(torch.arange(embed.vocab_size))
