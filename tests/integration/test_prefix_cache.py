"""Prefix caching and parallel sampling through the real server.

The seed's workload (paged_attention_cow_prefix_caching): a long markdown table as the system prompt and
two different questions, greedy. The second question's prefill reuses the table's cached blocks. A request's
cached prompt tokens, as every route reports them (OpenAI's, Anthropic's usage, the model's `num_cached_tokens`),
are what the engine's prefix-hit counter (in tokens) added for it.
"""

import json
import urllib.request
import uuid

import anthropic
import openai
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


def _counted(server, call):
    """call()'s answer and the prompt tokens llm_prefix_cache_hits_total added while it ran."""
    before = server.settled_metrics("llm").get("llm_prefix_cache_hits_total", "llm")
    answer = call()
    return answer, server.settled_metrics("llm").get("llm_prefix_cache_hits_total", "llm") - before


def _generate(server, prompt: str) -> dict:
    body = {"text_input": prompt, "max_tokens": 2, "temperature": 0, "return_num_cached_tokens": True}
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/llm/generate",
        data=json.dumps({**body, "return_num_input_tokens": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())


def test_every_route_reports_the_prompt_tokens_the_cache_served(server):
    """The same long prompt again: its whole prompt but the block of its last token comes from the cache, and
    each route's cached count is the engine's prefix-hit count for that request (the first one's: 0)."""
    system = f"Session {uuid.uuid4().hex}. {SYSTEM}"  # nothing any other request has cached
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the age of Mia Green?"}]
    chat = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)
    kw = dict(model="llm", messages=messages, temperature=0, max_tokens=2)
    server.wait_idle("llm")
    first, hits = _counted(server, lambda: chat.chat.completions.create(**kw))
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 500 and (first.usage.prompt_tokens_details.cached_tokens, hits) == (0, 0)
    expected = (prompt_tokens - 1) // 16 * 16  # block_size 16; at least one token is computed

    second, hits = _counted(server, lambda: chat.chat.completions.create(**kw))
    assert (second.usage.prompt_tokens_details.cached_tokens, hits) == (expected, expected)
    chunks, hits = _counted(
        server, lambda: list(chat.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    )
    assert (chunks[-1].usage.prompt_tokens_details.cached_tokens, hits) == (expected, expected)

    response, hits = _counted(
        server,
        lambda: chat.responses.create(
            model="llm", instructions=system, input=messages[1]["content"], temperature=0, max_output_tokens=2
        ),
    )
    assert response.usage.input_tokens == prompt_tokens
    assert (response.usage.input_tokens_details.cached_tokens, hits) == (expected, expected)

    messages_api = anthropic.Anthropic(base_url=server.openai_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    message, hits = _counted(
        server,
        lambda: messages_api.messages.create(
            model="llm", system=system, messages=messages[1:], max_tokens=2, extra_body={"temperature": 0}
        ),
    )
    usage = message.usage
    assert (usage.cache_read_input_tokens, hits) == (expected, expected)
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_tokens  # Anthropic's split of the prompt

    completion, hits = _counted(
        server, lambda: chat.completions.create(model="llm", prompt=system, temperature=0, max_tokens=2)
    )
    assert completion.usage.prompt_tokens_details.cached_tokens == hits == 0  # no chat template: other tokens
    answer, hits = _counted(server, lambda: _generate(server, system))  # the model's own output, asked for
    assert answer["num_cached_tokens"] == hits == (answer["num_input_tokens"] - 1) // 16 * 16
