"""The LoRA admin requests of the Triton model (`wire.LORA_ADMIN_PARAMETER`): list the loaded adapters, load one
from a folder of the server's disk, unload one. The front door's /v1/models, /v1/load_lora_adapter and
/v1/unload_lora_adapter use them; loading and unloading only where the configuration allows it."""

from __future__ import annotations

import json

from backend.engine.llm_engine import LLMEngine
from backend.model.lora import AdapterError
from backend.protocol.wire import LORA_ADMIN_PARAMETER


def admin_action(parameters_json: str) -> dict | None:
    """The admin action a request's parameters (Triton's JSON) carry, else None (the common case costs a
    substring test)."""
    if LORA_ADMIN_PARAMETER not in parameters_json:
        return None
    try:
        value = json.loads(parameters_json).get(LORA_ADMIN_PARAMETER)
        action = json.loads(value) if isinstance(value, str) else value
    except (ValueError, AttributeError):
        return {"action": None}
    return action if isinstance(action, dict) else {"action": None}


def answer(engine: LLMEngine, action: dict) -> str:
    """The JSON answer to `action`: a status (200, 400 bad request, 403 not allowed, 404 unknown adapter), a
    message, and the adapters loaded after it."""
    adapters = engine.adapters
    kind, name = action.get("action"), action.get("lora_name")
    status, message = 200, ""
    if kind not in ("list", "load", "unload"):
        status, message = 400, f"action must be 'list', 'load' or 'unload', got {kind!r}"
    elif kind != "list" and not engine.config.allow_runtime_lora_updating:
        status, message = 403, "loading and unloading adapters while serving is off (allow_runtime_lora_updating)"
    elif kind != "list" and (not isinstance(name, str) or not name):
        status, message = 400, "lora_name must be a non-empty string"
    elif kind == "load" and (not isinstance(action.get("lora_path"), str) or not action["lora_path"]):
        status, message = 400, "Both 'lora_name' and 'lora_path' must be provided."
    else:
        try:
            if kind == "load":
                adapters.load(name, action["lora_path"])
                message = f"Success: LoRA adapter '{name}' added successfully."
            elif kind == "unload":
                adapters.unload(name)
                message = f"Success: LoRA adapter '{name}' removed successfully."
        except AdapterError as exc:
            status, message = (404 if "cannot be found" in str(exc) else 400), str(exc)
    return json.dumps(
        {
            "status": status,
            "message": message,
            "enabled": adapters.enabled,
            "max_loras": engine.config.max_loras,
            "adapters": adapters.describe(),
        }
    )
