"""MemoryWatch: its peak is the kernel's high-water mark, not only what a tick happened to see;
an OOM kill is read from the trainer's own memory cgroup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from worker.agent.memory_watch import MemoryWatch, limited_group
from worker.agent.zygote import MEMORY_GROUP_ENV

SPIKE = 300 * 2**20


def test_a_spike_between_two_samples_counts_in_the_peak():
    # the child touches SPIKE bytes, frees them, and says so: no sample saw the spike itself
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"b = bytearray({SPIKE}); b[::4096] = b'x' * len(b[::4096]); del b;"
            "print('freed', flush=True); import time; time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "freed"
        proc = psutil.Process(child.pid)
        watch = MemoryWatch()
        watch.sample(proc)
        assert proc.memory_info().rss < SPIKE  # the spike is over when the sample is taken
        assert watch.peak >= SPIKE, watch.peak
    finally:
        child.kill()
        child.wait()


def test_a_rank_in_a_group_of_its_own_is_blamed_for_its_oom_kill():
    """chaos.memory_limit: the agent makes the group, the trainer joins it as it starts (after
    a first sample that still sees it in its parent's group), allocates past the limit and is
    killed by the kernel; the kill is read from that group alone, and the group is removed."""
    try:
        group, v2 = limited_group(f"meshkeeper-unit-{os.getpid()}", 32 * 2**20)
    except OSError as e:
        pytest.skip(f"no memory cgroup can be made here ({e})")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from worker.agent.zygote import join_memory_group; sys.stdin.readline();"
            "join_memory_group(); b = bytearray(256 * 2**20); b[::4096] = b'x' * len(b[::4096])",
        ],
        stdin=subprocess.PIPE,
        env={**os.environ, MEMORY_GROUP_ENV: str(group)},
    )
    try:
        watch = MemoryWatch()
        watch.pin(group, v2)
        watch.sample(psutil.Process(child.pid))  # still in the parent's group: no re-baseline
        assert watch.group == group and watch.kills_at_start == 0
        child.stdin.write(b"go\n")
        child.stdin.close()
        assert child.wait(60) == -signal.SIGKILL
        oom = watch.oom_killed()
        assert oom is not None and oom["limit"] == 32 * 2**20, oom
        assert oom["cgroup"] == str(group) and oom["evidence"] == "memory cgroup oom_kill", oom
    finally:
        child.kill()
        child.wait()
        watch.release()
    assert not group.exists()
