"""Prefix caching and parallel sampling through the real server.

The seed's workload (paged_attention_cow_prefix_caching): a long markdown table as the system prompt and
two different questions, greedy. The second question's prefill reuses the table's cached blocks.
"""

import pytest

from client import stream_grpc
from testkit.fidelity import first_mismatch
from tests.integration.llm_testlib import Watch

pytestmark = pytest.mark.integration

NAMES = [
    "John Doe",
    "Jane Smith",
    "Alice Johnson",
    "Bob Brown",
    "Carol White",
    "Dave Green",
    "Emma Black",
    "Frank Blue",
    "Grace Yellow",
    "Henry Violet",
    "Irene Orange",
    "Jack Indigo",
    "Karen Red",
    "Leo Brown",
    "Mia Green",
    "Noah Yellow",
    "Olivia Blue",
    "Peter Black",
    "Quinn White",
    "Rachel Red",
    "Steve Green",
    "Tina Blue",
    "Umar Black",
    "Victor Yellow",
    "Wendy Orange",
    "Xavier Green",
    "Yara Red",
    "Zack Blue",
]
JOBS = ["Engineer", "Doctor", "Teacher", "Artist", "Scientist", "Lawyer", "Musician", "Chef"]
COUNTRIES = ["USA", "Canada", "UK", "Australia", "New Zealand", "Ireland"]
TABLE = "| ID | Name | Age | Occupation | Country |\n|----|------|-----|------------|---------|\n" + "".join(
    f"| {i + 1} | {name} | {25 + (i * 7) % 26} | {JOBS[i % len(JOBS)]} | {COUNTRIES[i % len(COUNTRIES)]} |\n"
    for i, name in enumerate(NAMES)
)
SYSTEM = (
    "You are a helpful assistant that recognizes the content of tables in markdown format. "
    "Here is a table as follows.\n# Table\n" + TABLE
)


def _chat_prompt(tokenizer, question: str) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _ask(server, model, prompt, max_tokens=24):
    return stream_grpc(prompt, server.grpc_url, model, max_tokens=max_tokens, temperature=0.0).completion()


def test_second_question_reuses_the_cached_table(server, reference):
    tokenizer = reference.tokenizer
    first = _chat_prompt(tokenizer, "What is the age of John Doe?")
    second = _chat_prompt(tokenizer, "What is the age of Zack Blue?")
    assert len(reference.prompt_ids(second)) > 500, "the table prompt should be long"

    cold = _ask(server, "llm_no_prefix_cache", second)  # the same engine settings without a prefix cache
    server.wait_idle("llm")
    before = server.metrics()
    _ask(server, "llm", first)  # fills the cache with the table's blocks
    warm = _ask(server, "llm", second)
    after = server.settled_metrics("llm")

    ref = reference.get(second, 24)
    assert cold.token_ids == ref.token_ids, first_mismatch(cold.token_ids, ref.token_ids)
    assert warm.token_ids == ref.token_ids, first_mismatch(warm.token_ids, ref.token_ids)
    hits = after.get("llm_prefix_cache_hits_total", "llm") - before.get("llm_prefix_cache_hits_total", "llm")
    assert hits >= 0.8 * len(reference.prompt_ids(second)), f"only {hits} prompt tokens came from the cache"
    assert warm.ttft_s * 5 <= cold.ttft_s, f"TTFT warm {warm.ttft_s:.3f}s vs cold {cold.ttft_s:.3f}s: < 5x"


def test_n_samples_share_the_prompt_blocks(server, reference):
    """n = 4 with a seed: four different samples, reproducible; the prompt's blocks are held once."""
    model = "llm"
    prompt = SYSTEM[:1400] + "\nWrite one sentence about one person in the table:"
    prompt_blocks = len(reference.prompt_ids(prompt)) // 16
    server.wait_idle(model)
    watch = Watch(server.grpc_url, model)  # every step's record: the KV blocks used after it, exactly
    try:
        assert watch.next()["type"] == "config"  # the engine summary comes first
        params = dict(max_tokens=40, temperature=1.0, seed=99, n=4, ignore_eos=True)
        first = stream_grpc(prompt, server.grpc_url, model, **params).completion()
        steps = watch.steps_until_finished(4)
    finally:
        watch.close()
    second = stream_grpc(prompt, server.grpc_url, model, **params).completion()
    samples = {i: s.token_ids for i, s in first.samples.items()}
    assert sorted(samples) == [0, 1, 2, 3]
    assert len({tuple(t) for t in samples.values()}) == 4, "the four samples should differ"
    assert {i: s.token_ids for i, s in second.samples.items()} == samples, "a seeded n=4 request must reproduce"
    together = [step["kv_blocks_used"] for step in steps if step["running"] == 4]
    assert together, "the four samples never ran together"
    peak = max(together)
    # Shared: the prompt's full blocks once + a few blocks per sample; unshared would be 4x the prompt.
    assert peak <= prompt_blocks + 4 * 5, f"{peak} blocks used for {prompt_blocks} prompt blocks"
    assert peak < 2 * prompt_blocks
