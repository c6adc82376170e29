"""The control plane at scale: N simulated ranks speaking the agents' protocol to a real
controller and redis-server (docs/architecture.md, "Parts"; issue 15).

Simulated workers (one device each by default) are registered as a join would leave them,
then driven from a few asyncio processes: each beats with the agents' own HEARTBEAT script at
--hz, follows its assignment pointer from the beat's answer, and reports its ranks running
(`worker:{wid}:progress`, the agents' RankReport, through their REPORT script) every few
seconds, as a training agent does. Jobs span the pool, one spare each. Each process
pipelines the beats that fall due in one tick (what an agent cannot do, but what lets a few
processes stand in for thousands).

Phases: register and place every job; measure for --seconds (sustained beats, GET job p99,
the controller's CPU per wall second); stop --kill simulated workers of running jobs and time
each detection (the recovery's decision minus the kill, both Redis server time); then 1,000
jobs submitted and cancelled, and Redis's memory per finished job (retention bounds it).

    python bench/scale.py [--ranks 16384] [--hz 2] [--procs 4] [--jobs 16] [--json]

Summary lines (stable): `sustained / asked heartbeats: X.XXx`, `detection p99: X.XX s
(dead_after_s D)`, `recovery decide: X.X ms p50, Y.Y ms max (jobs of N ranks + 1 spare)`
(detection to the new generation computed, written in the same transaction), `GET job p99:
X.X ms`, `controller CPU: X.XX cores`, `reconcile pass: X.X ms
CPU, Y.Y ms wall (mean of N)`; with --json, the last line is a JSON object with those numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import redis  # noqa: E402
import redis.asyncio as aredis  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.control_plane import TINY, local_stack, percentile  # noqa: E402
from services import scripts  # noqa: E402
from services.records import RankReport  # noqa: E402
from services.store import Keys, flat, heartbeat_args, loads  # noqa: E402

TICK_S = 0.05
REPORT_EVERY_S = 5.0  # progress reports of a running rank (hang_after_s is far above it)
DEAD_AFTER_S = 4.0


def wid(i: int) -> str:
    return f"sim{i:05d}"


def register(url: str, n: int, devices: int) -> None:
    """What the controller writes when an agent joins (simulated agents skip the join)."""
    r = redis.Redis.from_url(url, decode_responses=True)
    keys = Keys()
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        host = f"sim-host-{i // 8}"
        info = {
            "host": host,
            "address": "127.0.0.1",
            "labels": {"host": host},
            "devices": devices,
            "state": "idle",
            "memory_bytes": 1 << 36,
            "device_kind": "cpu",
            "joined_at": time.time(),
        }
        pipe.hset(keys.worker(wid(i)), mapping=flat(info))
        pipe.zadd(keys.workers_joined(), {wid(i): info["joined_at"]})
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()
    r.close()


class Sim:
    """One process's slice of simulated workers."""

    def __init__(self, url: str, ids: range, hz: float, dead, beats):
        self.url, self.ids, self.period = url, ids, 1.0 / hz
        self.dead, self.beats = dead, beats
        self.keys = Keys()
        self.serving: dict[int, tuple[str, int]] = {}  # sim -> (job, generation) it runs
        self.ranks: dict[int, list[int]] = {}  # sim -> its ranks in that generation
        self.reported: dict[int, float] = {}
        self.assignments: dict[tuple[str, int], dict[str, list[int]]] = {}  # -> wid -> ranks
        self.step = 0
        self.report_script = None  # REPORT, registered on the process's own client in `run`

    async def run(self) -> None:
        r = aredis.Redis.from_url(self.url, decode_responses=True)
        hb = r.register_script(scripts.HEARTBEAT)
        self.report_script = r.register_script(scripts.REPORT)
        n = len(self.ids)
        due = {i: time.monotonic() + self.period * k / n for k, i in enumerate(self.ids)}
        started = time.monotonic()
        while True:
            now = time.monotonic()
            self.step = int((now - started) / 1.0)  # one "training step" a second
            beating = [i for i, t in due.items() if t <= now and not self.dead[i]]
            if beating:
                async with r.pipeline(transaction=False) as pipe:
                    for i in beating:
                        job, gen = self.serving.get(i, ("", 0))
                        w = wid(i)
                        await hb(
                            keys=[self.keys.workers_seen(), self.keys.worker(w)],
                            args=heartbeat_args(self.keys, w, job, gen),
                            client=pipe,
                        )
                        due[i] += self.period
                    answers = await pipe.execute()
                with self.beats.get_lock():
                    self.beats.value += len(beating)
                for i, (_, pjob, pgen) in zip(beating, answers, strict=True):
                    await self._follow(r, i, pjob, int(pgen or 0))
            await self._report(r, now)
            await asyncio.sleep(TICK_S)

    async def _follow(self, r, i: int, job: str, gen: int) -> None:
        if (job, gen) == self.serving.get(i, ("", 0)):
            return
        if not job:
            self.serving.pop(i, None)
            self.ranks.pop(i, None)
            return
        ranks_of = self.assignments.get((job, gen))
        if ranks_of is None:  # once per generation for the whole slice, not once per sim
            asg = await r.hgetall(self.keys.job_assignment(job))
            ranks_of = {}
            for k, v in asg.items():
                if k.startswith("rank:"):
                    ranks_of.setdefault(loads(v, {}).get("wid"), []).append(int(k[5:]))
            self.assignments[(job, gen)] = ranks_of
        mine = ranks_of.get(wid(i), [])
        self.serving[i], self.ranks[i], self.reported[i] = (job, gen), mine, 0.0

    async def _report(self, r, now: float) -> None:
        due = [
            i
            for i, t in self.reported.items()
            if now - t >= REPORT_EVERY_S and self.ranks.get(i) and not self.dead[i]
        ]
        if not due:
            return
        server = time.time()
        async with r.pipeline(transaction=False) as pipe:
            for i in due:
                job, gen = self.serving[i]
                rep = RankReport(
                    state="running",
                    step=self.step,
                    loss=3.0,
                    step_s=1.0,
                    started_at=server,
                    first_step_at=server,
                    progress_at=server,
                ).model_dump(mode="json", exclude_none=True)
                fields = flat(
                    {
                        "job": job,
                        "generation": gen,
                        "state": "running",
                        "ranks": {str(n): rep for n in self.ranks[i]},
                        "updated_at": server,
                    }
                )
                await self.report_script(
                    keys=[self.keys.worker_progress(wid(i)), self.keys.workers_reported()],
                    args=[wid(i), *(x for kv in fields.items() for x in kv)],
                    client=pipe,
                )
                self.reported[i] = now
            await pipe.execute()


def simulate(url: str, ids: range, hz: float, dead, beats) -> None:
    asyncio.run(Sim(url, ids, hz, dead, beats).run())


def job_spec(n: int, ranks: int) -> dict:
    return {
        **TINY,
        "name": f"scale-{n}",
        "parallel": {"dp": ranks},
        "train": {"steps": 10**6, "global_batch": ranks},
        "fault_tolerance": {
            "spares": 1,
            "heartbeat_s": 0.5,
            "dead_after_s": DEAD_AFTER_S,
            "hang_after_s": 600,
            "straggler": {"action": "report"},
        },
    }


def until(ok, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16384, help="simulated ranks (= workers)")
    ap.add_argument("--hz", type=float, default=2.0, help="heartbeats per worker per second")
    ap.add_argument("--procs", type=int, default=4, help="simulating processes")
    ap.add_argument("--jobs", type=int, default=16, help="jobs spanning the pool")
    ap.add_argument("--seconds", type=float, default=30.0, help="measuring window")
    ap.add_argument("--kill", type=int, default=8, help="simulated workers stopped")
    ap.add_argument("--requests", type=int, default=500, help="GET /v1/jobs/{id} samples")
    ap.add_argument("--finished-jobs", type=int, default=1000)
    ap.add_argument("--json", action="store_true", help="a JSON summary as the last line")
    args = ap.parse_args()
    n, per_job = args.ranks, args.ranks // args.jobs - 1  # one spare each
    with local_stack(workers=0) as (stack, client):
        print(f"registering {n} simulated workers ...", flush=True)
        register(stack.redis_url, n, 1)
        dead = mp.Array("b", n, lock=False)
        beats = mp.Value("q", 0)
        step = -(-n // args.procs)
        sims = [
            mp.Process(
                target=simulate,
                args=(stack.redis_url, range(k, min(n, k + step)), args.hz, dead, beats),
                daemon=True,
            )
            for k in range(0, n, step)
        ]
        for p in sims:
            p.start()
        try:
            until(
                lambda: sum(w.alive for w in client.workers()) >= n,
                f"{n} simulated workers alive",
                120 + n / 100,
            )
            jobs = [client.submit(job_spec(k, per_job)).id for k in range(args.jobs)]
            print(f"{args.jobs} jobs of {per_job} ranks + 1 spare submitted ...", flush=True)
            until(
                lambda: all(client.job(j).phase == "Running" for j in jobs),
                "every job running",
                300,
            )
            ctl = psutil.Process(stack.procs["controller"].pid)
            print(f"measuring for {args.seconds:.0f} s and {args.requests} GETs ...", flush=True)
            passes0 = pass_totals(client)
            cpu0, b0, t0 = sum(ctl.cpu_times()[:2]), beats.value, time.monotonic()
            lat = []
            while time.monotonic() - t0 < args.seconds or len(lat) < args.requests:
                s = time.perf_counter()
                client.http.get(f"/v1/jobs/{jobs[len(lat) % len(jobs)]}").raise_for_status()
                lat.append(time.perf_counter() - s)
            wall = time.monotonic() - t0
            sustained = (beats.value - b0) / wall
            cpu = (sum(ctl.cpu_times()[:2]) - cpu0) / wall
            n_pass, pass_s, pass_cpu = (
                b - a for a, b in zip(passes0, pass_totals(client), strict=True)
            )
            print(f"stopping {args.kill} simulated workers, timing their detection ...", flush=True)
            detection, decide = detect(stack, client, jobs, dead, args.kill)
            mem = finished_memory(stack, client, args.finished_jobs)
        finally:
            for p in sims:
                p.terminate()
    asked = n * args.hz
    out = {
        "ranks": n,
        "asked_heartbeats_per_s": round(asked),
        "sustained_heartbeats_per_s": round(sustained),
        "detection_p99_s": round(percentile(detection, 99), 3),
        "ranks_per_job": per_job,
        "decide_p50_ms": round(percentile(decide, 50) * 1e3, 1),
        "decide_max_ms": round(max(decide) * 1e3, 1),
        "dead_after_s": DEAD_AFTER_S,
        "rest_p99_ms": round(percentile(lat, 99) * 1e3, 2),
        "controller_cpu_cores": round(cpu, 3),
        "passes": int(n_pass),
        "pass_ms": round(pass_s / n_pass * 1e3, 2),
        "pass_cpu_ms": round(pass_cpu / n_pass * 1e3, 2),
        **mem,
    }
    print(f"sustained / asked heartbeats: {sustained / asked:.2f}x ({sustained:,.0f}/{asked:,.0f})")
    print(f"detection p99: {out['detection_p99_s']:.2f} s (dead_after_s {DEAD_AFTER_S})")
    print(
        f"recovery decide: {out['decide_p50_ms']:.1f} ms p50, {out['decide_max_ms']:.1f} ms max "
        f"(jobs of {per_job} ranks + 1 spare)"
    )
    print(f"GET job p99: {out['rest_p99_ms']:.1f} ms")
    print(f"controller CPU: {cpu:.2f} cores")
    print(
        f"reconcile pass: {out['pass_cpu_ms']:.1f} ms CPU, {out['pass_ms']:.1f} ms wall "
        f"(mean of {out['passes']})"
    )
    print(
        f"redis memory: {mem['redis_bytes_after_finished'] / 2**20:.1f} MiB after "
        f"{args.finished_jobs} finished jobs ({mem['redis_bytes_per_finished_job']:,} B each)"
    )
    if args.json:
        print(json.dumps(out))


def pass_totals(client) -> tuple[float, float, float]:
    """The controller's reconcile passes so far: (count, wall seconds, CPU seconds)."""
    text = client.http.get("/metrics").raise_for_status().text
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def total(name: str, suffix: str) -> float:
        return next(s.value for s in fams[name].samples if s.name == name + suffix)

    wall, cpu = (
        "meshkeeper_scheduler_pass_duration_seconds",
        "meshkeeper_scheduler_pass_cpu_seconds",
    )
    return total(wall, "_count"), total(wall, "_sum"), total(cpu, "_sum")


def detect(stack, client, jobs: list[str], dead, k: int) -> tuple[list[float], list[float]]:
    """Stop one rank worker in each of `k` jobs: seconds from the stop to the recovery's
    decision, and from its detection to the new generation computed (`decide_s`)."""
    store = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    victims: dict[str, tuple[str, float]] = {}
    for jid in jobs[:k]:
        j = client.job(jid)
        w = j.mesh.ranks[0].worker
        s, us = store.time()
        dead[int(w[3:])] = 1
        victims[jid] = (w, s + us / 1e6)
    out, decide = [], []
    for jid, (w, stopped) in victims.items():
        until(lambda jid=jid: client.job(jid).recoveries, f"job {jid} to recover", 120)
        rec = client.job(jid).recoveries[0]
        assert w in {f.worker for f in rec.faults}, (w, rec.faults)
        out.append((rec.decided_at or rec.detected_at) - stopped)
        if rec.decided_at is not None:
            decide.append(rec.decided_at - rec.detected_at)
    store.close()
    return out, decide


def finished_memory(stack, client, n: int) -> dict:
    """Redis's memory before and after `n` jobs submitted and cancelled."""
    store = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    before = store.info("memory")["used_memory"]
    small = {**TINY, "train": {"steps": 1, "global_batch": 2}, "parallel": {"dp": 1}}
    ids = [client.submit({**small, "name": f"done-{i}"}).id for i in range(n)]
    for jid in ids:
        client.cancel(jid)
    until(lambda: all(client.job(j).phase == "Cancelled" for j in ids[-10:]), "the cancels", 120)
    after = store.info("memory")["used_memory"]
    store.close()
    return {
        "redis_bytes_after_finished": after,
        "redis_bytes_per_finished_job": (after - before) // n,
    }


if __name__ == "__main__":
    main()
