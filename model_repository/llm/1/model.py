"""Triton glue for the LLM engine: parse and validate each request, hand it to the engine, send responses.

Decoupled: `execute` routes each request by its kind (`request_kinds.route`, a table of handlers) and returns at
once; the engine loop's output sender thread sends every response through the request's response sender (the last
one with the FINAL flag) and polls `is_cancelled()`, so the engine thread never waits on a round trip to the server.
"""

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.core.config import EngineConfig
from backend.core.metrics import PeriodicPublisher, TritonMetricsSink
from backend.core.request import RequestOutput
from backend.engine.loop import EngineStopped, ServerBusy
from backend.engine.output_sender import Transport
from backend.protocol.values import InvalidRequest
from backend.protocol.wire import INPUT_NAMES, error_text
from backend.serving.engine_client import EngineClient
from backend.serving.forwarded import ForwardedRequests
from backend.serving.request_inputs import ParsedRequest
from backend.serving.request_kinds import RequestKind, RoutedRequest, route
from backend.serving.response_tensors import TokenTexts, response_arrays
from backend.serving.stub_process import exit_stub_process
from backend.serving.vllm_backend_parameters import split as split_vllm_backend_parameters

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_log = logging.getLogger("backend.triton_model")


class _TritonLogHandler(logging.Handler):
    def emit(self, record):
        level = pb_utils.Logger.log_error if record.levelno >= logging.ERROR else pb_utils.Logger.log_info
        level(self.format(record))


def _text_response(text: str):
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor("text_output", np.array([text.encode()], dtype=object))]
    )


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("model_transaction_policy { decoupled: true } is required")
        handler = _TritonLogHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logging.getLogger("backend").addHandler(handler)
        logging.getLogger("backend").setLevel(logging.INFO)
        parameters = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        # vllm_backend's ENABLE_VLLM_HEALTH_CHECK and REPORT_CUSTOM_METRICS, under their names
        parameters, vllm_backend = split_vllm_backend_parameters(parameters)
        folder = Path(args["model_repository"])
        # with enable_lora, the adapters listed where vllm_backend keeps them, unless lora_modules names a file
        listed = folder / args["model_version"] / "multi_lora.json"
        config = EngineConfig.from_parameters(parameters, base_dir=folder, lora_listing=listed)
        self.model_name = args["model_name"]
        # Triton metric updates are round trips to the server: published from their own thread every 100 ms.
        # That thread starts with the first request, after `initialize` has returned: until then every round
        # trip is made here, on this thread, one at a time (docs/engine.md, "Start and stop").
        self.metrics_publisher = PeriodicPublisher(
            TritonMetricsSink(
                pb_utils, {"model": self.model_name, "version": args["model_version"]}, config.metric_dialects
            )
        )
        on_death = self._stop_reporting_ready if vllm_backend.unload_on_engine_death else self._stay_loaded
        self.engine = EngineClient(config, self.metrics_publisher, on_death=on_death)
        self.forwarded = ForwardedRequests()  # requests from the TensorRT-LLM contract's models
        self._handlers = {
            RequestKind.GENERATE: self._generate,
            RequestKind.BATCH_VIEW: self._watch,
            RequestKind.LORA_ADMIN: self._answer_lora_admin,
            RequestKind.CANCEL_FORWARDED: self._cancel_forwarded,
        }

    def _stop_reporting_ready(self, failure: str) -> None:
        """The engine thread died (every request in flight has its error queued for sending): unload the model, so
        that its ready endpoint says not ready at once (and the server's, while it unloads). Triton 2.51 offers
        no other way for a model to do so; the unload needs --model-control-mode=explicit (the launcher's)."""
        self.engine.close_watchers()
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as exc:  # noqa: BLE001 - e.g. a server without explicit model control
            _log.error(
                "model %s: the engine died and the model could not unload itself (%s): it stays READY while "
                "refusing every request; start tritonserver with --model-control-mode=explicit --load-model=* "
                "(as llm-serve does) so that readiness follows the engine",
                self.model_name,
                exc,
            )
            return
        _log.error(
            "model %s: the engine died (%s); unloading the model, so that it reports not ready",
            self.model_name,
            failure,
        )

    def _stay_loaded(self, failure: str) -> None:
        """The engine thread died with ENABLE_VLLM_HEALTH_CHECK false: the model stays loaded (and READY),
        refusing every request as unavailable."""
        self.engine.close_watchers()
        _log.error(
            "model %s: the engine died (%s); ENABLE_VLLM_HEALTH_CHECK is false, so the model stays loaded and "
            "refuses every request until it is reloaded",
            self.model_name,
            failure,
        )

    def execute(self, requests):
        self.metrics_publisher.start()  # idempotent; `initialize` has returned by now
        for request in requests:
            sender = request.get_response_sender()
            routed = route(request.parameters())
            self._handlers[routed.kind](request, sender, routed)
        return None

    def _generate(self, request, sender, routed: RoutedRequest):
        """Refused at once (a bad input, a full queue, a stopped engine): its one error response, sent here."""
        try:
            self._submit(request, sender, routed.parameters, routed.forwarded_id)
        except (InvalidRequest, ServerBusy, EngineStopped) as exc:
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(error_text(str(exc), exc.kind))), flags=FINAL
            )

    def _answer_lora_admin(self, request, sender, routed: RoutedRequest):
        sender.send(_text_response(self.engine.lora_admin(routed.lora_action)), flags=FINAL)

    def _cancel_forwarded(self, request, sender, routed: RoutedRequest):
        self.forwarded.cancel(routed.cancel_id)
        sender.send(flags=FINAL)

    def _submit(self, request, sender, parameters: str, forwarded_id: str | None):
        tensors = {}
        for name in INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                tensors[name] = tensor.as_numpy()
        parsed = self.engine.parse(tensors, parameters)
        writer = _ResponseWriter(
            sender, parsed, self.engine.token_texts, self.engine.publish_metrics, request.requested_output_names()
        )
        is_cancelled = sender.is_cancelled
        if forwarded_id is not None:

            def is_cancelled():
                return self.forwarded.is_cancelled(forwarded_id) or sender.is_cancelled()

        engine_request = self.engine.build_request(parsed)
        # non-streaming: the prompt (as text, also for input_ids) comes first unless excluded
        writer.prompt_prefix = "" if parsed.exclude_input_in_output else engine_request.prompt
        if forwarded_id is not None:
            self.forwarded.track(forwarded_id)
            writer.on_final = lambda: self.forwarded.done(forwarded_id)
        try:
            self.engine.submit(engine_request, Transport(writer.send, is_cancelled))
        except (ServerBusy, EngineStopped):
            if forwarded_id is not None:
                self.forwarded.done(forwarded_id)
            raise

    def _watch(self, request, sender, routed: RoutedRequest):
        """A batch view watch (`"batch_view": true`): the engine's step records stream back as JSON in
        `text_output` until the client cancels."""

        def send(text):
            sender.send(_text_response(text))

        self.engine.watch(send, sender.is_cancelled, lambda: sender.send(flags=FINAL))

    def finalize(self):
        self.engine.shutdown()
        self.metrics_publisher.sink.close()  # an unloaded model leaves no metrics behind
        exit_stub_process()  # the stub answered Triton's finalize request before calling this


class _ResponseWriter:
    """Turns engine outputs into Triton responses for one request."""

    def __init__(self, sender, parsed: ParsedRequest, token_texts: TokenTexts, before_final, requested_outputs):
        self.sender = sender
        # Triton sends only the outputs the client asked for (all when it named none): build no other
        self.requested_outputs = frozenset(requested_outputs) or None
        self.before_final = before_final  # called before the final response is sent
        self.prompt_prefix = ""
        self.stream = parsed.stream
        self.skip_special_tokens = parsed.params.skip_special_tokens
        self.outputs = parsed.outputs  # the additional outputs asked for
        self.token_texts = token_texts
        self.on_final = None  # called once the final response is sent

    def send(self, output: RequestOutput):
        if output.error is not None:
            self._send(pb_utils.InferenceResponse(error=pb_utils.TritonError(error_text(output.error))), FINAL)
        elif not output.samples:  # finished with nothing new to say
            self._send(None, FINAL)
        elif self.stream:
            for i, sample in enumerate(output.samples):
                last = output.finished and i == len(output.samples) - 1
                self._send(self._response([sample], output), FINAL if last else 0)
                output = dataclasses.replace(output, prompt_logprobs=None)  # sent once, with the first sample
        else:
            self._send(self._response(output.samples, output), FINAL)

    def _send(self, response, flags: int):
        if flags == FINAL:
            self.before_final()
        if response is None:
            self.sender.send(flags=flags)
        else:
            self.sender.send(response, flags=flags)
        if flags == FINAL and self.on_final is not None:
            self.on_final()

    def _response(self, samples, output: RequestOutput):
        prefix = "" if self.stream else self.prompt_prefix
        arrays = response_arrays(
            output, samples, self.outputs, self.token_texts, prefix, self.skip_special_tokens, self.requested_outputs
        )
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])
