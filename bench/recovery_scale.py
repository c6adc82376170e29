"""How recovery grows with the job: the same kill at 4, 8, 16 and 32 ranks, phase by phase.

Each size is a local stack of N + 1 agents (N ranks and one spare, one device each) training
the `tiny` preset at dp = N, one thread per rank (gloo on this machine's cores). Rank 1's
trainer is SIGKILLed a few steps past a checkpoint, `--kills` times; the spare takes its
place in a new process, and every other rank takes the new generation in its own process
(worker/trainer/handoff.py; docs/fault-tolerance.md, "How recovery grows"). Each phase is
read from the new generation's milestones (every rank's metrics file; the slowest rank
gates each one) and the job's recovery record:

- detect: the kill -> the controller's fault record;
- decide: -> the new generation's assignment;
- launch: -> the last rank's trainer started (agents saw the assignment, forked a warm
  trainer for the spare, handed the others their order);
- store+world: -> the last rank's world group formed (TCPStore rendezvous, gloo full mesh);
- mesh groups: -> the last rank's DeviceMesh groups;
- build+groups: -> the model built and the checkpoint and snapshot groups formed;
- restore: -> the last rank restored (own memory, or the buddy's copy for the spare);
- first step: -> the last rank's first step after the restore;
- healthy step (not part of the total): the median step time before the kill, at the slowest
  rank, what the first step compares with.

After the kills, each size prints how many keys the job's one rendezvous store holds (a
TCPStore drops none: controller/apply.py `STORE_GENERATIONS` bounds the generations it serves).

Every phase is fitted as t = a * N^b over the sizes (least squares in log-log), and projected
to 1k, 16k and 100k ranks from the largest size measured. Gloo on one host cannot show what
grows at real scale on other parts (NCCL communicator init, a TCPStore serving thousands of
clients): docs/fault-tolerance.md sets published figures for those beside this projection.

    python bench/recovery_scale.py [--sizes 4 8 16 32] [--kills 2]

The last line is stable: `recovery growth 4 -> 32 ranks: X.XXx (kill to first step)`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.control_plane import local_stack, median, warm_ready  # noqa: E402
from bench.recovery import TERMINAL, first_steps, is_step, read, slowest_step, wait  # noqa: E402

EVERY = 4  # checkpoint interval; each kill lands 2 steps past a checkpoint
PHASES = (
    "detect",
    "decide",
    "launch",
    "store+world",
    "mesh groups",
    "build+groups",
    "restore",
    "first step",
)
PROJECT_TO = (1_000, 16_000, 100_000)


def workload(world: int, steps: int) -> dict:
    return {
        "name": f"bench-scale-{world}",
        "model": {"preset": "tiny"},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": world},
        "train": {"steps": steps, "global_batch": world, "lr": 1e-3, "warmup_steps": 2},
        "checkpoint": {"every_steps": EVERY, "mode": "async"},
        "fault_tolerance": {
            "spares": 1,
            "dead_after_s": 2.0,
            "hang_after_s": 120,
            # run-queue noise of 2N processes on a few cores is not the fault measured here
            "straggler": {"action": "report"},
            "max_restarts": 100,
        },
    }


def milestones(run_dir: Path, jid: str, generation: int) -> dict[str, float]:
    """Each milestone of the generation at its slowest rank (the latest time over ranks)."""
    latest: dict[str, float] = {}
    for f in run_dir.glob(f"workers/*/jobs/{jid}/g{generation}/metrics-*.jsonl"):
        records = read(f)
        first = next((r["time"] for r in records if is_step(r)), None)
        found = {"first": first}
        for r in records:
            event = r.get("event")
            if event == "started":
                found["started"] = r["started_at"]
            elif event == "rendezvous":
                found["world"], found["mesh"] = r.get("world_at"), r["rendezvous_at"]
            elif event == "groups" and "groups" not in found:
                found["groups"] = r.get("at")
            elif event == "ready":
                found["ready"] = r["ready_at"]
        for key, t in found.items():
            if t is None:
                raise SystemExit(f"{f}: no {key} milestone (a trainer older than this bench?)")
            latest[key] = max(latest.get(key, t), t)
    return latest


def healthy_step(run_dir: Path, jid: str, generation: int) -> float:
    """The generation's median step time at its slowest rank, before the kill: what the
    first step after a recovery compares with (N ranks' compute shares this host's cores)."""
    per_rank = []
    for f in run_dir.glob(f"workers/*/jobs/{jid}/g{generation}/metrics-*.jsonl"):
        times = [r["time"] for r in read(f) if is_step(r)]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        if gaps:
            per_rank.append(median(gaps))
    if not per_rank:
        raise SystemExit(f"generation {generation} of {jid}: no two steps on any rank")
    return max(per_rank)


def phases(t_kill: float, record: dict, m: dict[str, float]) -> dict[str, float]:
    chain = [
        t_kill,
        record["detected_at"],
        record["decided_at"],
        m["started"],
        m["world"],
        m["mesh"],
        m["groups"],
        m["ready"],
        m["first"],
    ]
    out = {name: b - a for name, a, b in zip(PHASES, chain[:-1], chain[1:], strict=True)}
    out["total"] = m["first"] - t_kill
    return out


def one_size(world: int, kills: int) -> list[dict[str, float]]:
    at = [EVERY * (i + 1) + 2 for i in range(kills)]
    # steps to spare after the last kill: the job's store is read while the job still runs
    spec = workload(world, at[-1] + 3 * EVERY)
    out = []
    with local_stack(world + 1) as (stack, client):
        run_dir = stack.cfg.run_dir
        warm_ready(stack, world + 1, timeout=900)
        jid = client.submit(spec).id
        for i, step in enumerate(at):
            gen = i + 1
            wait(lambda gen=gen: client.job(jid).mesh.generation == gen, 300, f"generation {gen}")
            wait(
                lambda gen=gen, step=step: slowest_step(run_dir, jid, gen, world) >= step,
                900,
                f"step {step} of generation {gen}",
            )
            victim = next(r for r in client.job(jid).mesh.ranks if r.rank == 1)
            t_kill = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            wait(
                lambda gen=gen: first_steps(run_dir, jid, gen + 1, world),
                900,
                f"generation {gen + 1}'s first step",
            )
            keys = store_keys(client.job(jid).mesh.rendezvous)
            record = wait(
                lambda gen=gen: (rs := client.job(jid).recoveries) and len(rs) == gen and rs[-1],
                60,
                f"recovery record {gen}",
            ).model_dump()
            if record["cause"] != "TrainerKilled":
                raise SystemExit(f"{world} ranks, kill {gen}: recovery for {record['cause']}")
            out.append(phases(t_kill, record, milestones(run_dir, jid, gen + 1)))
            out[-1]["healthy step"] = healthy_step(run_dir, jid, gen)
            print(
                f"  {world:>3} ranks kill {gen}: "
                + "  ".join(f"{k} {v:.2f}" for k, v in out[-1].items()),
                flush=True,
            )
        # what the job's one store holds after every generation so far: a TCPStore drops no
        # key, which is why a store serves at most STORE_GENERATIONS (controller/apply.py)
        print(
            f"  {world:>3} ranks: the job's store held {keys} keys after {kills + 1} generations",
            flush=True,
        )
        client.cancel(jid)
        wait(lambda: client.job(jid).phase in TERMINAL, 120, "the job to stop")
    return out


def store_keys(rendezvous: str) -> int:
    """The number of keys in the TCPStore at `rendezvous` (host:port), as a client sees it."""
    import torch.distributed as dist  # here: only this line needs torch

    host, port = rendezvous.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10)).num_keys()


def exponent(sizes: list[int], times: list[float]) -> float:
    """b of t = a * N^b, least squares in log-log (times floored at 1 ms: a phase that
    takes nothing measurable does not grow)."""
    xs = [math.log(n) for n in sizes]
    ys = [math.log(max(t, 1e-3)) for t in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--kills", type=int, default=2)
    args = ap.parse_args()
    if len(args.sizes) < 2:
        ap.error("--sizes: at least two sizes to fit a growth")
    medians: dict[int, dict[str, float]] = {}
    names = (*PHASES, "total", "healthy step")
    for n in args.sizes:
        runs = one_size(n, args.kills)
        medians[n] = {k: median([r[k] for r in runs]) for k in names}
    print("\nphase (median s)  " + "".join(f"{n:>9}" for n in args.sizes) + "   growth N^b")
    fits = {}
    for k in names:
        fits[k] = exponent(args.sizes, [medians[n][k] for n in args.sizes])
        row = "".join(f"{medians[n][k]:9.3f}" for n in args.sizes)
        print(f"{k:<17} {row}   b = {fits[k]:5.2f}")
    big = args.sizes[-1]
    cores = os.cpu_count() or 1
    print(
        f"\nprojected from {big} ranks by each phase's fit, in s. Here {big} ranks share {cores} "
        "cores, so a phase of per-rank work (launch, build, restore, first step) grows with the "
        "oversubscription, which a cluster's own cores per rank do not have: its exponent is an "
        "upper bound. docs/fault-tolerance.md sets published figures beside these."
    )
    print("phase            " + "".join(f"{n:>11,}" for n in PROJECT_TO))
    for k in names[:-1]:  # the healthy step is the host's, not the recovery's
        row = "".join(f"{medians[big][k] * (n / big) ** fits[k]:11.3g}" for n in PROJECT_TO)
        print(f"{k:<17}{row}")
    first, last = args.sizes[0], args.sizes[-1]
    growth = medians[last]["total"] / medians[first]["total"]
    print(f"recovery growth {first} -> {last} ranks: {growth:.2f}x (kill to first step)")


if __name__ == "__main__":
    main()
