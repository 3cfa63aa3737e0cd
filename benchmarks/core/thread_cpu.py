"""Where a server's CPU goes during a run: CPU time and time spent waiting for a core (runnable, another thread
on it), per thread of the tritonserver process tree, grouped by the threads' OS names (the engine names its
threads, backend/core/named_thread.py), plus this process (the benchmark's clients). Reads Linux's /proc, as
tritonserver runs on Linux only."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

CLIENT = "client (the benchmark process)"
# (group, how a thread is recognised: its process name starts with the first, its thread name with the second)
GROUPS = [
    ("engine + kernel workers", "triton_python", ("llm-engine", "llm-kernel")),
    ("output sender", "triton_python", ("llm-output-send",)),
    ("metrics publisher", "triton_python", ("llm-metrics",)),
    ("stub, other threads", "triton_python", ("",)),
    ("tritonserver", "tritonserver", ("",)),
]
ENGINE = GROUPS[0][0]


@dataclass
class ThreadTimes:
    cpu_s: float = 0.0  # on a core
    wait_s: float = 0.0  # runnable, waiting for a core


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (tritonserver and its Python stubs)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def snapshot(pids: list[int]) -> dict[str, ThreadTimes]:
    """CPU and wait seconds so far, summed per group, with this process's own CPU as CLIENT."""
    groups = {name: ThreadTimes() for name, _, _ in GROUPS}
    for pid in pids:
        task_dir = Path(f"/proc/{pid}/task")
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            tids = list(task_dir.iterdir())
        except OSError:
            continue
        for task in tids:
            try:
                comm = (task / "comm").read_text().strip()
                run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
            except (OSError, ValueError):
                continue  # the thread ended
            group = next(
                (g for g, proc, prefixes in GROUPS if process.startswith(proc) and comm.startswith(prefixes)), None
            )
            if group is not None:
                times = groups[group]
                times.cpu_s += int(run_ns) / 1e9
                times.wait_s += int(wait_ns) / 1e9
    usage = resource.getrusage(resource.RUSAGE_SELF)
    groups[CLIENT] = ThreadTimes(usage.ru_utime + usage.ru_stime)
    return groups


def difference(after: dict[str, ThreadTimes], before: dict[str, ThreadTimes]) -> dict[str, ThreadTimes]:
    zero = ThreadTimes()
    return {
        k: ThreadTimes(v.cpu_s - before.get(k, zero).cpu_s, v.wait_s - before.get(k, zero).wait_s)
        for k, v in after.items()
    }
