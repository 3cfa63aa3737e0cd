"""Running the engine in unit tests (the `make_engine` fixture is in conftest.py): prompts, greedy parameters,
stepping requests to the end, and the check that nothing is left behind."""

from __future__ import annotations

from backend import LLMEngine, SamplingParams

MAX_STEPS = 3000

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a land far away, there lived a very curious cat who wanted to see the sea, "
    "the mountains and every city of the kingdom before winter came.",
    "héllo 日本語 🙂",
    "1 2 3 4 5 6 7 8 9 10 11 12",
]


def greedy(max_tokens=12, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def run(engine: LLMEngine, requests):
    """Add the requests, step until done; returns {request_id: [RequestOutput, ...]} in order."""
    seen: dict[str, list] = {}
    for request in requests:
        engine.add_request(request)
    steps = 0
    while engine.has_work():
        for output in engine.step():
            seen.setdefault(output.request_id, []).append(output)
        steps += 1
        assert steps < MAX_STEPS, "the engine made no progress"
        assert len(engine.scheduler.running) <= engine.config.max_num_seqs
    for outputs in seen.values():
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    return seen


def final(outputs):
    return outputs[-1]


def check_pool_empty(engine: LLMEngine):
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.scheduler.reserved_slots == 0
    assert not engine.scheduler._unforked and not engine.scheduler._reserved  # no parallel samples left behind
    assert not engine.outputs._progress  # no finished sequence's output bookkeeping left behind
