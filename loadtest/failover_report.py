"""What a failover run showed: the requests counted by outcome and phase (the kill, the outage, the rejoin, the
graceful stop), the KV blocks left, and the report (markdown) with the machine it ran on."""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path

from loadtest.failover_run import DRAINED, KILLED, RUN, Record


def _counts(records: list[Record]) -> dict:
    return {
        "sent": len(records),
        "succeeded": sum(r.outcome == "ok" for r in records),
        "retried": sum(r.retries > 0 for r in records),
        "retried_and_succeeded": sum(r.retries > 0 and r.outcome == "ok" for r in records),
        "failed_with_clear_error": sum(r.outcome == "error_clear" for r in records),
        "failed_unclearly": sum(r.outcome == "error_unclear" for r in records),
    }


def analyse(timeline, at_kill, at_sigterm, kv_after_main, kv_end, killed, drained) -> dict:
    records = RUN.records
    by_id = {r.id: r for r in records}
    kill, up = timeline["kill"], timeline.get("up")
    outage = [r for r in records if kill <= r.started < (up or float("inf"))]
    cut = [
        by_id[i]
        for i in at_kill
        if by_id[i].served_by == killed.name and by_id[i].kind == "stream" and by_id[i].started_streaming
    ]
    draining = [by_id[i] for i in at_sigterm if by_id[i].served_by == drained.name]
    after_sigterm = [r for r in records if r.started > timeline["sigterm"] + 1]
    phases = {
        "before the kill": [r for r in records if r.started < kill],
        "kill until rejoin": outage,
        "after rejoin": [r for r in records if (up or float("inf")) <= r.started < timeline["main_end"]],
        "graceful stop phase": [r for r in records if r.started >= timeline["drain_load"]],
    }
    errors: dict[str, int] = {}
    for r in records:
        if r.outcome != "ok":
            key = f"{r.outcome}: {re.sub(r'127.0.0.1:[0-9]+', '127.0.0.1:<port>', r.error)[:160]}"
            errors[key] = errors.get(key, 0) + 1
    served_after_rejoin = [r for r in records if up is not None and r.started >= up and r.served_by == killed.name]
    summary = {
        "counts": _counts(records),
        "phases": {name: _counts(rs) for name, rs in phases.items()},
        "timeline_s": timeline,
        "rejoin_s": {
            "kill_to_proxy_down": None if "down" not in timeline else round(timeline["down"] - kill, 2),
            "kill_to_new_tritonserver": None if "restarted" not in timeline else round(timeline["restarted"] - kill, 2),
            "kill_to_proxy_up": None if up is None else round(up - kill, 2),
            "kill_to_first_success_on_it": None
            if "first_success_after" not in timeline
            else round(timeline["first_success_after"] - kill, 2),
        },
        "streams_cut_by_the_kill": {
            "count": len(cut),
            "ended_with_error_event": sum(r.outcome == "error_clear" for r in cut),
            "examples": sorted({r.error for r in cut})[:3],
        },
        "requests_started_during_outage": _counts(outage)
        | {"served_by_survivor": sum(r.served_by == drained.name for r in outage)},
        "requests_on_rejoined_replica_after_up": _counts(served_after_rejoin),
        "graceful_stop": {
            "in_flight_on_stopped_replica": _counts(draining),
            "started_after_sigterm": _counts(after_sigterm)
            | {"served_by_stopped": sum(r.served_by == drained.name for r in after_sigterm)},
            "exit_code": drained.proc.returncode,
        },
        "kv_after_main_phase": kv_after_main,
        "kv_at_end": kv_end,
        "errors": errors,
    }
    c = summary["counts"]
    summary["checks"] = {
        "no unclear failure": c["failed_unclearly"] == 0,
        "every failure is a stream the kill cut": c["failed_with_clear_error"]
        == summary["streams_cut_by_the_kill"]["ended_with_error_event"],
        "the kill cut a started stream, which ended with an error event": 0
        < len(cut)
        == summary["streams_cut_by_the_kill"]["ended_with_error_event"],
        "retried requests succeeded": c["retried"] == c["retried_and_succeeded"],
        "the survivor served during the outage": summary["requests_started_during_outage"]["served_by_survivor"] > 0,
        "the killed replica rejoined and served": up is not None and "first_success_after" in timeline,
        "graceful stop drained its streams": all(r.outcome == "ok" for r in draining),
        "no KV block held after the main phase": all(v["kv_blocks_used"] == 0 for v in kv_after_main.values()),
        "no KV block held at the end": all(v["kv_blocks_used"] == 0 for v in kv_end.values()),
    }
    return summary


# -------------------------------------------------------------------------------------------------- report


def machine() -> dict:
    info = {"python": platform.python_version(), "kernel": platform.release()}
    text = Path("/proc/cpuinfo").read_text()
    info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    info["cpus"] = text.count("\nprocessor") + text.startswith("processor")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    info["cpu_flags"] = " ".join(flags)
    mem = Path("/proc/meminfo").read_text().split("\n", 1)[0]
    info["memory_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    return info


def report(summary: dict, meta: dict) -> str:
    c, r, g = summary["counts"], summary["rejoin_s"], summary["graceful_stop"]
    m = meta["machine"]
    simd = [f for f in m["cpu_flags"].split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    lines = [
        "# Failover: two replicas behind HAProxy, one tritonserver killed under load",
        "",
        f"`.venv/bin/llm-failover {meta['argv']}` ({meta['date']}). Machine: {m['cpu']}, "
        f"{m['cpus']} CPUs, {m['memory_gib']} GiB; SIMD flags: {' '.join(simd)} (all flags in the .json). "
        f"{meta['haproxy']}. Replicas: `llm-serve-replicas`, the default model repository, "
        f"{meta['replicas']}; {meta['users']} Locust users, half streamed chat completions, half whole "
        f"completions, greedy, max_tokens {meta['max_tokens']} with ignore_eos. Both replicas were ready behind the "
        f"proxy {meta['replicas_ready_s']} s after the start; 1-minute load average before / after the run "
        f"{meta['load_average_before_after'][0]} / {meta['load_average_before_after'][1]} (the machine is shared).",
        "",
        "| | requests |",
        "|---|---|",
        f"| sent | {c['sent']} |",
        f"| succeeded | {c['succeeded']} |",
        f"| retried by the proxy (of which succeeded) | {c['retried']} ({c['retried_and_succeeded']}) |",
        f"| failed with a clear error | {c['failed_with_clear_error']} |",
        f"| failed unclearly (reset, truncated, timeout) | {c['failed_unclearly']} |",
        "",
        "| phase | sent | succeeded | retried | clear error | unclear |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in summary["phases"].items():
        lines.append(
            f"| {name} | {p['sent']} | {p['succeeded']} | {p['retried']} | {p['failed_with_clear_error']} "
            f"| {p['failed_unclearly']} |"
        )
    cut = summary["streams_cut_by_the_kill"]
    outage = summary["requests_started_during_outage"]
    kv_main, kv_end = summary["kv_after_main_phase"], summary["kv_at_end"]
    lines += [
        "",
        f"Time to rejoin after the SIGKILL of {KILLED}'s tritonserver: proxy marks it down after "
        f"{r['kill_to_proxy_down']} s; its supervisor starts a new tritonserver after "
        f"{r['kill_to_new_tritonserver']} s; "
        f"the proxy marks it up after **{r['kill_to_proxy_up']} s**; the first request it serves after the kill "
        f"succeeds at {r['kill_to_first_success_on_it']} s.",
        "",
        f"- Streams on {KILLED} when it was killed: {cut['count']}, each ended with an error event "
        f"({cut['ended_with_error_event']}), e.g. `{(cut['examples'] or ['-'])[0]}`.",
        f"- Requests started between the kill and the rejoin: {outage['sent']}, succeeded {outage['succeeded']} "
        f"(served by {DRAINED}: {outage['served_by_survivor']}; retried {outage['retried']}).",
        f"- After the rejoin {KILLED} served {summary['requests_on_rejoined_replica_after_up']['sent']} requests "
        f"({summary['requests_on_rejoined_replica_after_up']['succeeded']} succeeded).",
        f"- Graceful stop (SIGTERM) of {DRAINED} under load: {g['in_flight_on_stopped_replica']['sent']} requests in "
        f"flight on it, {g['in_flight_on_stopped_replica']['succeeded']} finished normally; of the "
        f"{g['started_after_sigterm']['sent']} started after it, {g['started_after_sigterm']['succeeded']} succeeded "
        f"and {g['started_after_sigterm']['served_by_stopped']} were served by {DRAINED}; its llm-serve exited with "
        f"code {g['exit_code']}.",
        f"- Python stubs of the killed tritonserver still running after the restart: "
        f"{summary['orphaned_stubs_after_restart'] or 'none'}.",
        f"- `llm_kv_cache_blocks_used` once the users stopped: after the kill phase {KILLED} "
        f"{kv_main[KILLED]['kv_blocks_used']:.0f}, {DRAINED} {kv_main[DRAINED]['kv_blocks_used']:.0f}; at the end "
        f"{KILLED} {kv_end[KILLED]['kv_blocks_used']:.0f} (running and waiting 0 on each).",
        "",
        "Checks: " + "; ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in summary["checks"].items()) + ".",
        "",
    ]
    if summary["errors"]:
        lines += ["Failures, by message:", ""]
        lines += [f"- {n} x `{e}`" for e, n in sorted(summary["errors"].items())] + [""]
    lines += ["Timeline (s from the start of the load):", ""]
    for e in RUN.events:
        extra = {k: v for k, v in e.items() if k not in ("t", "what")}
        lines.append(f"- {e['t']:.1f}: {e['what']}" + (f" {json.dumps(extra)}" if extra else ""))
    return "\n".join(lines) + "\n"
