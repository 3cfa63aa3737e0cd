"""TensorRT-LLM's core model contract against the real server: `tensorrt_llm_core` (token ids in, `output_ids` out; not
decoupled, as its quick start deploys it) forwards to `llm` (fp32, exact), called the way its
inflight_batcher_llm_client.py calls it: `input_ids` `[1, L]`, every other input `[1, 1]`."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from backend.serving.trtllm_core_contract import INPUTS
from tests.integration.test_trtllm_contract_e2e import NUMPY, PROMPT, client_inputs, grpc_stream

MODEL = "tensorrt_llm_core"


def core_inputs(prompt_ids: list[int], output_len: int, **values) -> dict[str, np.ndarray]:
    """Its client's inputs: always beam_width, temperature, streaming, end_id, pad_id, runtime_top_k 1 and
    runtime_top_p 0 (greedy), plus `values`."""
    defaults = dict(beam_width=1, temperature=1.0, streaming=False, end_id=2, pad_id=2, runtime_top_k=1)
    out = {
        "input_ids": np.array([prompt_ids], np.int32),
        "input_lengths": np.array([[len(prompt_ids)]], np.int32),
        "request_output_len": np.array([[output_len]], np.int32),
        "runtime_top_p": np.array([[0.0]], np.float32),
    }
    for name, value in {**defaults, **values}.items():
        out[name] = np.asarray(value if isinstance(value, np.ndarray) else [[value]], dtype=NUMPY[INPUTS[name][0]])
    return out


def infer(server, values: dict[str, np.ndarray], module=grpcclient, request_id: str = ""):
    url = server.grpc_url if module is grpcclient else f"{server.host}:{server.http_port}"
    return module.InferenceServerClient(url).infer(MODEL, client_inputs(values, module), request_id=request_id)


def test_its_clients_greedy_request_returns_the_prompt_and_transformers_tokens(server, reference):
    ids = reference.prompt_ids(PROMPT)
    expected = reference.get(PROMPT, 8).token_ids
    for module in (grpcclient, httpclient):
        result = infer(server, core_inputs(ids, 8, end_id=reference.tokenizer.eos_token_id), module)
        assert result.as_numpy("output_ids").tolist() == [[ids + expected]]
        assert result.as_numpy("sequence_length").tolist() == [[len(ids) + 8]]
    excluded = infer(server, core_inputs(ids, 8, exclude_input_in_output=True))
    assert excluded.as_numpy("output_ids").tolist() == [[expected]]


def test_log_probs_and_logits_come_in_its_shapes(server, reference):
    ids = reference.prompt_ids(PROMPT)
    values = core_inputs(ids, 3, return_log_probs=True, return_context_logits=True, return_generation_logits=True)
    result = infer(server, values)
    assert result.as_numpy("cum_log_probs").shape == (1, 1) and result.as_numpy("output_log_probs").shape == (1, 1, 3)
    np.testing.assert_allclose(
        result.as_numpy("output_log_probs").sum(), result.as_numpy("cum_log_probs")[0, 0], atol=1e-4
    )
    vocab = result.as_numpy("generation_logits").shape[-1]
    assert result.as_numpy("context_logits").shape == (1, len(ids), vocab)
    assert result.as_numpy("generation_logits").shape == (1, 1, 3, vocab)
    tokens = result.as_numpy("output_ids")[0, 0, len(ids) :].tolist()
    assert result.as_numpy("generation_logits")[0, 0].argmax(-1).tolist() == tokens


def word_list(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's `[1, 2, L]` word list: the ids end to end, then each word's end offset."""
    flat = [t for w in words for t in w]
    offsets = list(np.cumsum([len(w) for w in words]))
    return np.array([[flat, offsets + [-1] * (len(flat) - len(offsets))]], np.int32)


def test_token_word_lists_ban_and_stop(server, reference):
    ids = reference.prompt_ids(PROMPT)
    expected = reference.get(PROMPT, 8).token_ids
    word = next(t for t in expected if t != expected[0])  # a token the answer has, but not its first
    banned = infer(server, core_inputs(ids, 8, bad_words_list=word_list([[word]]), exclude_input_in_output=True))
    tokens = banned.as_numpy("output_ids")[0, 0].tolist()
    assert tokens[0] == expected[0] and word not in tokens
    stopped = infer(
        server, core_inputs(ids, 8, stop_words_list=word_list([expected[2:4]]), exclude_input_in_output=True)
    )
    assert stopped.as_numpy("output_ids")[0, 0].tolist() == expected[:4]


def test_streaming_needs_the_decoupled_policy_and_bad_inputs_say_why(server, reference):
    ids = reference.prompt_ids(PROMPT)
    for values, message in (
        (core_inputs(ids, 4, streaming=True), "needs a decoupled model"),
        (core_inputs(ids, 4, beam_width=2), "beam search is not supported"),
        ({**core_inputs(ids, 4), "input_lengths": np.array([[99]], np.int32)}, "input_lengths must be from 1"),
    ):
        with pytest.raises(InferenceServerException, match=message):
            infer(server, values)
    assert infer(server, core_inputs(ids, 2)).as_numpy("sequence_length").tolist() == [[len(ids) + 2]]


def test_a_stop_request_ends_the_request_of_the_same_id_early(server, reference):
    """inflight_batcher_llm_client.py --stop-after-ms: a second request with the same id and `stop` true; the
    first answers with the tokens it had, the stop request with an empty response."""
    ids = reference.prompt_ids(PROMPT)
    answers: list = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done = threading.Event()
    before = server.settled_metrics().get("llm_generation_tokens_total")
    client.async_infer(
        MODEL,
        client_inputs(core_inputs(ids, 400)),
        callback=lambda result, error: (answers.append(error or result), done.set()),
        request_id="stop-me",
    )
    server.wait_for(lambda m: m.get("llm_generation_tokens_total") > before, what="the request's first token")
    stop = {
        "input_ids": np.empty((1, 1), np.int32),
        "input_lengths": np.array([[0]], np.int32),
        "request_output_len": np.array([[0]], np.int32),
        "stop": np.array([[True]]),
    }
    stopped = infer(server, stop, request_id="stop-me")
    assert stopped.as_numpy("output_ids") is None
    assert done.wait(60)
    (answer,) = answers
    assert not isinstance(answer, InferenceServerException), answer
    length = answer.as_numpy("sequence_length")[0, 0]
    assert len(ids) < length < len(ids) + 400
    client.close()


def test_its_pipeline_of_preprocessing_core_and_postprocessing_equals_the_ensemble(server):
    """end_to_end_test.py's check: preprocessing, the core model and postprocessing called in turn give the
    ensemble's text_output byte for byte, and the same log probs."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    words = {"BAD_WORDS_DICT": np.array([[b""]], object), "STOP_WORDS_DICT": np.array([[b""]], object)}
    query = {"QUERY": np.array([[PROMPT.encode()]], object), "REQUEST_OUTPUT_LEN": np.array([[10]], np.int32)}
    pre = client.infer("preprocessing", client_inputs({**query, **words}))
    core = {
        "input_ids": pre.as_numpy("INPUT_ID"),
        "input_lengths": pre.as_numpy("REQUEST_INPUT_LEN"),
        "request_output_len": pre.as_numpy("REQUEST_OUTPUT_LEN"),
        "decoder_input_ids": pre.as_numpy("DECODER_INPUT_ID"),
        "end_id": pre.as_numpy("OUT_END_ID"),
        "pad_id": pre.as_numpy("OUT_PAD_ID"),
        "bad_words_list": pre.as_numpy("BAD_WORDS_IDS"),
        "stop_words_list": pre.as_numpy("STOP_WORDS_IDS"),
        "return_log_probs": np.array([[True]]),
    }
    answer = client.infer(MODEL, client_inputs(core))
    tokens = {"TOKENS_BATCH": answer.as_numpy("output_ids"), "SEQUENCE_LENGTH": answer.as_numpy("sequence_length")}
    text = client.infer("postprocessing", client_inputs(tokens)).as_numpy("OUTPUT")
    ensemble = {
        "text_input": np.array([[PROMPT.encode()]], object),
        "max_tokens": np.array([[10]], np.int32),
        "bad_words": np.array([[b""]], object),
        "stop_words": np.array([[b""]], object),
        "return_log_probs": np.array([[True]]),
    }
    (expected,) = grpc_stream(server, "ensemble", ensemble, outputs=("text_output", "cum_log_probs"))
    assert text.tolist() == expected.as_numpy("text_output").tolist()
    np.testing.assert_allclose(answer.as_numpy("cum_log_probs"), expected.as_numpy("cum_log_probs"), atol=1e-5)
    client.close()
