"""`peak_mem_bytes` (docs/architecture.md, "Records"): this process's own peak, and the way it
travels from the trainer's step record into the agent's RankReport."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from services.records import RankReport, StepRecord
from worker.agent.memory_watch import MemoryWatch
from worker.agent.rank_progress import RankProgress
from worker.peak_rss import high_water_mark

MiB = 2**20
# A zygote stand-in: 200 MiB resident (the zygote's imports), then a forked "trainer" that
# touches 30 MiB of its own, says its own peak and pid, and waits to be read from outside.
FORKED = """
import json, os, sys
from worker.peak_rss import high_water_mark
def touch(n):
    b = bytearray(n)
    b[::4096] = b"x" * len(b[::4096])
    return b
zygote = touch(200 * 2**20)
if os.fork() == 0:
    own = touch(30 * 2**20)
    print(json.dumps({"pid": os.getpid(), "own": high_water_mark()}), flush=True)
    sys.stdin.readline()
    os._exit(0)
os.wait()
"""


def test_a_freed_allocation_still_counts_in_the_peak():
    resident = psutil.Process().memory_full_info().uss  # this process's own pages
    spike = bytearray(256 * 2**20)
    spike[::4096] = b"\1" * len(spike[::4096])  # touch every page: resident, not just mapped
    del spike
    # the kernel syncs per-thread RSS counters lazily (up to a few hundred kB behind)
    assert high_water_mark() >= resident + 0.95 * 256 * 2**20


def test_the_latest_step_records_peak_reaches_the_rank_report():
    progress = RankProgress(started_at=100.0)
    for n, peak in ((1, 300 * 2**20), (2, 310 * 2**20)):
        record = StepRecord(
            step=n, loss=4.0, tokens_per_s=1.0, step_s=0.1, compute_s=0.1, wait_s=0.0, lr=1e-3,
            peak_mem_bytes=peak, rank=0, time=1000.0 + n,
        )  # fmt: skip
        progress.absorb(record, now=200.0 + n, offset=0.0)
    assert RankReport(**progress.fields()).peak_mem_bytes == 310 * 2**20


def test_a_forked_trainers_peak_is_its_own_not_the_zygotes():
    # the trainer's step record (its own reading) and the agent's RankReport.peak_rss (a
    # MemoryWatch from outside) both say the 30 MiB it touched, not the 230 MiB its RSS held
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        said = json.loads(proc.stdout.readline())
        trainer = psutil.Process(said["pid"])
        assert trainer.memory_info().rss > 200 * MiB  # the zygote's pages are in its RSS
        watch = MemoryWatch()
        watch.sample(trainer)
        for peak in (said["own"], watch.peak):
            assert 30 * MiB <= peak < 45 * MiB, peak / MiB
    finally:
        proc.communicate("\n", timeout=30)
