"""REST latency of GET /v1/jobs/{id} while 1,000 simulated workers heartbeat into Redis.

One invocation, one stack (redis-server + controller, no real agents):
  1. 1,000 simulated workers register and heartbeat (the agents' own Lua script, every 0.5 s)
     from a separate process; the controller places a 16-rank job on them.
  2. idle baseline: the heartbeats pause; N sequential GETs of the job.
  3. load: the heartbeats resume (~2,000 Redis writes/s); the same N GETs.
Prints p50/p99 of both and the loaded/idle ratios.

    python bench/rest_latency.py [--workers 1000] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio as aredis  # noqa: E402

from bench.control_plane import TINY, local_stack, percentile  # noqa: E402
from services import scripts  # noqa: E402
from services.store import Keys, flat, heartbeat_args  # noqa: E402

JOB = {
    **TINY,
    "name": "rest-bench",
    "parallel": {"dp": 4, "pp": 2, "tp": 2, "microbatches": 2},
    "train": {"steps": 1000, "global_batch": 32},
}


async def _heartbeats(url: str, n: int, interval: float, beating, beats) -> None:
    pool = aredis.BlockingConnectionPool.from_url(url, decode_responses=True, max_connections=64)
    r = aredis.Redis(connection_pool=pool)
    keys, hb = Keys(), r.register_script(scripts.HEARTBEAT)
    async with r.pipeline(transaction=False) as pipe:
        for i in range(n):
            # what the controller writes when an agent joins (as user admin: simulated agents
            # skip the join; `joined_at` makes them placeable)
            pipe.hset(
                keys.worker(f"sim{i}"),
                mapping=flat(
                    {
                        "host": f"sim-host-{i // 8}",
                        "address": "127.0.0.1",
                        "labels": {"host": f"sim-host-{i // 8}"},
                        "devices": 1,
                        "state": "idle",
                        "memory_bytes": 1 << 34,
                        "device_kind": "cpu",
                        "joined_at": time.time(),
                    }
                ),
            )
        await pipe.execute()

    async def worker(i: int) -> None:
        await asyncio.sleep(interval * i / n)  # spread the beats evenly
        while True:
            if beating.value:
                await hb(
                    keys=[keys.workers_seen(), keys.worker(f"sim{i}")],
                    args=heartbeat_args(keys, f"sim{i}", "", 0),
                )
                with beats.get_lock():
                    beats.value += 1
            await asyncio.sleep(interval)

    await asyncio.gather(*(worker(i) for i in range(n)))


def heartbeater(url: str, n: int, interval: float, beating, beats) -> None:
    asyncio.run(_heartbeats(url, n, interval, beating, beats))


def until(ok, sim: mp.Process, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if not sim.is_alive() or time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} (heartbeater alive: {sim.is_alive()})")
        time.sleep(0.2)


def measure(client, job: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.http.get(f"/v1/jobs/{job}").raise_for_status()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    with local_stack(workers=0) as (stack, client):
        beating, beats = mp.Value("b", 1), mp.Value("q", 0)
        sim = mp.Process(
            target=heartbeater,
            args=(stack.redis_url, args.workers, 0.5, beating, beats),
            daemon=True,
        )
        sim.start()
        try:
            until(
                lambda: sum(w.alive for w in client.workers()) >= args.workers,
                sim,
                f"{args.workers} simulated workers to register",
            )
            job = client.submit(JOB).id
            until(lambda: client.job(job).phase == "Running", sim, "the job to be placed")
            beating.value = 0
            time.sleep(1.0)
            idle = measure(client, job, args.requests)
            beating.value = 1
            time.sleep(1.0)
            b0, t0 = beats.value, time.perf_counter()
            loaded = measure(client, job, args.requests)
            rate = (beats.value - b0) / (time.perf_counter() - t0)
        finally:
            sim.terminate()
            sim.join()
    ms = 1e3
    i50, i99, l50, l99 = (
        percentile(idle, 50) * ms,
        percentile(idle, 99) * ms,
        percentile(loaded, 50) * ms,
        percentile(loaded, 99) * ms,
    )
    print(f"GET /v1/jobs/{{id}} (16-rank job), {args.requests} sequential requests each:")
    print(f"  idle baseline:                 p50 {i50:7.2f} ms   p99 {i99:7.2f} ms")
    print(
        f"  {args.workers} workers heartbeating:  p50 {l50:7.2f} ms   p99 {l99:7.2f} ms"
        f"   ({rate:,.0f} heartbeats/s)"
    )
    print(f"  loaded / idle:                 p50 {l50 / i50:7.2f}x     p99 {l99 / i99:7.2f}x")


if __name__ == "__main__":
    main()
