"""What a request to the `llm` model asks for, read once from its parameters (Triton's JSON): the kind the Triton
model's `execute` routes by, and what its handler needs."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from backend.serving.batch_view import is_watch_request
from backend.serving.forwarded import split_parameters
from backend.serving.lora_admin import admin_action


class RequestKind(enum.Enum):
    GENERATE = "generate"
    BATCH_VIEW = "batch_view"  # a watch of the engine's step records (`"batch_view": true`)
    LORA_ADMIN = "lora_admin"  # list, load or unload a LoRA adapter
    CANCEL_FORWARDED = "cancel_forwarded"  # a forwarding model cancels a request it forwarded


@dataclass(frozen=True)
class RoutedRequest:
    kind: RequestKind
    parameters: str  # the request's parameters, less the forwarding ones
    lora_action: dict | None = None  # LORA_ADMIN's action
    forwarded_id: str | None = None  # GENERATE's id, when a forwarding model sent it
    cancel_id: str | None = None  # CANCEL_FORWARDED's forwarded id


def route(parameters_json: str) -> RoutedRequest:
    if is_watch_request(parameters_json):
        return RoutedRequest(RequestKind.BATCH_VIEW, parameters_json)
    action = admin_action(parameters_json)
    if action is not None:
        return RoutedRequest(RequestKind.LORA_ADMIN, parameters_json, lora_action=action)
    forwarded_id, cancel_id, parameters = split_parameters(parameters_json)
    if cancel_id is not None:
        return RoutedRequest(RequestKind.CANCEL_FORWARDED, parameters, cancel_id=cancel_id)
    return RoutedRequest(RequestKind.GENERATE, parameters, forwarded_id=forwarded_id)
