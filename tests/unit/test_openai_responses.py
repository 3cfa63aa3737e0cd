"""frontend/openai_responses.py: the model's deltas in OpenAI's chat and completion shapes (choices, stream
chunks, usage, logprobs), with a stand-in tokenizer."""

from __future__ import annotations

from frontend.generation import Generation
from frontend.openai_responses import ChatFormat, Choice, CompletionFormat, Usage
from frontend.triton_stream import SampleDelta


class Tokenizer:
    """Token i is the text "<i>"; text encodes to one token per character code."""

    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(map(self.token_text, token_ids))


def generation(**kw) -> Generation:
    values = dict(
        model="llm", prompts=["P"], sampling={}, n=1, stream=False, include_usage=False, echo=False, logprobs=None
    )
    values.update(kw)
    return Generation(**values)


def delta(index=0, text="a", ids=(5,), reason=None, n_in=3, n_out=1, logprobs=None, cached=0) -> SampleDelta:
    return SampleDelta(index, text, list(ids), n_in, n_out, reason, logprobs, num_cached_tokens=cached)


LOGPROBS = [
    {"token_id": 5, "logprob": -0.1, "top_logprobs": {"5": -0.1, "9": -2.5}},
    {"token_id": 9, "logprob": -1.0, "top_logprobs": {"7": -0.5, "9": -1.0}},
]


def test_usage_counts_each_prompt_once_and_every_choice():
    usage = Usage()
    usage.add(0, 0, delta(n_in=3, n_out=1))
    usage.add(0, 1, delta(index=1, n_in=3, n_out=2))
    usage.add(0, 0, delta(n_in=3, n_out=4))  # later deltas carry the running count
    usage.add(1, 2, delta(n_in=5, n_out=1, cached=4))
    assert usage.body() == {
        "prompt_tokens": 8,
        "completion_tokens": 7,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},  # each prompt's cache hits once, whatever n
    }


def test_chat_whole_answer_with_logprobs():
    fmt = ChatFormat(generation(logprobs=2), Tokenizer())
    choice = Choice()
    choice.add(delta(text="<5>", logprobs=LOGPROBS[:1]))
    choice.add(delta(text="<9>", n_out=2, reason="length", logprobs=LOGPROBS[1:]))
    usage = Usage()
    usage.add(0, 0, delta(n_out=2))
    body = fmt.whole({0: choice}, usage)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "llm"
    (c,) = body["choices"]
    assert c["message"] == {"role": "assistant", "content": "<5><9>"} and c["finish_reason"] == "length"
    content = c["logprobs"]["content"]
    assert [t["token"] for t in content] == ["<5>", "<9>"] and content[1]["logprob"] == -1.0
    assert content[1]["top_logprobs"] == [
        {"token": "<7>", "logprob": -0.5, "bytes": list(b"<7>")},
        {"token": "<9>", "logprob": -1.0, "bytes": list(b"<9>")},
    ]
    assert body["usage"]["completion_tokens"] == 2


def test_chat_stream_chunks_role_first_usage_null_until_the_last():
    fmt = ChatFormat(generation(n=2, stream=True, include_usage=True), Tokenizer())
    opening = fmt.chunk(fmt.opening_choices())
    assert [c["delta"] for c in opening["choices"]] == [{"role": "assistant", "content": ""}] * 2
    assert opening["object"] == "chat.completion.chunk" and opening["usage"] is None
    chunk = fmt.chunk([fmt.delta_choice(1, delta(index=1, text="hi", reason="stop"))])
    assert chunk["choices"] == [{"index": 1, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": "stop"}]
    assert fmt.chunk([fmt.delta_choice(0, delta(text=""))])["choices"][0]["delta"] == {}
    usage = Usage()
    usage.add(0, 1, delta(n_out=4))
    last = fmt.usage_chunk(usage)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4 and last["id"] == opening["id"]


def test_completion_echo_with_prompt_logprobs_choice_indices_and_text_offsets():
    fmt = CompletionFormat(generation(prompts=["P0", [11, 12]], n=2, echo=True, logprobs=1), Tokenizer())
    assert fmt.opening_choices() == []  # streamed, the prompt leads each choice's first chunk
    fmt.observe(
        1,
        SampleDelta(0, "", [], 2, 0, None, None, [None, {"token_id": 12, "logprob": -0.7, "top_logprobs": {12: -0.7}}]),
    )
    choice = Choice()
    choice.add(delta(text="<5><9>", logprobs=LOGPROBS, reason="stop"))
    whole = fmt.whole_choice(3, choice)  # prompt 1 (token ids, decoded), sample 1
    assert whole["text"] == "<11><12><5><9>" and whole["finish_reason"] == "stop"
    assert whole["logprobs"] == {
        "tokens": ["<11>", "<12>", "<5>", "<9>"],
        "token_logprobs": [None, -0.7, -0.1, -1.0],
        "top_logprobs": [None, {"<12>": -0.7}, {"<5>": -0.1, "<9>": -2.5}, {"<7>": -0.5, "<9>": -1.0}],
        "text_offset": [0, 4, 8, 11],
    }
    assert CompletionFormat(generation(), Tokenizer()).whole({0: Choice()}, Usage())["object"] == "text_completion"


def test_completion_echo_streamed_leads_each_choice_once():
    fmt = CompletionFormat(generation(prompts=["PQ"], n=2, echo=True, logprobs=0), Tokenizer())
    fmt.observe(0, SampleDelta(0, "", [], 2, 0, None, None, [None, {"token_id": 81, "logprob": -2.0}]))
    first = fmt.delta_choice(1, delta(index=1, text="<5>", logprobs=LOGPROBS[:1]))
    assert first["text"] == "PQ<5>" and first["logprobs"]["token_logprobs"] == [None, -2.0, -0.1]
    assert first["logprobs"]["tokens"] == ["<80>", "<81>", "<5>"]  # "P" = 80, the first token, from encode
    again = fmt.delta_choice(1, delta(index=1, text="<9>", logprobs=LOGPROBS[1:]))
    assert again["text"] == "<9>" and again["logprobs"]["token_logprobs"] == [-1.0]
    plain = CompletionFormat(generation(prompts=["PQ"], echo=True), Tokenizer())
    assert plain.delta_choice(0, delta(text="x"))["text"] == "PQx"


def test_tokens_as_ids():
    fmt = CompletionFormat(generation(logprobs=1, tokens_as_ids=True), Tokenizer())
    assert fmt.delta_choice(0, delta(logprobs=LOGPROBS[:1]))["logprobs"]["tokens"] == ["token_id:5"]
    assert CompletionFormat(generation(), Tokenizer()).delta_choice(0, delta())["logprobs"] is None
