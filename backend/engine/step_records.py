"""Step records: what each engine step ran, for a person watching the batch.

Per step, a record says which sequences ran and how (a prefill chunk with its token range, a decode, or a
speculative verification with its drafted / accepted counts), the step's tokens against the budget, KV
blocks used and the queue. `describe()` turns a record into the `log_batch_visualization` log line.

Watching is free when nobody watches: the engine builds no record unless `StepWatchers.active` (one
attribute read per step). A slow watcher never slows the engine: each has a bounded queue that drops its
oldest record when full and counts the drops. backend/serving/batch_view.py streams a watcher's records to a
client.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.core.scheduler import Scheduler
    from backend.core.scheduler_output import SchedulerOutput

PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"


def step_record(
    step: int,
    sched: SchedulerOutput,
    num_accepted: dict[int, int],
    scheduler: Scheduler,
    token_budget: int,
    step_time_s: float = 0.0,
) -> dict:
    """The record of step number `step` (`num_accepted`: each verified sequence's accepted drafts, by seq_id).
    Queue and KV figures are read after the step (as the metric gauges)."""
    seqs = []
    for s in sched.scheduled:
        seq = sched.sequences[s.seq_id]
        entry = {"request_id": seq.request.request_id, "sample": seq.sample_index, "tokens": s.num_new_tokens}
        if s.num_spec_tokens:
            entry.update(kind=VERIFY, drafted=s.num_spec_tokens, accepted=num_accepted.get(seq.seq_id, 0))
        elif s.is_prefill or s.num_new_tokens > 1:  # a prompt chunk, or recomputation after preemption
            entry.update(
                kind=PREFILL, start=s.start, end=s.start + s.num_new_tokens, prompt_tokens=seq.num_prompt_tokens
            )
        else:
            entry.update(kind=DECODE)
        entry["finished"] = seq.is_finished
        seqs.append(entry)
    bm = scheduler.block_manager
    return {
        "type": "step",
        "step": step,
        "time": time.time(),
        "step_ms": round(step_time_s * 1000, 3),
        "num_tokens": sched.num_batched_tokens,
        "token_budget": token_budget,
        "kv_blocks_used": bm.num_used_blocks,
        "kv_blocks_total": bm.num_blocks,
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "preempted": [f"{seq.request.request_id}#{seq.sample_index}" for seq in sched.preempted],
        "seqs": seqs,
    }


def describe(record: dict) -> str:
    """One line per step: which sequences ran, prefill chunk, decode or verification, and tokens each."""
    parts = []
    for entry in record["seqs"]:
        if entry["kind"] == PREFILL:
            kind = f"prefill {entry['start']}:{entry['end']}/{entry['prompt_tokens']}"
        elif entry["kind"] == VERIFY:
            kind = f"decode+{entry['drafted']} draft ({entry['accepted']} accepted)"
        else:
            kind = "decode"
        parts.append(f"[{entry['request_id']}#{entry['sample']} {kind} {entry['tokens']}t]")
    preempted = f" preempted {len(record['preempted'])}" if record["preempted"] else ""
    return (
        f"step {record['step']}: {len(record['seqs'])} seqs, {record['num_tokens']}/{record['token_budget']} "
        f"tokens, KV {record['kv_blocks_used']}/{record['kv_blocks_total']} blocks{preempted} " + " ".join(parts)
    )


class StepWatcher:
    """One watcher's bounded queue: the engine puts without waiting; the oldest record goes when full."""

    def __init__(self, capacity: int = 512):
        self._records: deque[dict] = deque(maxlen=capacity)
        self._ready = threading.Condition()
        self.dropped = 0  # records pushed out unread
        self.closed = False

    def put(self, record: dict) -> None:
        with self._ready:
            if len(self._records) == self._records.maxlen:
                self.dropped += 1
            self._records.append(record)
            self._ready.notify()

    def take(self, timeout_s: float) -> list[dict]:
        """Every waiting record, oldest first; waits up to `timeout_s` for one (empty after a timeout)."""
        with self._ready:
            if not self._records and not self.closed:
                self._ready.wait(timeout_s)
            records = list(self._records)
            self._records.clear()
            return records

    def close(self) -> None:
        with self._ready:
            self.closed = True
            self._ready.notify_all()


class StepWatchers:
    """The engine's watchers. `active` is read by the engine thread each step without a lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._watchers: tuple[StepWatcher, ...] = ()  # replaced, never mutated: safe to iterate unlocked

    @property
    def active(self) -> bool:
        return bool(self._watchers)

    def add(self, capacity: int = 512) -> StepWatcher:
        watcher = StepWatcher(capacity)
        with self._lock:
            self._watchers += (watcher,)
        return watcher

    def remove(self, watcher: StepWatcher) -> None:
        with self._lock:
            self._watchers = tuple(w for w in self._watchers if w is not watcher)
        watcher.close()

    def publish(self, record: dict) -> None:
        for watcher in self._watchers:
            watcher.put(record)

    def close(self) -> None:
        """Close every watcher (their streams end); used at shutdown."""
        with self._lock:
            watchers, self._watchers = self._watchers, ()
        for watcher in watchers:
            watcher.close()
