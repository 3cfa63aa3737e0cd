"""Runs last (file name sorts last): once idle, no model of the session's server holds a KV block."""
import pytest

pytestmark = pytest.mark.integration


def test_zz_every_variant_frees_all_kv_blocks(server):
    leaks = {}
    for model in server.variants:
        m = server.wait_idle(model, timeout_s=30)
        used = m.get("llm_kv_cache_blocks_used", model, default=-1)
        running = m.get("llm_requests_running", model, default=-1)
        waiting = m.get("llm_requests_waiting", model, default=-1)
        if (used, running, waiting) != (0, 0, 0):
            leaks[model] = dict(blocks_used=used, running=running, waiting=waiting)
        total = m.get("llm_kv_cache_blocks_total", model)
        free = m.get("llm_kv_cache_blocks_free", model)
        assert free == total or model in leaks, f"{model}: {free:.0f} free of {total:.0f} blocks while idle"
    assert not leaks, f"models not back to idle 30 s after the suite: {leaks}"
    assert server.alive(), "tritonserver died during the suite"
