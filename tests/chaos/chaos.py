"""What the chaos tests share: specs, a watcher of the REST status, precise kills, and the
stitched loss curve of a job that went through several generations.

The stitched curve: for every step, the record of the newest generation that ran it, read
from rank 0's metrics file of each generation (`{run_dir}/jobs/{job}/g{gen}/metrics-0.jsonl`
on whichever worker hosted rank 0 then). It is compared with an uninterrupted standalone run of
the same spec (tests/launch.py), bit for bit when the mesh never changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from controller.scheduler import Scheduler, SchedulerConfig
from services.api import JobStatus
from tests.stack import ROOT, TERMINAL, Stack, process_groups_alive, tiny_spec, wait_until

# A checkpoint every 5 steps; 15 steps leave room for a fault after the first commit (5) and
# a resume that still has steps to train. Scenarios that need a longer job say so.
STEPS, EVERY = 15, 5
# The mesh of the scenarios whose subject needs tensor parallelism: a TP shard restored from
# its buddy's copy, two replicas hit at once, a shrink that keeps a TP partner as a spare, a
# watchdog abort inside TP groups. The others run dp2: every rank of a generation is a fresh
# process (a torch import each, the suite's largest cost), and dp2 x tp2 doubles them.
DP_TP = {"dp": 2, "tp": 2}


def mesh_spec(
    name: str, *, steps: int = STEPS, parallel: dict | None = None, train: dict | None = None, **ft
) -> dict:
    """A tiny dp2 job (or `parallel`) with one spare, a checkpoint every 5 steps (async saves).

    Straggler replacement is off (`report`) except where a test is about stragglers: on a
    shared, oversubscribed 2-core host, run-queue noise alone has pushed one healthy rank of
    four past 1.5x the median (1.59x over 20 steps, with the earlier windowed-mean criterion),
    and an unplanned recovery is not what these tests are about.

    Quarantine is 0 s (the health probe still runs before a blamed worker returns): the
    session's 8 workers are shared by every test, and the next one should find them all.
    tests/chaos/test_blame.py tests the quarantine itself.
    """
    return tiny_spec(
        name,
        parallel=parallel or {"dp": 2},
        train={"steps": steps, **(train or {})},
        checkpoint={"every_steps": EVERY, "mode": "async"},
        fault_tolerance={
            "spares": 1,
            "dead_after_s": 2.0,
            "hang_after_s": 30,
            "quarantine_s": 0,
            "straggler": {"action": "report"},
            **ft,
        },
    )


def disk_only(spec: dict) -> dict:
    """The spec without in-memory snapshots: for tests of what the disk checkpoint and its
    pointer guarantee, every recovery restores from disk (docs/architecture.md, "Hot
    recovery")."""
    return {**spec, "snapshot": {"enabled": False}}


# -- watching the job through REST --------------------------------------------------------
class Watch:
    """Polls GET /v1/jobs/{id} and keeps what it saw: generations, restarts and the
    checkpoint pointer may only ever move forward."""

    def __init__(self, stack: Stack, jid: str):
        self.stack, self.jid = stack, jid
        self.seen: list[JobStatus] = []
        self.pointers: list[
            tuple[int, int]
        ] = []  # (generation, step) of last_checkpoint, as it moved

    def poll(self) -> JobStatus:
        j = self.stack.client.job(self.jid)
        self.seen.append(j)
        ck = j.last_checkpoint
        if ck is not None and (not self.pointers or self.pointers[-1] != (ck.generation, ck.step)):
            self.pointers.append((ck.generation, ck.step))
        return j

    def until(
        self, pred: Callable[[JobStatus], bool], timeout: float, what: str, every: float = 0.1
    ) -> JobStatus:
        def check():
            j = self.poll()
            if pred(j):
                return j
            if j.phase in TERMINAL:
                raise AssertionError(
                    f"job {self.jid} ended {j.phase} while waiting for {what}: "
                    f"{[(c.type, c.reason, c.message) for c in j.conditions if c.status == 'True']}"
                    f"\n{self.stack.logs()}"
                )
            return None

        return wait_until(check, timeout, f"{what} (job {self.jid})", every)

    def finish(self, timeout: float = 300) -> JobStatus:
        j = wait_until(
            lambda: (j := self.poll()).phase in TERMINAL and j, timeout, f"job {self.jid} to end"
        )
        self.assert_monotonic()
        return j

    def assert_monotonic(self) -> None:
        gens = [j.generation for j in self.seen]
        restarts = [j.restarts for j in self.seen]
        assert gens == sorted(gens), f"generation went backwards: {gens}"
        assert restarts == sorted(restarts), f"restarts went backwards: {restarts}"
        assert self.pointers == sorted(self.pointers), (
            f"checkpoint pointer (generation, step) went backwards: {self.pointers}"
        )


def start(stack: Stack, spec: dict) -> tuple[Watch, JobStatus]:
    """Submit and wait until every rank of generation 1 has a trainer and trains."""
    w = Watch(stack, stack.client.submit(spec).id)
    j = w.until(
        lambda j: (
            j.mesh.generation == 1
            and j.mesh.ranks
            and all(r.pid and r.state == "running" for r in j.mesh.ranks)
        ),
        180,
        "every rank of generation 1 to train",
    )
    return w, j


def succeeded(stack: Stack, j: JobStatus) -> None:
    assert j.phase == "Succeeded", (
        f"job {j.id} is {j.phase}: {[(c.type, c.reason, c.message) for c in j.conditions]}\n"
        f"{stack.logs()}"
    )
    assert j.condition("Succeeded").reason == "AllRanksSucceeded"
    assert j.step == j.steps
    assert all(r.state == "succeeded" and r.exit_code == 0 for r in j.mesh.ranks), j.mesh.ranks
    assert j.last_checkpoint is not None and j.last_checkpoint.step == j.steps
    assert j.last_checkpoint.generation == j.generation


def survives_one_kill(
    stack: Stack, spec: dict, kill_at: int, reference: list[dict], committed: int = 0
) -> tuple[JobStatus, dict[int, dict]]:
    """Run `spec`, SIGKILL rank 1's trainer once it reports step `kill_at` (and, with
    `committed`, once rank 0 committed that step's checkpoint: an async commit can trail the
    steps by seconds on a loaded host), and check the job succeeded after exactly that one
    recovery with `reference`'s losses bit for bit; the job and its stitched curve."""
    w, j1 = start(stack, spec)
    victim = rank(j1, 1)
    if committed:
        wait_record(
            metrics_path(stack, j1, 0),
            lambda r: r.get("event") == "checkpoint" and r["step"] >= committed,
            120,
            f"rank 0's commit of step {committed}",
        )
        # the recovery restores what the controller knows of, which trails rank 0's line
        w.until(
            lambda j: j.last_checkpoint is not None and j.last_checkpoint.step >= committed,
            120,
            f"the controller's record of checkpoint {committed}",
        )
    wait_record(metrics_path(stack, j1, 1), at_step(kill_at), 120, f"rank 1 at step {kill_at}")
    kill(victim.pid)
    j = w.finish()
    succeeded(stack, j)
    assert [r.cause for r in j.recoveries] == ["TrainerKilled"], j.recoveries
    return j, assert_curve(stack, j, reference, exact=True)


def paced_spec(name: str) -> dict:
    """A dp2 job of 40 steps paced to 0.25 s each (`chaos.min_step_s`): a suspend or a stop
    asked after a few steps lands mid-run on any host."""
    return {**mesh_spec(name, steps=40), "chaos": {"min_step_s": 0.25}}


def resumed_once(stack: Stack, j: JobStatus, reference: list[dict]) -> int:
    """The job succeeded in two generations with no restart and nothing redone: generation 1
    ran every step up to the one it committed when suspended, 2 every one after, with
    `reference`'s losses bit for bit. Returns that step."""
    succeeded(stack, j)
    assert (j.generation, j.restarts, j.recoveries) == (2, 0, []), (
        j.generation,
        j.restarts,
        [(r.cause, r.action, r.message) for r in j.recoveries],
    )
    curve = assert_curve(stack, j, reference, exact=True)
    stop = max(s for s, r in curve.items() if r["generation"] == 1)
    assert 0 < stop < j.steps
    assert {s: r["generation"] for s, r in curve.items()} == {
        s: 1 if s <= stop else 2 for s in range(1, j.steps + 1)
    }
    return stop


def rank(j: JobStatus, n: int):
    return next(r for r in j.mesh.ranks if r.rank == n)


PHASES = ("detect_s", "decide_s", "rendezvous_s", "restore_s", "first_step_s")


def completed(rec) -> None:
    """A recovery record closed once the new generation trained: every phase timed, inside
    the record's own span, the phases adding up to the total; it resumed at a checkpoint no
    later than the furthest step, and the steps it lost are exactly those in between."""
    assert rec.completed_at is not None, rec
    assert rec.to_generation == rec.from_generation + 1, rec
    d = rec.durations or {}
    assert set(d) == {*PHASES, "total_s"}, d
    # total: fault -> the slowest rank's first step, which the controller saw at completed_at
    # (0.1 s: agents stamp milestones with their estimate of Redis time, the controller reads it)
    seen = rec.completed_at - rec.fault_at
    assert 0 < d["total_s"] <= seen + 0.1, (d, rec.fault_at, rec.completed_at)
    assert all(0 <= d[k] <= d["total_s"] for k in PHASES), d
    assert sum(d[k] for k in PHASES) == pytest.approx(d["total_s"], abs=1e-6), d
    assert rec.resumed_step is not None and rec.resumed_step <= rec.last_step, rec
    assert rec.steps_lost == rec.last_step - rec.resumed_step, rec
    sources = set((rec.restored_from or {}).values())
    if sources <= {"disk"}:  # the disk checkpoint (or nothing yet: step 0)
        assert rec.resumed_step % EVERY == 0, rec
    else:  # host memory (docs/architecture.md, "Hot recovery"): a snapshot every step
        assert sources <= {"memory", "peer"}, rec.restored_from
        assert rec.steps_lost <= 1, rec


def events(stack: Stack, jid: str) -> list:
    return stack.client.events(jid, limit=1000)


@contextlib.contextmanager
def pool_cut_to(stack: Stack, n: int) -> Iterator[None]:
    """Only `n` idle workers left: the other agents are frozen (hosts gone silent) until the
    block ends, so a recovery finds no worker outside the job."""
    frozen = [stack.agents[wid] for wid in stack.idle_workers()[n:]]
    for agent in frozen:
        agent.kill(signal.SIGSTOP)
    try:
        wait_until(
            lambda: len(free_pool(stack)) == n, 30, "the frozen workers to leave the free pool"
        )
        yield
    finally:
        for agent in frozen:
            agent.kill(signal.SIGCONT)


def free_pool(stack: Stack) -> list[str]:
    """The scheduler's own free-worker pool (quarantine filter included), read from Redis."""
    s = Scheduler(stack.store, SchedulerConfig(), "test-chaos")
    return [w.wid for w in s.free_workers(stack.store.now())]


# -- metrics files ------------------------------------------------------------------------
def records(path: Path) -> list[dict]:
    """The JSON lines of a metrics file; a line cut by a SIGKILL is not a record."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def steps_of(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "step" in r and "event" not in r]


def metrics_path(stack: Stack, j: JobStatus, n: int) -> Path:
    return stack.job_dir(rank(j, n).worker, j.id, j.mesh.generation) / f"metrics-{n}.jsonl"


def wait_record(path: Path, pred: Callable[[dict], bool], timeout: float, what: str) -> dict:
    """Tail a rank's metrics file (every 5 ms: a tiny step takes tens of ms) for a record."""
    deadline, offset, partial = time.monotonic() + timeout, 0, ""
    while time.monotonic() < deadline:
        if path.exists():
            with path.open() as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            lines = (partial + chunk).split("\n")
            partial = lines.pop()
            for line in lines:
                rec = json.loads(line)
                if pred(rec):
                    return rec
                if rec.get("event") == "done":
                    raise AssertionError(f"{path} finished before {what}")
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} in {path}")


def at_step(step: int) -> Callable[[dict], bool]:
    """A step record of `step` or more steps completed."""
    return lambda r: "event" not in r and r.get("step", 0) >= step


def rank0_generations(stack: Stack, jid: str) -> dict[int, list[dict]]:
    """Generation -> every record rank 0 wrote in it, from whichever worker hosted it."""
    out: dict[int, list[dict]] = {}
    for f in stack.work.glob(f"workers/*/jobs/{jid}/g*/metrics-0.jsonl"):
        g = int(f.parent.name[1:])
        assert g not in out, f"two workers ran rank 0 of generation {g}"
        out[g] = records(f)
    return dict(sorted(out.items()))


def stitched(stack: Stack, j: JobStatus) -> dict[int, dict]:
    """Step -> the record of the newest generation that ran it (steps count completed steps,
    1..steps; services/records.py); asserts that no generation skipped or repeated a step,
    that each resumed no later than where the previous ones got to (at a checkpoint or an
    in-memory snapshot: `completed` checks which), and that together they cover every step
    once."""
    gens = rank0_generations(stack, j.id)
    assert list(gens) == list(range(1, j.generation + 1)), (
        f"rank 0 metrics for generations {list(gens)}, the job is at generation {j.generation}"
    )
    curve: dict[int, dict] = {}
    reached = 0  # steps 1..reached were completed in some earlier generation
    for g, recs in gens.items():
        steps = [r["step"] for r in steps_of(recs)]
        ready = [r for r in recs if r.get("event") == "ready"]
        if not steps and not ready:
            continue  # a generation that never got going (ended before rank 0 was ready)
        start = ready[0]["start_step"] if ready else steps[0] - 1  # the checkpoint it resumed
        assert steps == list(range(start + 1, start + 1 + len(steps))), (
            f"generation {g}: steps not consecutive after {start}: {steps}"
        )
        assert start <= reached, (
            f"generation {g} resumed at step {start}; earlier generations reached {reached}"
        )
        for r in steps_of(recs):
            curve[r["step"]] = {**r, "generation": g}
        reached = max(reached, start + len(steps))
    assert sorted(curve) == list(range(1, j.steps + 1)), f"stitched steps {sorted(curve)}"
    assert curve[j.steps]["generation"] == j.generation
    return curve


def assert_curve(
    stack: Stack, j: JobStatus, reference: list[dict], *, exact: bool
) -> dict[int, dict]:
    curve = stitched(stack, j)
    got = [curve[s]["loss"] for s in range(1, j.steps + 1)]
    want = [r["loss"] for r in reference]
    assert len(want) == j.steps
    if exact:
        diff = [(s, g, w) for s, (g, w) in enumerate(zip(got, want, strict=True), 1) if g != w]
        assert not diff, (
            f"{len(diff)} steps differ from the uninterrupted run (step, got, want): {diff[:5]}"
        )
    else:
        bad = [
            (s, g, w)
            for s, (g, w) in enumerate(zip(got, want, strict=True), 1)
            if abs(g - w) > 1e-5 * abs(w)
        ]
        assert not bad, f"{len(bad)} steps beyond rtol 1e-5 (step, got, want): {bad[:5]}"
    return curve


def assert_run_record(
    stack: Stack, j: JobStatus, spec: dict, reference: list[dict], notes: list[tuple[int, str]]
) -> None:
    """The job's TensorBoard run record, read by TensorBoard's own reader, holds every step's
    loss exactly once with the uninterrupted run's value (stored as float32), whichever
    workers rank 0 ran on, and one note per later generation: (step, how its text begins)
    (worker/trainer/run_record.py)."""
    ea = EventAccumulator(str(stack.checkpoint_dir(j.id, spec) / "tensorboard"))
    ea.Reload()
    got = [(e.step, e.value) for e in ea.Scalars("train/loss")]
    want = [(s, float(np.float32(r["loss"]))) for s, r in enumerate(reference, 1)]
    assert got == want, f"run record (step, loss) {got[:3]}...{got[-3:]}, want {want[:3]}..."
    written = [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors("notes/text_summary")
    ]
    assert len(written) == len(notes), written
    for (step, text), (want_step, prefix) in zip(written, notes, strict=True):
        assert step == want_step and text.startswith(prefix), (written, notes)


# -- processes ----------------------------------------------------------------------------
def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def gone(pid: int) -> bool:
    return not process_groups_alive([pid])


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (sched_setaffinity acts on one thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, OSError):
            pass


def deprioritize(pid: int, nice: int) -> None:
    """Lower `pid`'s CPU weight against everything else. With autogroup scheduling (the
    default on desktop-style kernels, and on this project's VMs) CPU time is shared between
    sessions first, and a thread's nice only counts inside its session: the trainer runs in a
    session of its own, so its session's nice is what takes effect; the threads' nice covers
    kernels without autogroup."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
        except (ProcessLookupError, OSError):
            pass


class Hogs:
    """Busy loops pinned to one CPU: contention for whatever else runs there."""

    def __init__(self, cpu: int, n: int):
        code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
        self.procs = [
            subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True)
            for _ in range(n)
        ]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
