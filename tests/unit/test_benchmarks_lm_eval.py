"""benchmarks/lm_eval runs from lm-eval's own environment (.venv-lmeval), which has none of our dependencies and
not this repository installed: `make lm-eval` runs it as a module from the repository root."""

from __future__ import annotations

import subprocess
import sys

from launcher.paths import REPO_ROOT


def test_the_runner_starts_as_a_module_on_the_standard_library_alone():
    """`-S`: no site-packages (no editable install of ours, no third-party package), as in .venv-lmeval; the
    package comes from the working directory, as `python -m benchmarks.lm_eval.run` finds it there."""
    done = subprocess.run(
        [sys.executable, "-S", "-m", "benchmarks.lm_eval.run", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--skip-served" in done.stdout and "--compare-only" in done.stdout
