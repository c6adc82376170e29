"""The rankrun server (tests/rankrun.py `serve`, tests/launch.py `run_ranks`) that forks the
suite's waited-for runs: a run's exit code and output come back, a failed rank fails the run,
and a run past its timeout is stopped with every rank it started."""

from __future__ import annotations

import subprocess

import psutil
import pytest

from tests.launch import run_ranks
from tests.stack import wait_until


def forked_ranks() -> list[psutil.Process]:
    """Processes forked by the rankrun server below its launchers (they keep its cmdline)."""
    out = []
    for p in psutil.process_iter(["cmdline", "ppid"]):
        cmd = p.info["cmdline"] or []
        if "--serve" in cmd and "tests.rankrun" in cmd and p.info["ppid"] != psutil.Process().pid:
            out.append(p)
    return out


def test_each_rank_runs_the_module_with_its_rank_and_the_output_comes_back():
    code = "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"
    out = run_ranks(3, "timeit", ["-n", "1", "-r", "1", "-s", code, "pass"], timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 of 3",
        "rank 1 of 3",
        "rank 2 of 3",
    ]


def test_a_failing_rank_fails_the_run_with_its_traceback():
    out = run_ranks(2, "timeit", ["-n", "1", "-r", "1", "1 / 0"], timeout=60)
    assert out.returncode == 1
    assert "ZeroDivisionError" in out.stderr and "[rankrun] rank " in out.stderr, out.stderr


def test_a_module_that_cannot_be_imported_fails_the_run():
    out = run_ranks(2, "tests.no_such_module", timeout=60)
    assert out.returncode == 1
    assert "No module named 'tests.no_such_module'" in out.stderr, out.stderr


def test_a_run_past_its_timeout_is_stopped_with_its_ranks():
    with pytest.raises(subprocess.TimeoutExpired):
        run_ranks(2, "timeit", ["-n", "1", "-r", "1", "import time; time.sleep(600)"], timeout=2)
    wait_until(lambda: not forked_ranks(), 10, "the launcher and its ranks to be gone")
    # and the server still serves
    assert run_ranks(1, "timeit", ["-n", "1", "-r", "1", "pass"], timeout=60).returncode == 0
