"""`peak_mem_bytes` (docs/architecture.md, "Records"): this process's own peak, and the way it
travels from the trainer's step record into the agent's RankReport."""

from __future__ import annotations

import psutil

from services.records import RankReport, StepRecord
from worker.agent.rank_progress import RankProgress
from worker.peak_rss import high_water_mark


def test_a_freed_allocation_still_counts_in_the_peak():
    resident = psutil.Process().memory_info().rss
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
