"""The front door for scoring and steering clients, against the real stack: token-id prompts, echo with prompt
logprobs (equal to transformers' log-softmax), logit_bias, /tokenize and /detokenize, max_model_len, the
bounds that keep one caller from starving the others, an API key, and generated hostile bodies."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

import launcher
from launcher.paths import MODEL_DIR
from tests.integration.llm_testlib import post

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf():
    """(tokenizer, fp32 model) of the served weights, the reference for prompt logprobs."""
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(MODEL_DIR), model


def hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def token_ids_of(logprobs) -> list[int]:
    """The ids behind `return_tokens_as_token_ids` token names ("token_id:<id>")."""
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


# ----------------------------------------------------------------------------------------- token prompts


def test_token_id_prompts_answer_as_their_text(client, hf):
    tokenizer, _ = hf
    ids = tokenizer(PROMPT).input_ids
    by_text = client.completions.create(model="llm", prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="llm", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    both = client.completions.create(model="llm", prompt=[ids, ids[:4]], max_tokens=4, temperature=0, echo=True)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text.startswith(PROMPT) and both.choices[1].text.startswith(tokenizer.decode(ids[:4]))


@pytest.mark.parametrize("model", ["llm", "llm_default"])  # dense fp32; the shipped default (GGUF blocks, spec)
def test_echo_prompt_logprobs_equal_transformers(client, hf, model):
    """As lm-evaluation-harness asks: token ids, echo, logprobs 1, max_tokens 0 (and 1, streamed). Sent twice,
    so the second time the prompt's blocks are in the prefix cache: the logprobs are the same."""
    tokenizer, reference_model = hf
    ids = tokenizer(PROMPT * 3).input_ids
    reference = hf_prompt_logprobs(reference_model, ids)
    answers = [
        client.completions.create(
            model=model,
            prompt=[ids],
            echo=True,
            logprobs=1,
            max_tokens=0,
            temperature=0,
            extra_body={"return_tokens_as_token_ids": True},
        )
        for _ in range(2)
    ]
    for answer in answers:
        choice = answer.choices[0]
        assert choice.text == tokenizer.decode(ids) and answer.usage.completion_tokens == 0
        lp = choice.logprobs
        assert token_ids_of(lp) == ids and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        worst = max(abs(got - want) for got, want in zip(lp.token_logprobs[1:], reference))
        assert worst < 1e-4, worst
        assert all(
            len(top) == 1 and max(top.values()) >= got - 1e-6
            for top, got in zip(lp.top_logprobs[1:], lp.token_logprobs[1:])
        )
    streamed = client.completions.create(
        model=model,
        prompt=ids,
        echo=True,
        logprobs=2,
        max_tokens=1,
        temperature=0,
        stream=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    chunks = [c.choices[0] for c in streamed if c.choices]
    first = chunks[0].logprobs
    assert chunks[0].text.startswith(tokenizer.decode(ids))
    assert token_ids_of(first)[: len(ids)] == ids and len(first.tokens) == len(ids) + 1  # prompt, then one token
    assert max(abs(a - b) for a, b in zip(first.token_logprobs[1 : len(ids)], reference)) < 1e-4
    assert all(len(top) == 2 for top in first.top_logprobs[1:])


def test_logit_bias_forces_and_forbids_a_token(client):
    def greedy_ids(**extra) -> list[int]:
        answer = client.completions.create(
            model="llm",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            logprobs=0,
            extra_body={"return_tokens_as_token_ids": True},
            **extra,
        )
        return token_ids_of(answer.choices[0].logprobs)

    plain = greedy_ids()
    forced = 28  # "="
    assert greedy_ids(logit_bias={str(forced): 100}) == [forced] * 6
    banned = greedy_ids(logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    sampled = client.chat.completions.create(
        model="llm_default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0.8,
        seed=5,
        logit_bias={str(forced): 100},
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert [int(t.token.removeprefix("token_id:")) for t in sampled.choices[0].logprobs.content] == [forced] * 5


# ------------------------------------------------------------------------------ tokenizer and model routes


def test_tokenize_detokenize_and_max_model_len(server, hf):
    tokenizer, _ = hf
    status, answer = post(server, "/tokenize", {"model": "llm", "prompt": PROMPT})
    assert status == 200 and answer["tokens"] == tokenizer(PROMPT).input_ids
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 4096
    messages = [{"role": "user", "content": "Hi there"}]
    status, chat = post(server, "/tokenize", {"model": "llm", "messages": messages, "return_token_strs": True})
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert status == 200 and chat["tokens"] == tokenizer(templated, add_special_tokens=False).input_ids
    assert len(chat["token_strs"]) == chat["count"]
    assert post(server, "/detokenize", {"model": "llm", "tokens": answer["tokens"]}) == (200, {"prompt": PROMPT})
    status, error = post(server, "/detokenize", {"model": "llm", "tokens": [1, -4]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, models = post(server, "/v1/models", None, method="GET")
    assert {m["id"]: m["max_model_len"] for m in models["data"]}["llm"] == 4096


# ---------------------------------------------------------------------------------------------- bounds


def test_a_2000_prompt_request_is_refused_while_another_client_is_served(server, client):
    other: dict = {}

    def other_client():
        other["answer"] = client.completions.create(model="llm", prompt=PROMPT, max_tokens=24, temperature=0)

    thread = threading.Thread(target=other_client)
    thread.start()
    started = time.monotonic()
    status, answer = post(server, "/v1/completions", {"model": "llm", "prompt": ["Hi"] * 2000, "max_tokens": 4})
    refused_after = time.monotonic() - started
    thread.join(timeout=120)
    assert status == 400 and answer["error"]["code"] == "too_many_prompts" and "2000" in answer["error"]["message"]
    assert refused_after < 5 and other["answer"].choices[0].finish_reason == "length"
    assert other["answer"].usage.completion_tokens == 24
    server.wait_idle("llm")


def test_a_multi_prompt_request_is_queued_whole_or_not_at_all(server, client):
    """llm_small_queue runs 2 sequences and queues 4: with 2 requests running and 2 waiting, a 3-prompt request
    is a 503 with Retry-After and nothing of it reaches the model; a 1-prompt request from another client
    still fits."""
    model = "llm_small_queue"
    rejected = server.settled_metrics(model).get("llm_requests_rejected_total", model)
    texts: list[str] = []

    def blocker(i: int):
        answer = client.completions.create(
            model=model, prompt=f"Count to one hundred: {i}", max_tokens=48, temperature=0
        )
        texts.append(answer.choices[0].text)

    threads = [threading.Thread(target=blocker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    busy = server.wait_for(
        lambda m: m.get("llm_requests_running", model) == 2 and m.get("llm_requests_waiting", model) == 2, timeout_s=60
    )
    assert (busy.get("llm_requests_running", model), busy.get("llm_requests_waiting", model)) == (2, 2)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=model, prompt=["a", "b", "c"], max_tokens=2)
    assert info.value.status_code == 503 and info.value.response.headers["Retry-After"] == "1"
    assert "already waiting" in info.value.body["message"]
    single = client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
    assert single.choices[0].finish_reason == "length"
    for thread in threads:
        thread.join(timeout=300)
    assert len(texts) == 4 and all(texts)
    assert server.settled_metrics(model).get("llm_requests_rejected_total", model) == rejected  # none was sent
    server.wait_idle(model)


# ------------------------------------------------------------------------------------------------- API key


def test_the_api_key_guards_every_openai_route(server, monkeypatch, tmp_path):
    key = "k-" + "7" * 30
    monkeypatch.setenv("LLM_API_KEY", key)
    port = launcher.free_port()
    log = tmp_path / "frontend.log"
    proc = launcher.start_frontend(server.grpc_url, port, log, models=("llm",), model_dir=MODEL_DIR)
    try:
        launcher.wait_until_frontend_ready(port, proc, 120)
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError) as info:
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        keyed = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        assert keyed.completions.create(model="llm", prompt="Hi", max_tokens=2).choices[0].text
        plain = type("Door", (), {"openai_url": base})  # no Authorization header at all
        status, answer = post(plain, "/v1/completions", {"model": "llm", "prompt": "Hi", "max_tokens": 2})
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        assert post(plain, "/tokenize", {"model": "llm", "prompt": "x"})[0] == 401
        assert post(plain, "/v1/batch/stream", None, method="GET")[0] == 401
        assert post(plain, "/health", None, method="GET")[0] == 200
    finally:
        launcher.stop_server(proc, timeout_s=10)
    assert key not in log.read_text()


# ------------------------------------------------------------------------------------ generated bodies

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.floats(-3, 3, allow_nan=False),
    st.text(max_size=8),
    st.sampled_from(["llm", "nope", "user", "auto", "json_object"]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=12,
)
_FIELDS = [
    "model",
    "prompt",
    "messages",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "echo",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "stream",
    "stream_options",
    "response_format",
    "tools",
    "tool_choice",
    "presence_penalty",
    "min_tokens",
    "stop_token_ids",
    "user",
    "best_of",
    "suffix",
]
_BODIES = st.fixed_dictionaries(
    {"model": st.sampled_from(["llm", "llm", "nope"])},
    optional={
        "prompt": st.one_of(st.text(min_size=1, max_size=20), st.lists(st.integers(-2, 49160), max_size=6), _VALUES),
        "messages": st.one_of(st.just([{"role": "user", "content": "Hi"}]), _VALUES),
        **{name: _VALUES for name in _FIELDS if name not in ("model", "prompt", "messages")},
    },
).flatmap(
    lambda body: st.fixed_dictionaries(
        {  # always a small max_tokens (or a bad one): no long generations
            **{k: st.just(v) for k, v in body.items()},
            "max_tokens": st.one_of(st.integers(-1, 3), st.booleans(), st.text(max_size=3), st.floats(0, 3)),
        }
    )
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_BODIES, route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_generated_bodies_get_200_or_a_4xx_never_a_500(server, body, route):
    if isinstance(body.get("n"), int) and body["n"] > 1:
        body["n"] = 2  # keep the work small; n's bounds are tested elsewhere
    status, answer = post(server, route, body)
    assert status == 200 or 400 <= status < 500, (status, answer, body)
    if status != 200:
        assert answer["error"]["message"], answer


def test_after_the_generated_bodies_the_server_answers_and_holds_no_blocks(server, client):
    assert client.completions.create(model="llm", prompt="Hi", max_tokens=2).choices[0].text is not None
    server.wait_idle("llm")
    assert server.metrics().get("llm_kv_cache_blocks_used", "llm") == 0
