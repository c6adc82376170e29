"""MemoryWatch's peak is the kernel's high-water mark, not only what a tick happened to see."""

from __future__ import annotations

import subprocess
import sys

import psutil

from worker.agent.memory_watch import MemoryWatch

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
