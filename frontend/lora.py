"""LoRA adapters through the front door, as vLLM's OpenAI server offers them: each adapter is a model of its own
in /v1/models (its base model as `parent`), a request names it in `model`, and /v1/load_lora_adapter and
/v1/unload_lora_adapter add and remove adapters while serving (behind the API key, where one is set; the Triton
model must allow it: `allow_runtime_lora_updating`).

Which served model holds which adapter is asked of the models themselves (wire.LORA_ADMIN_PARAMETER) and cached:
refreshed by /v1/models, by every load and unload, and before a model name nobody knows is refused."""

from __future__ import annotations

from aiohttp import web

from .errors import APIError, bad_request
from .generation import Generation
from .request_body import read_json
from .triton_stream import EngineError, TritonLLM

_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error"}


class AdapterIndex:
    """Adapter name -> (the served model that holds it, its folder), for the served `models`."""

    def __init__(self, llm: TritonLLM, models: list[str]):
        self.llm = llm
        self.models = models
        self.adapters: dict[str, tuple[str, str]] = {}
        self.lora_models: list[str] = []  # the served models with LoRA enabled

    async def refresh(self) -> None:
        found, enabled = {}, []
        for model in self.models:
            try:
                answer = await self.llm.lora_admin(model, {"action": "list"})
            except EngineError:
                continue  # not ready, or not one of ours: it serves no adapters now
            found |= {a["name"]: (model, a["path"]) for a in answer.get("adapters", ())}
            enabled += [model] if answer.get("enabled") else []
        self.adapters, self.lora_models = found, enabled

    async def served(self, requested) -> list[str]:
        """Every name a request may give as `model`: the served models and their adapters (asked again first
        where `requested` is neither)."""
        if requested not in self.models and requested not in self.adapters and isinstance(requested, str):
            await self.refresh()
        return self.models + list(self.adapters)

    def route(self, generation: Generation) -> Generation:
        """A generation for an adapter goes to its base model, naming the adapter (vllm_backend's `lora_name`)."""
        held = self.adapters.get(generation.model)
        if held is not None:
            generation.sampling["lora_name"] = generation.model
            generation.target = held[0]
        return generation


async def load_adapter(request: web.Request, index: AdapterIndex) -> web.Response:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path"[, "model": the served model to add it to, default the
    first with LoRA enabled]}: vLLM's route and answers."""
    body = await read_json(request, 1 << 16)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path:
        raise bad_request(
            "Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not name else "lora_path"
        )
    await index.refresh()
    if not index.lora_models:
        raise bad_request(f"none of the served models {index.models} has LoRA enabled (enable_lora)", "model")
    model = body.get("model", index.lora_models[0])
    if model not in index.models:
        raise bad_request(f"model must be one of the served models {index.models}, got {model!r}", "model")
    if name in index.adapters or name in index.models:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    return await _ask(index, model, {"action": "load", "lora_name": name, "lora_path": path})


async def unload_adapter(request: web.Request, index: AdapterIndex) -> web.Response:
    """POST /v1/unload_lora_adapter {"lora_name"}: vLLM's route and answers."""
    body = await read_json(request, 1 << 16)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise bad_request("lora_name must be a non-empty string", "lora_name")
    await index.refresh()
    if name not in index.adapters:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error", "lora_name")
    return await _ask(index, index.adapters[name][0], {"action": "unload", "lora_name": name})


async def _ask(index: AdapterIndex, model: str, action: dict) -> web.Response:
    answer = await index.llm.lora_admin(model, action)
    await index.refresh()
    status = answer.get("status", 500)
    if status != 200:
        raise APIError(status, answer.get("message", ""), _TYPES.get(status, "internal_server_error"), "lora_name")
    return web.Response(text=answer["message"])  # vLLM answers success as plain text
