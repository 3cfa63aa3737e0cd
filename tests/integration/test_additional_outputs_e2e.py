"""The additional outputs keep Triton's vLLM backend's contract (its docs/additional_outputs.md; our
docs/interface.md): each of `finish_reason`, `cumulative_logprob`, `logprobs`, `num_input_tokens` and
`num_output_tokens` is sent when, and only when, its `return_*` input is true, on every response of the
request; `finish_reason` is "None" until the sample finishes; `num_output_tokens` counts the response's own
tokens; `logprobs` is per response a JSON list with one `{"<token id>": {"logprob", "rank",
"decoded_token"}}` per new token (the sampled token and the top `logprobs`), or `null` without `logprobs`.

Every combination of stream, the five flags and `logprobs` in {absent, 0, 2} runs as one concurrent batch
over one gRPC stream (the module's fixture); each case is then checked on its own.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

from client import stream_http
from launcher.paths import MODEL_DIR

pytestmark = pytest.mark.integration

FLAGS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")
ALWAYS = {"text_output", "output_ids", "sample_index"}
MAX_TOKENS = 3
PROMPTS = [
    "Once upon a time",
    "My favourite food is",
    "The weather today",
    "In the middle of the night",
    "She opened the door and",
    "A good friend is someone who",
    "The best way to learn",
    "On the table",
]


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    stream: bool
    flags: frozenset
    logprobs: int | None
    model: str = "llm"
    n: int = 1
    max_tokens: int = MAX_TOKENS
    sampled: bool = False  # seeded sampling at temperature 0.8, else greedy
    exclude_input: bool = True
    send_false_flags: bool = False  # the flags not asked for go as false tensors rather than not at all

    def inputs(self):
        import tritonclient.grpc as grpcclient

        sampling = {
            "max_tokens": self.max_tokens,
            "n": self.n,
            **({"temperature": 0.8, "seed": 11} if self.sampled else {"temperature": 0}),
        }
        if self.logprobs is not None:
            sampling["logprobs"] = self.logprobs
        values = {
            "text_input": self.prompt.encode(),
            "sampling_parameters": json.dumps(sampling).encode(),
            "stream": self.stream,
            "exclude_input_in_output": self.exclude_input,
        }
        values.update({f"return_{f}": f in self.flags for f in FLAGS if f in self.flags or self.send_false_flags})
        tensors = []
        for name, value in values.items():
            tensor = grpcclient.InferInput(name, [1], "BOOL" if isinstance(value, bool) else "BYTES")
            tensor.set_data_from_numpy(np.array([value], dtype=bool if isinstance(value, bool) else object))
            tensors.append(tensor)
        return tensors


def _grid() -> list[Case]:
    cases = []
    combos = itertools.product((False, True), itertools.product((False, True), repeat=len(FLAGS)), (None, 0, 2))
    for i, (stream, on, logprobs) in enumerate(combos):
        flags = frozenset(f for f, yes in zip(FLAGS, on) if yes)
        name = f"{'stream' if stream else 'whole'}-{'+'.join(sorted(flags)) or 'none'}-logprobs_{logprobs}"
        cases.append(
            Case(
                name,
                PROMPTS[i % len(PROMPTS)],
                stream,
                flags,
                logprobs,
                exclude_input=i % 3 != 0,
                send_false_flags=i % 2 == 0,
            )
        )
    every = frozenset(FLAGS)
    for model, stream in itertools.product(("llm", "llm_spec_draft"), (False, True)):  # n > 1, speculation
        cases.append(
            Case(
                f"{model}-n2-{'stream' if stream else 'whole'}",
                "Write a poem about rain.",
                stream,
                every,
                2,
                model=model,
                n=2,
                max_tokens=8,
                sampled=True,
            )
        )
        cases.append(
            Case(
                f"{model}-greedy-{'stream' if stream else 'whole'}",
                "List three colours:",
                stream,
                every,
                2,
                model=model,
                max_tokens=8,
            )
        )
    return cases


CASES = _grid()


@dataclass
class Run:
    responses: list[dict] = field(default_factory=list)  # output name -> numpy array, in arrival order
    error: str | None = None


def run_all(url: str, cases: list[Case], timeout_s: float = 120.0) -> dict[str, Run]:
    """Send every case at once over one gRPC stream; their responses by case name."""
    import tritonclient.grpc as grpcclient

    runs = {case.name: Run() for case in cases}
    pending, lock, done = set(runs), threading.Lock(), threading.Event()

    def on_response(result, error):
        if error is not None:  # an error carries no request id: every unfinished case is failed
            for name in list(pending):
                runs[name].error = str(error)
            done.set()
            return
        response = result.get_response()
        outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
        with lock:
            runs[response.id].responses.append(outputs)
            if response.parameters["triton_final_response"].bool_param:
                pending.discard(response.id)
                if not pending:
                    done.set()

    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=on_response)
        for case in cases:
            client.async_stream_infer(case.model, case.inputs(), request_id=case.name, enable_empty_final_response=True)
        assert done.wait(timeout_s), f"{len(pending)} cases unfinished after {timeout_s} s: {sorted(pending)[:5]}"
    finally:
        client.stop_stream(cancel_requests=bool(pending))
        client.close()
    return runs


@pytest.fixture(scope="module")
def grid(server):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    runs = run_all(server.grpc_url, CASES)
    return runs, {p: len(tokenizer(p).input_ids) for p in {c.prompt for c in CASES}}


@dataclass
class Sample:
    """What one sample of one case sent, gathered over its responses."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    rank1_text: str = ""
    logprob_sum: float = 0.0
    cumulative: list[float] = field(default_factory=list)


def _check_logprobs(case: Case, raw: bytes, new_ids: list[int], sample: Sample) -> None:
    if case.logprobs is None:
        assert raw == b"null", raw
        return
    tokens = json.loads(raw)
    assert isinstance(tokens, list) and len(tokens) == len(new_ids), (tokens, new_ids)
    for token_id, by_id in zip(new_ids, tokens):
        assert str(token_id) in by_id, (token_id, by_id)  # the sampled token is always there
        assert len(by_id) in (case.logprobs, case.logprobs + 1) or (case.logprobs == 0 and len(by_id) == 1)
        for value in by_id.values():
            assert set(value) == {"logprob", "rank", "decoded_token"}, value
            assert value["logprob"] <= 0 and value["rank"] >= 1 and isinstance(value["decoded_token"], str)
        others = sorted(v["rank"] for k, v in by_id.items() if k != str(token_id))
        sampled = by_id[str(token_id)]
        top_ranks = sorted(others + ([sampled["rank"]] if sampled["rank"] <= case.logprobs else []))
        assert top_ranks == list(range(1, case.logprobs + 1)), by_id  # the top `logprobs`, ranks 1..k
        if not case.sampled:
            assert sampled["rank"] == 1, by_id  # greedy: the sampled token is the most likely one
        sample.rank1_text += next(v["decoded_token"] for v in by_id.values() if v["rank"] == 1)
        sample.logprob_sum += sampled["logprob"]


def check_case(case: Case, run: Run, num_input_tokens: int) -> dict[int, Sample]:
    assert run.error is None, run.error
    data = [r for r in run.responses if r]  # the empty final response (if any) carries no outputs
    assert data, "no response with outputs"
    if not case.stream:
        assert len(data) == 1, f"{len(data)} responses for a non-streaming request"
    samples: dict[int, Sample] = {}
    for response in data:
        assert set(response) == ALWAYS | case.flags, sorted(response)
        count = len(response["text_output"])
        ids = response["output_ids"].reshape(count, -1)
        for j in range(count):
            sample = samples.setdefault(int(response["sample_index"][j]), Sample())
            new_ids = [int(t) for t in ids[j] if t >= 0]
            sample.ids += new_ids
            sample.text += response["text_output"][j].decode()
            if "num_output_tokens" in case.flags:
                assert int(response["num_output_tokens"][j]) == len(new_ids)
            if "num_input_tokens" in case.flags:
                assert response["num_input_tokens"].reshape(-1).tolist() == [num_input_tokens]
            if "finish_reason" in case.flags:
                sample.reasons.append(response["finish_reason"][j].decode())
            if "logprobs" in case.flags:
                _check_logprobs(case, response["logprobs"][j], new_ids, sample)
            if "cumulative_logprob" in case.flags:
                assert response["cumulative_logprob"].dtype == np.float32
                value = float(response["cumulative_logprob"][j])
                assert value != (sample.cumulative[-1] if sample.cumulative else 0.0), "unchanged"
                if "logprobs" in case.flags and case.logprobs is not None:
                    assert value == pytest.approx(sample.logprob_sum, rel=1e-5, abs=1e-4)
                sample.cumulative.append(value)
    assert sorted(samples) == list(range(case.n))
    for sample in samples.values():
        if not case.exclude_input and not case.stream:
            assert sample.text.startswith(case.prompt)
            sample.text = sample.text[len(case.prompt) :]
        if "finish_reason" in case.flags:
            *running, last = sample.reasons
            assert running == ["None"] * len(running) and last in ("length", "stop"), sample.reasons
            assert len(sample.ids) == case.max_tokens or last == "stop"
        if "logprobs" in case.flags and case.logprobs is not None and not case.sampled:
            assert sample.rank1_text == sample.text, "greedy: the rank-1 decoded tokens are the text"
    return samples


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_output_when_asked_and_only_then(grid, case):
    runs, input_lengths = grid
    check_case(case, runs[case.name], input_lengths[case.prompt])


def test_greedy_cases_of_one_prompt_agree(grid):
    """The same greedy tokens whatever the flags, and the same cumulative logprob where it was asked for."""
    runs, input_lengths = grid
    by_prompt: dict[str, list] = {}
    for case in CASES:
        if case.model == "llm" and case.n == 1 and not case.sampled:
            sample = check_case(case, runs[case.name], input_lengths[case.prompt])[0]
            by_prompt.setdefault(case.prompt, []).append(sample)
    for prompt, samples in by_prompt.items():
        assert len({tuple(s.ids) for s in samples}) == 1, f"{prompt!r}: greedy outputs differ between cases"
        finals = [s.cumulative[-1] for s in samples if s.cumulative]
        assert finals and max(finals) - min(finals) < 1e-4, (prompt, finals)


def test_http_generate_stream_sends_no_additional_output_unless_asked(server):
    def events(**flags):
        none = dict(return_finish_reason=None, return_num_input_tokens=None, return_num_output_tokens=None)
        chunks = stream_http(
            "Once upon a time", server.http_url, max_tokens=MAX_TOKENS, temperature=0, **{**none, **flags}
        )  # None: this client sends no flag at all
        return [c for c in chunks if not c.is_final]

    assert all(set(c.raw) == ALWAYS | {"model_name", "model_version"} for c in events())
    data = events(return_finish_reason=True, return_cumulative_logprob=True)
    assert all(
        set(c.raw) == ALWAYS | {"model_name", "model_version", "finish_reason", "cumulative_logprob"} for c in data
    )
    assert [c.raw["finish_reason"] for c in data[:-1]] == [["None"]] * (len(data) - 1)
    assert data[-1].finish_reason in ("length", "stop")


def test_a_grpc_client_naming_its_outputs_receives_those_alone(server):
    """Requested outputs (gRPC `outputs`): an always-sent output left out and an asked-for one named."""
    import tritonclient.grpc as grpcclient

    case = Case("named", PROMPTS[0], True, frozenset({"num_output_tokens", "finish_reason"}), None)
    responses, done = [], threading.Event()

    def on_response(result, error):
        responses.append(error or result)
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=on_response)
        wanted = ["text_output", "num_output_tokens"]  # not output_ids, sample_index nor finish_reason
        client.async_stream_infer(
            "llm",
            case.inputs(),
            outputs=[grpcclient.InferRequestedOutput(name) for name in wanted],
            enable_empty_final_response=True,
        )
        assert done.wait(120), "no final response"
        client.stop_stream()
    finally:
        client.close()
    data = [r for r in responses if r.get_response().outputs]
    assert len(data) == MAX_TOKENS, responses
    for result in data:
        assert {o.name for o in result.get_response().outputs} == set(wanted)
        assert result.as_numpy("num_output_tokens").tolist() == [1]
