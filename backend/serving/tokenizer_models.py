"""Triton glue of TensorRT-LLM's `preprocessing` and `postprocessing` models (backend/serving/trtllm_tokenizer.py):
a tokenizer each (backend/protocol/text_tokenizer.py: no transformers, no torch), loaded from `tokenizer_dir`
(relative to the model's folder, or absolute), no engine."""

from __future__ import annotations

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend.model import model_source
from backend.protocol.text_tokenizer import TextTokenizer
from backend.protocol.values import InvalidRequest, as_bool
from backend.protocol.wire import INVALID_REQUEST, error_text
from backend.serving import trtllm_tokenizer
from backend.serving.stub_process import exit_stub_process


class _TokenizerModel:
    step = None  # trtllm_tokenizer.preprocess or postprocess
    inputs: dict = {}
    flag = ""  # its boolean parameter, passed to `step`

    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        folder = Path(args["model_repository"])
        tokenizer_dir = folder / parameters["tokenizer_dir"]  # an absolute tokenizer_dir stays as it is
        # a GGUF file's tokenizer is read from the folder prepared from it (model_source.py), which the launcher
        # prepares before the server starts
        self.tokenizer = TextTokenizer(model_source.resolve(tokenizer_dir))
        self.option = as_bool(self.flag, parameters.get(self.flag, "true"))

    def execute(self, requests):
        responses = []
        for request in requests:
            tensors = {}
            for name in self.inputs:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    tensors[name] = tensor.as_numpy()
            try:
                arrays = type(self).step(self.tokenizer, tensors, self.option)
            except InvalidRequest as exc:
                message = error_text(str(exc), INVALID_REQUEST)
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in arrays.items()]))
        return responses

    def finalize(self):
        exit_stub_process()


class Preprocessing(_TokenizerModel):
    step = trtllm_tokenizer.preprocess
    inputs = trtllm_tokenizer.PRE_INPUTS
    flag = "add_special_tokens"


class Postprocessing(_TokenizerModel):
    step = trtllm_tokenizer.postprocess
    inputs = trtllm_tokenizer.POST_INPUTS
    flag = "skip_special_tokens"
