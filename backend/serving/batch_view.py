"""The batch view's Triton side: a "watch" request (`"batch_view": true`) streams the engine's step records
(backend/engine/step_records.py) back as JSON in `text_output` until the client cancels. `WatchStream` pumps one
watcher's records to the client from a thread of its own.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from backend.core.named_thread import NamedThread
from backend.engine.step_records import StepWatchers
from backend.protocol.wire import WATCH_PARAMETER

if TYPE_CHECKING:
    from backend.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


def engine_summary(engine: LLMEngine) -> dict:
    """The first record a watcher gets: the limits every step record is drawn against."""
    config = engine.config
    return {
        "type": "config",
        "token_budget": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
        "kv_blocks_total": engine.block_manager.num_blocks,
        "block_size": config.block_size,
        "num_speculative_tokens": config.num_speculative_tokens if config.speculative else 0,
    }


def is_watch_request(parameters_json: str) -> bool:
    """Whether a request's parameters (Triton's JSON) ask for a watch: `"batch_view": true`."""
    if WATCH_PARAMETER not in parameters_json:  # the common case costs a substring test
        return False
    try:
        value = json.loads(parameters_json).get(WATCH_PARAMETER)
    except (ValueError, AttributeError):
        return False
    return value is True or (isinstance(value, str) and value.lower() == "true")


class WatchStream:
    """Sends one watcher's records to a client from its own thread until the client cancels or the
    watcher closes: first the engine summary, then batches of step records, each batch one JSON text
    `{"records": [...], "dropped": n}` (n: records this watcher has lost so far)."""

    def __init__(
        self,
        watchers: StepWatchers,
        summary: dict,
        send: Callable[[str], None],
        is_cancelled: Callable[[], bool],
        finish: Callable[[], None],
        poll_s: float = 0.1,
        capacity: int = 512,
    ):
        self.watchers = watchers
        self.watcher = watchers.add(capacity)
        self.summary = summary
        self.send = send
        self.is_cancelled = is_cancelled
        self.finish = finish
        self.poll_s = poll_s
        self.thread = NamedThread(self._run, "llm-batch-view", service=True)

    def start(self) -> WatchStream:
        self.thread.start()
        return self

    def _run(self) -> None:
        watcher = self.watcher
        try:
            self.send(json.dumps({"records": [self.summary], "dropped": 0}))
            checked = time.monotonic()
            while not watcher.closed:
                records = watcher.take(self.poll_s)
                if records:
                    self.send(json.dumps({"records": records, "dropped": watcher.dropped}))
                if time.monotonic() - checked >= self.poll_s:  # a round trip: once per poll_s at most
                    if self.is_cancelled():
                        break
                    checked = time.monotonic()
        except Exception:  # the client went away mid-send: nothing more to do for it
            log.info("batch view watcher ended by a failed send", exc_info=True)
        finally:
            self.watchers.remove(watcher)
            try:
                self.finish()
            except Exception:
                log.debug("final response of a batch view watcher failed", exc_info=True)
