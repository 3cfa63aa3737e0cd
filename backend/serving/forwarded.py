"""Requests that reach `llm` from our forwarding models (the TensorRT-LLM contract's `ensemble` and
`tensorrt_llm_bls`, backend/serving/forwarding_model.py). Triton 2.51 cannot cancel a BLS request, so a forwarding
model whose client cancels sends `llm` a second request naming the first; this registry is how the first learns it.
"""

from __future__ import annotations

import json
import threading

from backend.protocol.wire import CANCEL_FORWARDED, FORWARDED_ID


def split_parameters(parameters_json: str) -> tuple[str | None, str | None, str]:
    """(forwarded id, id to cancel, the other parameters as JSON) of a request's parameters."""
    if FORWARDED_ID not in parameters_json and CANCEL_FORWARDED not in parameters_json:
        return None, None, parameters_json  # the common case costs two substring tests
    try:
        values = json.loads(parameters_json)
    except ValueError:
        return None, None, parameters_json  # the request parser says what is wrong with it
    if not isinstance(values, dict):
        return None, None, parameters_json
    forwarded, cancel = values.pop(FORWARDED_ID, None), values.pop(CANCEL_FORWARDED, None)
    return (str(forwarded) if forwarded else None), (str(cancel) if cancel else None), json.dumps(values)


class ForwardedRequests:
    """The forwarded requests in flight and which of them their forwarding model has cancelled."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cancelled: dict[str, bool] = {}

    def track(self, forwarded_id: str) -> None:
        with self._lock:
            self._cancelled[forwarded_id] = False

    def cancel(self, forwarded_id: str) -> None:
        """Marks a forwarded request in flight cancelled; an unknown or finished id is a no-op."""
        with self._lock:
            if forwarded_id in self._cancelled:
                self._cancelled[forwarded_id] = True

    def is_cancelled(self, forwarded_id: str) -> bool:
        return self._cancelled.get(forwarded_id, False)

    def done(self, forwarded_id: str) -> None:
        with self._lock:
            self._cancelled.pop(forwarded_id, None)

    def __len__(self) -> int:
        return len(self._cancelled)
