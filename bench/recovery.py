"""Recovery speed: meshkeeper's spare promotion vs torchrun's elastic restart; goodput under kills.

Both arms train the same workload in this invocation (the `small` preset, dp=2, a checkpoint
every 5 steps, async) and lose the same rank the same way: its trainer process is SIGKILLed
at the same steps (8, 18, 28, ...: three steps past a checkpoint). torchrun restarts from the
disk checkpoint and redoes those 3 steps; meshkeeper restores from the in-memory snapshots
(docs/architecture.md, "Hot recovery": the survivors from their own host memory, the
replacement from its buddy's copy) and redoes at most the one step in flight.

- meshkeeper: a local stack (redis-server, controller, 3 agents: 2 ranks + 1 spare). The
  controller promotes the spare into the dead rank's coordinates; the job's recovery records
  give each phase (detect, decide, rendezvous, restore, first step). Each kill waits until
  the agents' warm trainers are refilled (the steady state of a long job).
- torchrun: `torchrun --standalone --max-restarts N` over the same trainer with the same
  checkpoint directory, so each restart resumes from the last committed checkpoint. By
  default with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, torch's own workaround for
  pytorch/pytorch#135712: with the rendezvous store shared (torch's default), a restarted
  gloo world reads the previous attempt's addresses, and the restart fails in connectFullMesh
  ("Connection refused") or hangs until the process-group timeout (seen here: 3 attempts and
  28 s for one kill, no step within 240 s for the next). `--torchrun-shared-store` measures
  that default instead.

The headline, measured the same way for both arms from the trainers' own metrics files:
kill -> the slowest rank's first completed step after the restart. Beside it, the healthy
ranks' stall: kill -> each surviving rank's next finished step, the median over those ranks.
meshkeeper keeps a surviving rank's process (worker/trainer/handoff.py: it restores from its
own snapshot in place); torchrun restarts every rank.

Goodput (useful step time / wall time, from submit to Succeeded) of one meshkeeper job with
a rank killed every --every seconds, against the same job without failures.

    python bench/recovery.py [--kills 5] [--every 60] [--goodput-steps 300]
                             [--torchrun-shared-store]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ENV, ROOT, spec_file  # noqa: E402
from bench.control_plane import local_stack, median, percentile  # noqa: E402
from services.procs import descendants  # noqa: E402

EVERY = 5
RESTART_TIMEOUT_S = 240.0  # above the trainer's 60 s process-group timeout: one hung attempt fits
PHASES = ("detect_s", "decide_s", "rendezvous_s", "restore_s", "first_step_s", "total_s")
TERMINAL = ("Succeeded", "Failed", "Cancelled")


def workload(steps: int, name: str = "bench-recovery") -> dict:
    return {
        "name": name,
        "model": {"preset": "small"},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 2},
        "train": {"steps": steps, "global_batch": 4, "lr": 1e-3, "warmup_steps": 2},
        "checkpoint": {"every_steps": EVERY, "mode": "async"},
        # straggler replacement off: run-queue noise on a shared host is not the fault measured here
        "fault_tolerance": {
            "spares": 1,
            "dead_after_s": 2.0,
            "hang_after_s": 60,
            "straggler": {"action": "report"},
            "max_restarts": 1000,
        },
    }


def kill_steps(kills: int) -> list[int]:
    return [EVERY + 3 + 2 * EVERY * i for i in range(kills)]


# -- metrics files ------------------------------------------------------------------------
def read(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def is_step(r: dict) -> bool:
    return "step" in r and "event" not in r


def first_step_after_start(recs: list[dict], after: float) -> float | None:
    """Time of the first step completed by a trainer that started after `after`."""
    started = False
    for r in recs:
        if r.get("event") == "started" and r.get("started_at", 0) >= after:
            started = True
        elif started and is_step(r):
            return r["time"]
    return None


def wait(pred, timeout: float, what: str, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")


def summary(name: str, xs: list[float]) -> str:
    return (
        f"{name:<14} median {median(xs):7.2f} s   p90 {percentile(xs, 90):7.2f} s   (n={len(xs)})"
    )


# -- meshkeeper arm -----------------------------------------------------------------------
def warm_pools_ready(run_dir: Path) -> bool:
    logs = list((run_dir / "workers").glob("*/zygote.log"))
    return bool(logs) and all("trainer zygote ready" in p.read_text(errors="replace") for p in logs)


def slowest_step(run_dir: Path, jid: str, generation: int, world: int) -> int:
    """The step every rank of the generation has completed (0 before that)."""
    files = list(run_dir.glob(f"workers/*/jobs/{jid}/g{generation}/metrics-*.jsonl"))
    per_rank = [max((r["step"] for r in read(f) if is_step(r)), default=0) for f in files]
    return min(per_rank) if len(per_rank) == world else -1


def first_steps(run_dir: Path, jid: str, generation: int, world: int) -> dict[int, float] | None:
    """Each rank's first finished step in `generation` (None until every rank has one)."""
    files = list(run_dir.glob(f"workers/*/jobs/{jid}/g{generation}/metrics-*.jsonl"))
    firsts = {
        int(f.stem.rpartition("-")[2]): next((r["time"] for r in read(f) if is_step(r)), None)
        for f in files
    }
    if len(files) < world or None in firsts.values():
        return None
    return firsts


def healthy_stall(firsts: dict[int, float], victim: int, t_kill: float) -> float:
    """Kill -> each surviving rank's next finished step, the median over those ranks: how long
    the ranks nothing happened to stood still."""
    return median([t - t_kill for r, t in firsts.items() if r != victim])


def meshkeeper_arm(kills: int) -> tuple[list[float], list[float], list[dict]]:
    """kill -> slowest rank's first step, and the healthy ranks' stall, per kill; and the
    job's recovery records."""
    at = kill_steps(kills)
    spec = workload(at[-1] + 2 * EVERY)
    out, stalls = [], []
    with local_stack(3) as (stack, client):
        run_dir = stack.cfg.run_dir
        wait(lambda: warm_pools_ready(run_dir), 180, "warm trainers")
        jid = client.submit(spec).id
        for i, step in enumerate(at):
            gen = i + 1
            wait(lambda gen=gen: client.job(jid).mesh.generation == gen, 120, f"generation {gen}")
            # every rank past the kill step, and every agent's warm trainer refilled
            wait(
                lambda gen=gen, step=step: (
                    slowest_step(run_dir, jid, gen, 2) >= step and warm_pools_ready(run_dir)
                ),
                300,
                f"step {step} of generation {gen}",
            )
            victim = next(r for r in client.job(jid).mesh.ranks if r.rank == 1)
            t_kill = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            firsts = wait(
                lambda gen=gen: first_steps(run_dir, jid, gen + 1, 2),
                300,
                f"generation {gen + 1}'s first step",
            )
            out.append(max(firsts.values()) - t_kill)
            stalls.append(healthy_stall(firsts, 1, t_kill))
            print(
                f"  meshkeeper kill {i + 1} at step {step}: first step after {out[-1]:.2f} s "
                f"(healthy ranks stalled {stalls[-1]:.2f} s)",
                flush=True,
            )
        j = wait(lambda: (j := client.job(jid)).phase in TERMINAL and j, 600, "the job to end")
        if j.phase != "Succeeded":
            raise SystemExit(
                f"bench job ended {j.phase}: "
                f"{[c.message for c in j.conditions if c.status == 'True']}"
            )
        records = [r.model_dump() for r in j.recoveries]
        # the survivor's agent keeps its process (worker/trainer/handoff.py): one event a kill
        kept = sum(e.reason == "TrainerKept" for e in client.events(jid, limit=1000))
    unexpected = [r["cause"] for r in records if r["cause"] != "TrainerKilled"]
    if unexpected or len(records) != kills:
        raise SystemExit(
            f"expected {kills} TrainerKilled recoveries, got {[r['cause'] for r in records]}"
        )
    print(f"  meshkeeper kept the healthy rank's process in {kept} of {kills} recoveries")
    return out, stalls, records


# -- torchrun arm -------------------------------------------------------------------------
def rank_pids(launcher: int) -> dict[int, int]:
    """RANK -> pid of torchrun's live worker processes."""
    out = {}
    for k in descendants(launcher):
        try:
            env = Path(f"/proc/{k}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None and state != "Z":
            out[rank] = k
    return out


def torchrun_arm(kills: int, shared_store: bool) -> tuple[list[float], list[float], list[int]]:
    """kill -> slowest rank's first step, and the healthy rank's stall, per kill; and the
    restart attempts each took."""
    at = kill_steps(kills)
    spec = workload(at[-1] + 2 * EVERY)
    out, stalls, attempts = [], [], []
    with tempfile.TemporaryDirectory(prefix="mk-bench-torchrun-") as d:
        d = Path(d)
        # a restart may take more than one attempt (see below): room for three per kill
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            f"--max-restarts={max(3, 3 * kills)}",
            "--monitor-interval=0.1",
            "-m",
            "worker.trainer",
            "--spec",
            str(spec_file(spec, d)),
            "--quiet",
            "--metrics-out",
            str(d / "steps-{rank}.jsonl"),
            "--checkpoint-root",
            str(d / "ckpt"),
        ]
        log = (d / "torchrun.log").open("w")
        env = ENV if shared_store else {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        files = [d / "steps-0.jsonl", d / "steps-1.jsonl"]
        try:
            since = 0.0
            for i, step in enumerate(at):

                def reached(since=since, step=step) -> bool:
                    steps = [
                        max(
                            (r["step"] for r in read(f) if is_step(r) and r["time"] >= since),
                            default=0,
                        )
                        for f in files
                    ]
                    if proc.poll() is not None:
                        raise SystemExit(
                            f"torchrun exited ({proc.returncode}); see {d}/torchrun.log:\n"
                            + (d / "torchrun.log").read_text()[-3000:]
                        )
                    return min(steps) >= step

                wait(reached, 600, f"torchrun at step {step}")
                victim = rank_pids(proc.pid)[1]
                t_kill = time.time()
                os.kill(victim, signal.SIGKILL)

                def restarted(i=i, t_kill=t_kill) -> float | None:
                    if proc.poll() is not None:
                        raise SystemExit(
                            f"torchrun exited ({proc.returncode}) after kill {i + 1}:\n"
                            + (d / "torchrun.log").read_text()[-3000:]
                        )
                    firsts = {
                        r: first_step_after_start(read(f), t_kill) for r, f in enumerate(files)
                    }
                    return None if None in firsts.values() else firsts

                try:
                    first = wait(
                        restarted, RESTART_TIMEOUT_S, f"torchrun's first step after kill {i + 1}"
                    )
                except SystemExit:
                    # with the shared store an attempt can hang in connectFullMesh until the
                    # process-group timeout (docs/architecture.md, "Parts"): report it, do not
                    # wait forever
                    print(
                        f"  torchrun   kill {i + 1} at step {step}: no step within "
                        f"{RESTART_TIMEOUT_S:.0f} s "
                        f"(hung restart; see {d}/torchrun.log)",
                        flush=True,
                    )
                    out.append(float("inf"))
                    break
                out.append(max(first.values()) - t_kill)
                stalls.append(healthy_stall(first, 1, t_kill))
                since = t_kill
                # attempts: trainer starts after the kill; with the shared store an attempt may
                # die in connectFullMesh (the store still holds the last attempt's addresses)
                tries = max(
                    sum(r.get("event") == "started" and r["started_at"] >= t_kill for r in read(f))
                    for f in files
                )
                attempts.append(tries)
                print(
                    f"  torchrun   kill {i + 1} at step {step}: first step after {out[-1]:.2f} s "
                    f"({tries} restart attempt{'s' if tries > 1 else ''})",
                    flush=True,
                )
            if out[-1] != float("inf") and proc.wait(timeout=600) != 0:
                raise SystemExit(
                    f"torchrun failed ({proc.returncode}):\n"
                    + (d / "torchrun.log").read_text()[-3000:]
                )
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    return out, stalls, attempts


# -- goodput ------------------------------------------------------------------------------
def goodput(steps: int, every_s: float | None) -> tuple[float, int]:
    """(useful step time / wall time, kills) of one job; a rank killed every `every_s`."""
    spec = workload(steps, "bench-goodput")
    with local_stack(3) as (stack, client):
        run_dir = stack.cfg.run_dir
        wait(lambda: warm_pools_ready(run_dir), 180, "warm trainers")
        jid = client.submit(spec).id
        kills, next_kill = 0, None
        while True:
            j = client.job(jid)
            if j.phase in TERMINAL:
                break
            running = j.mesh.ranks and all(r.state == "running" and r.pid for r in j.mesh.ranks)
            if every_s and running and next_kill is None:
                next_kill = time.monotonic() + every_s
            if (
                every_s
                and running
                and next_kill
                and time.monotonic() >= next_kill
                and j.step < steps - 2
            ):
                os.kill(next(r.pid for r in j.mesh.ranks if r.rank == 1), signal.SIGKILL)
                kills, next_kill = kills + 1, None
                wait(
                    lambda j=j: (
                        client.job(jid).generation > j.generation
                        or client.job(jid).phase in TERMINAL
                    ),
                    60,
                    "the recovery to start",
                )
            time.sleep(0.05)
        if j.phase != "Succeeded":
            raise SystemExit(f"goodput job ended {j.phase}")
        # useful: each step once, as the newest generation that ran it timed it
        curve: dict[int, float] = {}
        for g in range(1, j.generation + 1):
            for f in run_dir.glob(f"workers/*/jobs/{jid}/g{g}/metrics-0.jsonl"):
                for r in read(f):
                    if is_step(r):
                        curve[r["step"]] = r["step_s"]
        return sum(curve.values()) / (j.finished_at - j.submitted_at), kills


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--every", type=float, default=60.0, help="goodput run: seconds between kills")
    ap.add_argument("--goodput-steps", type=int, default=300)
    ap.add_argument("--skip-goodput", action="store_true")
    ap.add_argument(
        "--torchrun-shared-store",
        action="store_true",
        help="torchrun's default rendezvous store sharing (restarts may fail or hang)",
    )
    args = ap.parse_args()
    t0 = time.time()
    print(
        f"recovery after SIGKILL of rank 1's trainer, small preset dp=2, {args.kills} kills, "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    mk, mk_stalls, records = meshkeeper_arm(args.kills)
    tr, tr_stalls, attempts = torchrun_arm(args.kills, args.torchrun_shared_store)
    print("\nmeshkeeper phases (recovery records; total = fault -> slowest rank's first step):")
    for k in PHASES:
        print("  " + summary(k[:-2], [r["durations"][k] for r in records]))
    print(f"  steps redone per kill: {sorted(r['steps_lost'] for r in records)}")
    print("\nkill -> slowest rank's first step after the restart (trainers' metrics files):")
    print("  " + summary("meshkeeper", mk))
    done = [t for t in tr if t != float("inf")]
    if done:
        print(
            "  "
            + summary("torchrun", done)
            + ("" if args.torchrun_shared_store else "  (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)")
        )
        print(
            f"  torchrun / meshkeeper: {median(done) / median(mk):.1f}x (median), "
            f"{percentile(done, 90) / percentile(mk, 90):.1f}x (p90)"
        )
    if attempts:
        print(
            f"  torchrun restart attempts per kill: {attempts} (an attempt that fails in gloo's "
            f"connectFullMesh costs a cold start; docs/architecture.md, 'Parts')"
        )
    if len(done) < len(tr):
        print(f"  torchrun: restart {len(tr)} hung (no step within {RESTART_TIMEOUT_S:.0f} s)")
    print("\nkill -> each surviving rank's next finished step (median over the surviving ranks):")
    print("  " + summary("meshkeeper", mk_stalls))
    if tr_stalls:
        print("  " + summary("torchrun", tr_stalls))
    if not args.skip_goodput:
        base, _ = goodput(args.goodput_steps, None)
        chaos, n = goodput(args.goodput_steps, args.every)
        print(
            f"\ngoodput (useful step time / wall, submit -> Succeeded), {args.goodput_steps} steps:"
        )
        print(f"  no failures:              {base:.3f}")
        print(
            f"  a kill every {args.every:.0f} s ({n} kills): {chaos:.3f}   "
            f"({chaos / base:.1%} of the failure-free run)"
        )
    print(f"\n(bench took {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
