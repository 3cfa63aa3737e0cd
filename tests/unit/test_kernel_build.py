"""The kernels' build and its cache (backend/model/kernels/__init__.py): a build stopped half way must not make
the next start wait forever."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from backend.model import kernels

REPO = Path(__file__).resolve().parents[2]


def test_a_load_after_a_build_killed_half_way_does_not_wait_for_its_lock(built_kernels):
    """torch's loader leaves its `lock` file behind when its process is killed mid-build; a later load that waited
    on it would hang the model's initialize forever."""
    stale = kernels.cache_dir() / kernels.build_key() / "lock"
    stale.touch()
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from backend.model import kernels; assert kernels.load() is not None"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        left = stale.exists()
        stale.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not left, "the stale lock file is still there"
    assert "left by a kernel build that was stopped half way" in done.stderr


def test_the_build_lock_is_held_by_one_process_and_freed_when_it_is_killed(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from pathlib import Path; from backend.model import kernels\n"
            f"with kernels.build_lock(Path({str(tmp_path)!r})):\n"
            "    print('held', flush=True); time.sleep(300)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "build.flock", "a") as probe, pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        acquired = threading.Event()

        def build() -> None:
            with kernels.build_lock(tmp_path):
                acquired.set()

        waiter = threading.Thread(target=build, daemon=True)
        waiter.start()
        assert not acquired.wait(0.5), "a second builder got in while the first held the lock"
        os.kill(holder.pid, signal.SIGKILL)
        assert acquired.wait(30), "the lock of a killed builder was not freed"
        waiter.join(5)
    finally:
        holder.kill()
        holder.wait()


def test_every_load_builds_with_the_pinned_ninja(built_kernels):
    """A system ninja (1.11) and the pinned one (1.13) hash a build's commands differently: a build left by one is
    rebuilt in full by the other, which made server starts after a test run rebuild the kernels in initialize.
    A plain PATH, with a system ninja first where there is one, must not change which ninja builds."""
    import ninja

    pinned = Path(ninja.BIN_DIR) / "ninja"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import shutil; from backend.model import kernels; assert kernels.load() is not None; "
            "print(shutil.which('ninja'))",
        ],
        cwd=REPO,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == str(pinned)
    up_to_date = subprocess.run(
        [str(pinned), "-n", "-d", "explain"],
        cwd=kernels.cache_dir() / kernels.build_key(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "no work to do" in up_to_date.stdout, up_to_date.stdout + up_to_date.stderr
