"""A job's `fault_tolerance.heartbeat_s` is what its agents beat at (worker/agent/agent.py,
`heartbeat_interval`; docs/architecture.md, "Parts"): measured on the agents' own heartbeat
counters, a worker serving a job that asks for 0.1 s (as a rank or as its spare) beats several
times as often as an idle one at the agents' 0.5 s default, and returns to the default once the
job ends."""

from __future__ import annotations

import time

from tests.observability.exposition import value
from tests.stack import tiny_spec, wait_phase, wait_until

WINDOW_S = 3.0


def beat_rates(stack, workers: list[str]) -> dict[str, float]:
    """Heartbeats per second of each worker over the same WINDOW_S, from its /metrics."""

    def counts() -> dict[str, float]:
        return {w: value(stack.scrape(w), "meshkeeper_agent_heartbeats_total") for w in workers}

    t0, first = time.monotonic(), counts()
    time.sleep(WINDOW_S)
    t1, last = time.monotonic(), counts()
    return {w: (last[w] - first[w]) / (t1 - t0) for w in workers}


def test_agents_beat_at_their_jobs_heartbeat_s(stack):
    spec = tiny_spec(
        "beat-fast",
        train={"steps": 400},
        checkpoint={"every_steps": 400},
        fault_tolerance={"heartbeat_s": 0.1, "dead_after_s": 2.0, "spares": 1},
    )
    job = stack.client.submit(spec).id
    try:
        j = wait_until(
            lambda: (j := stack.client.job(job)).mesh.ranks and j.mesh.spares and j,
            60,
            "the job placed, with its spare",
        )
        # ranks and the spare: an agent follows its job's heartbeat_s from the assignment on
        serving = sorted({r.worker for r in j.mesh.ranks} | set(j.mesh.spares))
        idle = stack.idle_workers()[:1]
        assert len(serving) == 3 and idle, (serving, idle)
        rates = beat_rates(stack, serving + idle)
        assert stack.client.job(job).phase == "Running"  # measured while it served the job
        for w in serving:  # 10/s asked, 2/s idle: a wide margin for a loaded host
            assert rates[w] > 2.5 * rates[idle[0]], rates
    finally:
        stack.client.cancel(job)
    wait_phase(stack.client, job, ("Cancelled",), 60)
    wait_until(lambda: set(serving) <= set(stack.idle_workers()), 60, f"{serving} idle again")
    rates = beat_rates(stack, serving + idle)
    for w in serving:  # back at the default: about the idle worker's rate
        assert rates[w] < 1.6 * rates[idle[0]], rates
