"""The worker agent: register, heartbeat, follow the assignment, supervise trainers, relay progress.

The assignment pointer `worker:{wid}:assignment` (controller-written) says which job this
worker serves and in what role; the generation is the job's assignment's. The agent learns of
changes by pub/sub (its pointer's channel and its job's assignment channel) and re-reads both
on every reconnect and every few seconds (pub/sub is lossy). It acts only on what it has read:
losing Redis never stops training; a withdrawn or superseded assignment does.

Checkpoint fencing on the agent's side (docs/architecture.md, "Generation and fencing"):
trainers are handed the committed pointer history from Redis and restore only from it; rank
0's agent moves the pointer through the generation CAS, and only while a heartbeat has
confirmed its generation within half of `dead_after_s` (its commit lease); it deletes only
the checkpoints that CAS reports as dropped from the history.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from pydantic import ValidationError

from services.assignment import STORE_SPACE_ENV, Assignment
from services.dataset_admission import check_dataset
from services.paths import SNAPSHOT_ROOT as DEFAULT_SNAPSHOT_ROOT
from services.paths import confine_spec
from services.procs import stop_all
from services.records import EXIT_DEVICE, EXIT_SUSPENDED, RankReport
from services.spec import SpecError, parse_spec
from services.store import Store, loads
from worker import flight_record
from worker.agent import job_store, reverse_dns
from worker.agent.device_health import DeviceHealth
from worker.agent.gloo_interface import gloo_env
from worker.agent.heartbeat import Heartbeat
from worker.agent.job_store import JobStore
from worker.agent.launcher import Launcher
from worker.agent.memory_watch import MemoryWatch, limited_group
from worker.agent.metrics_endpoint import AgentMetrics, AgentSnapshot, RankSnapshot
from worker.agent.metrics_tail import CheckpointCommitted, SnapshotTaken
from worker.agent.probe import Prober
from worker.agent.rank_process import RankProcess
from worker.agent.rank_progress import RankProgress
from worker.agent.retry import Outage
from worker.agent.run_dirs import prune_run_dirs
from worker.agent.zygote import MEMORY_GROUP_ENV
from worker.ckpt_store import Pointer, remove_checkpoints
from worker.devices import device_indices, discover
from worker.handoff_order import Order
from worker.snapshots import SnapshotPlan, prune_generations, remove_tree

log = logging.getLogger("meshkeeper.agent")
REREAD_S = 5.0  # safety net for lost pub/sub messages
# A kept trainer begins the order it was handed within this, or starts afresh: its watcher
# sees the order within 10 ms and aborts its collectives, so only a process that cannot get
# back to Python (spinning in native code) needs it
HANDOVER_S = 10.0
LOG_BACKLOG = 20_000  # trainer output lines held for Redis while it is away


@dataclass(frozen=True)
class AgentConfig:
    wid: str
    host: str
    address: str
    run_dir: Path
    labels: dict[str, str] = field(default_factory=dict)
    devices: int = 1
    warm: int = 1  # above 0: trainers forked from a zygote (worker/agent/zygote.py); 0: cold
    heartbeat_s: float = 0.5
    tick_s: float = 0.2
    stop_grace_s: float = 3.0  # SIGTERM -> SIGKILL
    checkpoint_root: Path | None = None  # shared by every worker of a job (default: run_dir)
    data_roots: tuple[Path, ...] = ()  # where text:/tokens: data may be read (services/paths.py)
    keep_run_dirs: int = 16  # newest per-generation run directories kept (worker/agent/run_dirs.py)
    # in-memory snapshots of this worker's ranks and the buddy copies it holds, per job
    # (None: /dev/shm/meshkeeper/<wid>)
    snapshot_root: Path | None = None

    @property
    def snapshots(self) -> Path:
        return self.snapshot_root or DEFAULT_SNAPSHOT_ROOT / self.wid


@dataclass
class Run:
    """What this worker does for one (job, generation)."""

    job: str
    generation: int
    role: str  # rank | spare
    ranks: dict[int, RankProcess] = field(default_factory=dict)
    lease_s: float = 1.0  # commit only within this long of a beat that confirmed the generation
    heartbeat_s: float | None = None  # the job's fault_tolerance.heartbeat_s (None: unknown)
    checkpoints: Path | None = (
        None  # the job's checkpoint directory (only what CAS drops is deleted)
    )
    drain: Path | None = None  # where a suspend's stop step goes (worker/trainer/drain.py)
    # the job's snapshot directory while it still holds the generation this one restored from
    # (`_drop_restored`)
    restored_snapshots: Path | None = None

    @property
    def active(self) -> bool:
        return any(r.exit_code is None for r in self.ranks.values())

    @property
    def training(self) -> bool:
        return all(r.progress.first_step_at for r in self.ranks.values())

    def state(self) -> str:
        states = {r.progress.state for r in self.ranks.values()}
        for s in ("failed", "starting", "running", "stopped", "suspended"):
            if s in states:
                return s
        return "succeeded" if states else self.role


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        store: Store,
        metrics: AgentMetrics | None = None,
        rejoin: Callable[[BaseException], None] | None = None,
    ):
        """`rejoin`: told of every failed Redis call of the loop; it joins again when Redis
        refused the agent's password (worker/agent/joining.py)."""
        self.cfg, self.store, self.metrics = cfg, store, metrics
        self._rejoin = rejoin
        self.run: Run | None = None
        # the superseded generation's trainers that may take the next one in place, by rank
        self._kept: dict[int, RankProcess] = {}
        self.hosted_store: JobStore | None = None  # when this worker hosts its job's store
        self.state = "idle"
        self.launcher = Launcher(cfg.run_dir, cfg.warm, self._child_env())
        self.heartbeat = Heartbeat(store, cfg.wid, self.heartbeat_interval, self.serving)
        self.prober = Prober(
            store, cfg.wid, self._child_env(), cfg.run_dir, self._now
        )  # quarantine exit
        self.devices = DeviceHealth([])  # NVML's watch over the GPUs: opened in run_forever
        self._stop = threading.Event()
        self._pubsub = None
        self._job_channel: str | None = None  # the assignment channel of the job followed
        self._reread_at = 0.0
        self._dirty = False
        self._exited = False  # a trainer exit is in the next report: announce it (_publish)
        # for Redis, in order: (job, generation, a checkpoint to commit or an event to add)
        self._outbox: list[tuple[str, int, CheckpointCommitted | dict]] = []
        # trainers' output lines for the jobs' log streams, (job, generation, rank, line); while
        # Redis is away the oldest go first (every line stays in the rank's own log file)
        self._log_lines: deque[tuple[str, int, int, str]] = deque(maxlen=LOG_BACKLOG)

    def serving(self) -> tuple[str, int]:
        run = self.run
        return (run.job, run.generation) if run else ("", 0)

    def heartbeat_interval(self) -> float:
        """The heartbeat_s of the job this agent serves (rank or spare), else its own default:
        a job's dead_after_s is judged against the interval it asked for."""
        run = self.run
        return run.heartbeat_s if run and run.heartbeat_s else self.cfg.heartbeat_s

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> AgentSnapshot:
        """What the metrics endpoint reads at scrape time (from its own thread)."""
        run = self.run  # one read: the loop may replace it meanwhile
        live = [p for p in run.ranks.values() if p.exit_code is None] if run else []
        return AgentSnapshot(
            job=run.job if run else None,
            heartbeats=self.heartbeat.beats,
            heartbeat_failures=self.heartbeat.failures,
            ranks=tuple(
                RankSnapshot(p.rank, p.proc.pid, p.progress.last, p.metrics.parent / "spec.json")
                for p in live
            ),
        )

    # -- the loop -----------------------------------------------------------------------
    def run_forever(self) -> None:
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        log.info(
            "agent %s up: host %s, address %s, %d device(s), trainers %s",
            self.cfg.wid,
            self.cfg.host,
            self.cfg.address,
            self.cfg.devices,
            "forked from a zygote" if self.launcher.warm else "started cold",
        )
        reverse_dns.check_in_background(self.cfg.address)
        self.devices = DeviceHealth(discover())
        redis_outage = Outage(
            redis.RedisError,
            2.0,
            self._stop,
            sleep=self._wait_locally,
            on_failure=self._redis_failed,
            down="Redis unavailable (%s); trainers keep running, retrying",
            back="Redis is back; assignment re-read",
        )
        try:
            redis_outage.call(self._sync)  # the first sync comes before the first beat: _connect
            self.heartbeat.start()
            while not self._stop.is_set():
                self._tend()
                redis_outage.call(self._sync)
        finally:
            self._shutdown()

    def _redis_failed(self, error: BaseException) -> None:
        self._close_pubsub()
        if self._rejoin:
            self._rejoin(error)

    def _wait_locally(self, seconds: float) -> None:
        """Between tries while Redis is away: the trainers are still supervised."""
        self._stop.wait(seconds)
        self._tend()

    def _tend(self) -> None:
        """The loop's local work, which needs no Redis."""
        self._supervise()
        if self.run is None:  # idle: a quarantined worker probes itself (worker/agent/probe.py)
            self.prober.tick()
        # Refilled while a job runs too (after a failure the next generation's trainers
        # come from here, torch already imported), but only once its ranks train:
        # importing torch beside a starting trainer would slow that start.
        if not (self.run and self.run.active) or self.run.training:
            self.launcher.refill()

    def _sync(self) -> None:
        if self.heartbeat.superseded.is_set():  # a beat saw the pointer move: act on it now
            self.heartbeat.superseded.clear()
            self._reread_at = 0.0
        if self._pubsub is None:
            self._connect()
        else:
            self._publish()  # what the last _tend found (an exit), before waiting a tick
            if self._news() or time.monotonic() >= self._reread_at:
                self._reread()
        self._publish()

    def _news(self) -> bool:
        """Wait up to a tick for a message on the assignment channel (True when one came),
        and no longer than until a trainer exits: its pidfd wakes the loop, so an exit is
        reported at once rather than at the end of the tick (docs/architecture.md, "Agent")."""
        ps = self._pubsub
        if ps.get_message(timeout=0):  # one already read off the socket
            return True
        sock = getattr(ps.connection, "_sock", None)  # redis-py keeps its socket private
        run = self.run
        exits = [fd for p in run.ranks.values() if (fd := p.exit_fd()) is not None] if run else []
        if sock is None or not exits:
            return bool(ps.get_message(timeout=self.cfg.tick_s))
        readable, _, _ = select.select([sock, *exits], [], [], self.cfg.tick_s)
        return sock in readable and bool(ps.get_message(timeout=0))

    def _connect(self) -> None:
        """(Re)connect: subscribe, follow the pointer, then register (a beat). Following
        comes first because a restarted agent must report the ranks its predecessor ran as
        failed (`_started_before`) before anything says this worker is back: the controller
        holds back blame while a worker of the job is silent, and once this one beats again
        it would restart only the peers that failed because of it (health.collateral_only),
        never naming this worker."""
        ps = self.store.r.pubsub(ignore_subscribe_messages=True)
        ps.subscribe(self.store.keys.worker_assignment(self.cfg.wid))
        self._pubsub, self._job_channel = ps, None
        self._reread()
        self._register()

    def _reread(self) -> None:
        self._reread_at = time.monotonic() + REREAD_S
        pointer = self.store.worker_assignment(self.cfg.wid)
        self._listen_to(pointer.get("job"))
        self._follow(pointer)

    def _listen_to(self, job: str | None) -> None:
        """Follow `job`'s assignment channel, where each new generation is announced (the
        pointer changes only with this worker's job or role), and no other job's."""
        want = self.store.keys.job_assignment(job) if job else None
        if want == self._job_channel:
            return
        if self._job_channel is not None:
            self._pubsub.unsubscribe(self._job_channel)
        if want is not None:
            self._pubsub.subscribe(want)
            self._reread_at = 0.0  # a generation announced before the subscription took
        self._job_channel = want

    def _register(self) -> None:
        # The registration itself was written at join (worker/__main__.py) by the controller,
        # which alone marks a worker placeable; a reconnect only restates what may change.
        self.store.set_worker(self.cfg.wid, {"pid": os.getpid(), "state": self.state})
        self.store.heartbeat(self.cfg.wid, *self.serving())

    def _close_pubsub(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except (redis.RedisError, OSError):
                pass
            self._pubsub = None

    # -- following the assignment ---------------------------------------------------------
    def _follow(self, pointer: dict[str, str]) -> None:
        want = (pointer["job"], int(pointer["generation"])) if pointer.get("job") else None
        run = self.run
        if run and (run.job, run.generation) != want:
            why = "withdrawn" if want is None else f"superseded by {want[0]} generation {want[1]}"
            later = want is not None and want[0] == run.job and want[1] > run.generation
            self._end_run(f"assignment {why}", keep=later)
        if want and self.run is None:
            self._begin_run(*want, pointer.get("role", "rank"))
        if self.run is None:
            self._host_store(None)
        self._stop_kept()  # those the new generation did not take
        if self.run and pointer.get("drain_step"):
            self._drain(self.run, int(pointer["drain_step"]))
        self._set_state("busy" if self.run else "idle")
        # snapshots of jobs this worker no longer serves free their memory
        for d in self.cfg.snapshots.iterdir() if self.cfg.snapshots.is_dir() else []:
            if not (self.run and d.name == self.run.job):
                remove_tree(d)

    def _drain(self, run: Run, step: int) -> None:
        """Tell the run's trainers to commit `step` and exit (the job is being suspended):
        the file appears whole, once."""
        if run.drain is None or run.drain.exists():
            return
        staged = run.drain.with_suffix(".staged")
        staged.write_text(str(step))
        staged.replace(run.drain)
        log.info("job %s generation %d: stopping after step %d", run.job, run.generation, step)

    def _begin_run(self, job: str, generation: int, role: str) -> None:
        if role == "spare":
            spare_spec = loads(self.store.job(job).get("spec")) or {}
            beat = spare_spec.get("fault_tolerance", {}).get("heartbeat_s")
            self.run = Run(job, generation, role, heartbeat_s=beat)
            self._host_store(None)
            log.info("spare for job %s generation %d", job, generation)
            return
        asg = Assignment.from_fields(self.store.job_assignment(job))
        spec = loads(self.store.job(job).get("spec"))
        if (
            asg is None
            or asg.generation != generation
            or spec is None
            or self.cfg.wid not in asg.rank_workers  # released between the two reads
        ):
            self._reread_at = 0.0  # the controller is mid-write: look again next tick
            return
        if self._started_before(job, generation):
            return
        self._host_store(asg)  # before any trainer: they connect to it first thing
        d = self.cfg.run_dir / "jobs" / job / f"g{generation}"
        d.mkdir(parents=True, exist_ok=True)
        prune_run_dirs(self.cfg.run_dir / "jobs", self.cfg.keep_run_dirs, d)
        spec = asg.effective_spec(spec)  # the mesh may have shrunk after a failure
        default_root = self.cfg.checkpoint_root or self.cfg.run_dir / "checkpoints"
        try:  # again on this host, whatever reached Redis: trainers get the resolved paths
            spec = confine_spec(spec, self.cfg.data_roots, [default_root], on_host=True)
            if str(spec["data"].get("source", "")).startswith("dataset:"):
                # a job's first generation is 1 (placing counts from job.generation 0)
                check_dataset(parse_spec(spec), sample_shards=generation == 1)
        except SpecError as e:
            return self._refuse(job, generation, asg, str(e))
        window = int(spec["fault_tolerance"].get("straggler", {}).get("window_steps", 20))
        spec_path = d / "spec.json"
        spec_path.write_text(json.dumps(spec))
        # The spec's root only inside the agent's own (checked above), and per job id: the
        # trainer names its directory after the spec's name, which jobs may share.
        ckpt_root = Path(spec["checkpoint"].get("root") or default_root) / job
        # Restore follows the committed pointer, never the newest directory on disk. Read after
        # the new assignment: the CAS refuses the old generation from then on, so this history
        # is final for this generation's start.
        restore_path = d / "restore.json"
        restore_path.write_text(json.dumps(self.store.checkpoint_history(job)))
        run = Run(
            job,
            generation,
            role,
            lease_s=spec["fault_tolerance"]["dead_after_s"] / 2,
            heartbeat_s=spec["fault_tolerance"].get("heartbeat_s"),
            checkpoints=ckpt_root / spec["name"],
            drain=d / "drain",
        )
        snapshots = self._snapshot_plan(job, generation, asg, spec, d)
        if snapshots and asg.restore_generation not in (None, generation):
            run.restored_snapshots = self.cfg.snapshots / job
        mine = asg.ranks_of(self.cfg.wid)
        try:  # this worker's own device count decides, whatever the slots say
            device = device_indices({e.rank: e.local_rank for e in mine}, self.cfg.devices)
        except ValueError as err:
            return self._refuse(job, generation, asg, str(err))
        try:
            memory = self._memory_watches(job, generation, spec, [e.rank for e in mine])
        except OSError as err:
            return self._refuse(job, generation, asg, str(err))
        for e in mine:
            env = {
                "RANK": str(e.rank),
                "WORLD_SIZE": str(asg.shape.world_size),
                "LOCAL_RANK": str(device[e.rank]),
                "LOCAL_WORLD_SIZE": str(e.local_world_size),
                "MASTER_ADDR": asg.master_addr,
                "MASTER_PORT": str(asg.master_port),
            }
            if asg.store_space:
                env[STORE_SPACE_ENV] = asg.store_space
            argv = [
                "--spec",
                str(spec_path),
                "--metrics-out",
                str(d / "metrics-{rank}.jsonl"),
                "--checkpoint-root",
                str(ckpt_root),
                "--generation",
                str(generation),
                "--job-id",
                job,
                "--restore-from",
                str(restore_path),
                # beside the checkpoints, which every rank's host shares: a recovered rank 0
                # appends to the job's curves wherever it now runs
                "--run-record",
                str(run.checkpoints / "tensorboard"),
                "--drain-file",
                str(run.drain),
                # per rank slot, not per generation: a kept process watches it across them
                "--handoff",
                str(d.parent / f"rank{e.rank}.handoff.json"),
            ] + (["--snapshot-plan", str(snapshots)] if snapshots else [])
            metrics, log_path = d / f"metrics-{e.rank}.jsonl", d / f"rank{e.rank}.log"
            watch = memory[e.rank]
            if watch.pinned:
                env[MEMORY_GROUP_ENV] = str(watch.group)
            old = self._kept.pop(e.rank, None)
            handed, handed_from = None, None
            if old is not None and not watch.pinned and old.env["LOCAL_RANK"] == env["LOCAL_RANK"]:
                proc, watch = self._hand_over(old, generation, argv, env, log_path), old.memory
                handed, handed_from = time.monotonic(), old.log
            else:
                if old is not None:
                    self._kept[e.rank] = old  # stopped below, with the others not taken
                proc = self.launcher.launch(argv, env, log_path, before=watch.baseline)
            run.ranks[e.rank] = RankProcess(
                e.rank,
                proc,
                metrics,
                log_path,
                RankProgress(self._now(), window),
                memory=watch,
                argv=argv,
                env=env,
                handed_at=handed,
                handed_from=handed_from,
            )
        self.run, self._dirty = run, True
        self._started(run, asg)

    def _started(self, run: Run, asg: Assignment) -> None:
        pids = {r: p.proc.pid for r, p in run.ranks.items() if p.handed_at is None}
        kept = {r: p.proc.pid for r, p in run.ranks.items() if p.handed_at is not None}
        log.info(
            "job %s generation %d: started ranks %s (pids %s), kept ranks %s (pids %s), "
            "rendezvous %s:%d",
            run.job,
            run.generation,
            sorted(pids),
            sorted(pids.values()),
            sorted(kept),
            sorted(kept.values()),
            asg.master_addr,
            asg.master_port,
        )
        if pids:
            self._event(
                "TrainerStarted",
                f"worker {self.cfg.wid} started ranks {sorted(pids)} "
                f"(pids {sorted(pids.values())})",
            )
        if kept:
            self._event(
                "TrainerKept",
                f"worker {self.cfg.wid} kept ranks {sorted(kept)} in their processes (pids "
                f"{sorted(kept.values())}): each restores from its own snapshot in place",
            )

    def _hand_over(
        self, old: RankProcess, generation: int, argv: list[str], env: dict[str, str], log: Path
    ):
        """Give a kept trainer this generation's order (worker/trainer/handoff.py); its
        process, now this generation's."""
        Order(generation, argv, env, str(log)).write(Path(argv[argv.index("--handoff") + 1]))
        old.forget()
        return old.proc

    def _stop_kept(self) -> None:
        """Stop the kept trainers no generation took (the assignment moved elsewhere, or the
        new generation's slots differ): as `_end_run` would have."""
        kept, self._kept = list(self._kept.values()), {}
        if not kept:
            return
        stop_all([p.proc for p in kept], self.cfg.stop_grace_s)
        for p in kept:
            p.ended(p.proc.returncode, "stopped")
            p.memory.release()
        log.info(
            "stopped ranks %s, which the new assignment did not keep", sorted(p.rank for p in kept)
        )

    def _take_over_late(self, run: Run) -> None:
        """A kept trainer that did not begin its order in time, or exited instead: start its
        rank afresh, as if it had not been kept (the order is the same generation's)."""
        for r, p in list(run.ranks.items()):
            if p.handed_at is None:
                continue
            if p.metrics.exists():  # its first line: the order was taken
                p.handed_at = None
                continue
            code = p.proc.poll()
            if code is None and time.monotonic() - p.handed_at < HANDOVER_S:
                continue
            if code is None:
                # Where it is stuck, for whoever asks why: every thread's stack, into the log it
                # still writes (faulthandler, worker/trainer/main.py); SIGUSR1 is delivered
                # before stop_all's SIGTERM, the lower-numbered of two pending signals.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.proc.pid, signal.SIGUSR1)
            stop_all([p.proc], self.cfg.stop_grace_s)
            why = (
                f"exited with code {code}"
                if code is not None
                else f"did not within {HANDOVER_S:.0f}s (process state {p.proc_state}; its "
                f"threads' stacks, unless it was stopped, are at the end of {p.handed_from})"
            )
            self._event(
                "TrainerNotKept",
                f"rank {r} (pid {p.proc.pid}) on worker {self.cfg.wid} was handed generation "
                f"{run.generation} in place and {why}; started afresh",
                warning=True,
            )
            p.forget()
            proc = self.launcher.launch(p.argv, p.env, p.log, before=p.memory.baseline)
            run.ranks[r] = RankProcess(
                r,
                proc,
                p.metrics,
                p.log,
                RankProgress(self._now(), p.progress.window),
                memory=p.memory,
                argv=p.argv,
                env=p.env,
            )
            self._dirty = True

    def _snapshot_plan(
        self, job: str, generation: int, asg: Assignment, spec: dict, d: Path
    ) -> Path | None:
        """The trainers' snapshot plan (docs/architecture.md, "Hot recovery"), written into the
        generation's run directory; None when the job takes no snapshots. Older generations'
        snapshots are dropped here, except the ones this generation restores from, which go
        once this worker's ranks have stepped (`_drop_restored`)."""
        want = spec.get("snapshot", {})
        if not want.get("enabled", True):
            return None
        plan = SnapshotPlan(
            self.cfg.snapshots / job,
            generation,
            int(want.get("every_steps", 1)),
            int(want.get("keep", 2)),
            asg.buddies,
            asg.restore_generation,
            asg.restore_sources,
            int(want.get("full_every", 1)),
        )
        prune_generations(plan.dir, {generation, asg.restore_generation or generation})
        path = d / "snapshot.json"
        path.write_text(json.dumps(plan.to_json()))
        return path

    def _memory_watches(
        self, job: str, generation: int, spec: dict, ranks: list[int]
    ) -> dict[int, MemoryWatch]:
        """Each rank's memory watch; a rank the spec's `chaos.memory_limit` names gets a memory
        cgroup of its own with that limit, made here (OSError, naming the field, if it cannot
        be: such a rank must not run unlimited)."""
        limits = {c["rank"]: c["mib"] for c in (spec.get("chaos") or {}).get("memory_limit", [])}
        out = {r: MemoryWatch() for r in ranks}
        for r in (r for r in ranks if r in limits):
            name = f"meshkeeper-{self.cfg.wid}-{job}-g{generation}-r{r}"
            try:
                out[r].pin(*limited_group(name, limits[r] * 2**20))
            except OSError as e:
                raise OSError(
                    f"chaos.memory_limit: worker {self.cfg.wid} cannot limit rank {r}'s memory "
                    f"({e}); run its agent where it may create memory cgroups, or remove the "
                    "entry"
                ) from e
        return out

    def _host_store(self, asg: Assignment | None) -> None:
        """Run the job's rendezvous store while `asg` says this worker hosts it, on the port
        it names; stop the one this worker ran for another job, port or generation's host.
        One that exited (it should not) is started again: each generation's keys are its
        own, so a later generation loses nothing to it."""
        want = (asg.job, asg.master_port) if asg and asg.store_wid == self.cfg.wid else None
        held = self.hosted_store
        if held is not None and (held.key != want or not held.alive()):
            if not held.alive():
                log.warning(
                    "job %s: its rendezvous store on port %d had exited (%s)",
                    held.job,
                    held.port,
                    held.proc.poll(),
                )
            held.stop()
            self.hosted_store = None
        if want is not None and self.hosted_store is None:
            job, port = want
            out = job_store.log_path(self.cfg.run_dir, job)
            proc = self.launcher.launch(["--port", str(port)], {}, out, main=job_store.MODULE)
            self.hosted_store = JobStore(job, port, proc)
            log.info("job %s: rendezvous store on port %d (pid %d)", job, port, proc.pid)

    def _refuse(self, job: str, generation: int, asg: Assignment, why: str) -> None:
        """Fail this worker's ranks without starting trainers, as a trainer refusing its spec
        would (exit code 2: the controller fails the job, no restart), and serve on idle."""
        failed = RankReport(state="failed", exit_code=2, error=why, exited_at=self._now())
        ranks = {str(e.rank): failed.model_dump(mode="json") for e in asg.ranks_of(self.cfg.wid)}
        self.store.write_progress(
            self.cfg.wid,
            {
                "job": job,
                "generation": generation,
                "state": "failed",
                "ranks": ranks,
                "updated_at": time.time(),
            },
        )
        self.run = Run(job, generation, "refused")
        log.error("job %s generation %d refused: %s", job, generation, why)

    def _started_before(self, job: str, generation: int) -> bool:
        """A previous incarnation of this agent (same id) already ran this generation: its
        trainers died with it, and new ones must not join that world's rendezvous. Report the
        ranks failed instead, and serve the assignment without trainers until it changes."""
        old = self.store.progress([self.cfg.wid])[self.cfg.wid]
        if old.get("job") != job or old.get("generation") != str(generation):
            return False
        why = "agent restarted; its trainers are gone"
        ranks = {r: _failed(v, why) for r, v in loads(old.get("ranks"), {}).items()}
        self.store.write_progress(self.cfg.wid, {**old, "state": "failed", "ranks": ranks})
        self.run = Run(job, generation, "orphaned")
        log.warning(
            "job %s generation %d was started by an earlier run of this agent; "
            "reported its ranks %s failed",
            job,
            generation,
            sorted(ranks),
        )
        return True

    def _end_run(self, why: str, keep: bool = False) -> None:
        """Stop the run's trainers; with `keep` (the job's next generation follows) those
        that can take it in place are kept for `_begin_run` instead."""
        run, t0 = self.run, time.monotonic()
        kept = {r: p for r, p in run.ranks.items() if keep and p.keepable()}
        live = [p for p in run.ranks.values() if p.exit_code is None and p.rank not in kept]
        stuck = stop_all(
            [p.proc for p in live], self.cfg.stop_grace_s
        )  # bounded: D state ignores SIGKILL
        for p in live:
            p.ended(p.proc.returncode, "stopped")
        # what each wrote since the last tick, a stopped one's last words included, is shipped
        # with the stop below: on Kubernetes a replaced pod's run dir goes with it
        for p in [*live, *kept.values()]:
            self._echo(run, p)
        for p in run.ranks.values():
            if p.rank not in kept:
                p.memory.release()
        self._kept = kept
        for p in (p for p in live if p.proc in stuck):
            self._event(
                "TrainerUnkillable",
                f"rank {p.rank} (pid {p.proc.pid}) on worker {self.cfg.wid} "
                f"survived SIGKILL (process state {p.proc_state}: stuck in the kernel); moving on",
                warning=True,
            )
        if live:
            log.info(
                "job %s generation %d: %s; stopped ranks %s in %.2fs",
                run.job,
                run.generation,
                why,
                sorted(p.rank for p in live),
                time.monotonic() - t0,
            )
            self._event(
                "TrainerStopped",
                f"worker {self.cfg.wid}: {why}; stopped ranks {sorted(p.rank for p in live)}",
            )
        elif kept:
            log.info(
                "job %s generation %d: %s; ranks %s kept for the next generation",
                run.job,
                run.generation,
                why,
                sorted(kept),
            )
        else:
            log.info(
                "job %s generation %d: %s; this worker is idle again", run.job, run.generation, why
            )
        self._dirty = True
        self._publish_quietly()
        self.run = None

    # -- supervising (local only: works while Redis is away) -----------------------------
    def _supervise(self) -> None:
        run = self.run
        if run is None:
            return
        self._take_over_late(run)
        for p in run.ranks.values():
            if p.exit_code is not None:
                continue
            code = p.proc.poll()  # read before tailing, so no line written before exit is lost
            if code is None and p.poll_state():
                self._dirty = True
            self._echo(run, p)
            for line in p.read():
                self._dirty = True
                failing = p.progress.snapshot_error
                p.progress.absorb(line, self._now(), self.heartbeat.clock_offset)
                if isinstance(line, SnapshotTaken) and line.error and not failing:
                    self._event(  # once per streak: a full /dev/shm fails every step
                        "SnapshotFailed",
                        f"rank {p.rank} on worker {self.cfg.wid}: in-memory snapshot at step "
                        f"{line.step} failed ({line.error}); training goes on, a recovery "
                        "falls back to the disk checkpoint",
                        warning=True,
                    )
                if self.metrics:
                    self.metrics.observe(run.job, line)
                if isinstance(line, CheckpointCommitted) and p.rank == 0:  # every rank reports it
                    self._outbox.append((run.job, run.generation, line))
            if code is not None:
                state = {0: "succeeded", EXIT_SUSPENDED: "suspended"}.get(code, "failed")
                if code == EXIT_DEVICE:
                    p.device = self.devices.evidence(int(p.env["LOCAL_RANK"]))
                if code == -signal.SIGABRT:  # NCCL's watchdog: its flight recorder dumped first
                    p.flight = flight_record.summarize(flight_record.dump_path(p.metrics, p.rank))
                p.ended(code, state, self._now())
                self._dirty = self._exited = True
                self._event(
                    "TrainerExited",
                    f"rank {p.rank} on worker {self.cfg.wid} exited with code {code}"
                    + (" (suspended: its step is committed)" if state == "suspended" else ""),
                    warning=state == "failed",
                )
        self._drop_restored(run)

    @staticmethod
    def _drop_restored(run: Run) -> None:
        """Free the snapshots of the generation `run` restored from once every rank of this
        worker has finished a step of its own. A step needs every rank of the mesh, so by then
        every restore, a ward's from this worker's held copies included, is over; and a later
        recovery restores from this generation's snapshots, never from older ones
        (services/buddies.py, `restore_sources`). Until then both generations' rings share the
        host's memory (services/planner/snapshot_memory.py counts that peak)."""
        if run.restored_snapshots is not None and run.ranks and run.training:
            prune_generations(run.restored_snapshots, {run.generation})
            run.restored_snapshots = None

    def _publish(self) -> None:
        """Progress and pending events to Redis (raises RedisError; kept for the next try)."""
        while self._outbox:
            job, generation, body = self._outbox[0]
            if isinstance(body, CheckpointCommitted):
                if not self._may_commit(job, generation):
                    # held, progress too (it must not overtake the commit), until a beat confirms
                    return
                try:
                    dropped = self.store.commit_checkpoint(
                        job, generation, body.step, body.path, body.keep, wid=self.cfg.wid
                    )
                except redis.exceptions.NoPermissionError:
                    # the controller granted the pointer before the assignment and took it
                    # back with it: this worker no longer works for the job, and the CAS would
                    # refuse the commit as well
                    log.warning("job %s: commit of step %d refused: not assigned", job, body.step)
                    dropped = None
                if (
                    dropped
                    and self.run is not None
                    and self.run.job == job
                    and self.run.checkpoints
                ):
                    remove_checkpoints(
                        self.run.checkpoints, [Pointer.from_json(p) for p in dropped]
                    )
            else:
                try:
                    self.store.add_event(
                        job, {**body, "generation": generation, "source": f"agent/{self.cfg.wid}"}
                    )
                except redis.exceptions.NoPermissionError:
                    # this worker has since been assigned to another job: only that job's
                    # streams are its to write (`agent_acl`)
                    log.warning("job %s: event %s not recorded: not assigned", job, body["reason"])
            self._outbox.pop(0)
        run = self.run
        if self._dirty and run is not None:
            self.store.write_progress(
                self.cfg.wid,
                {
                    "job": run.job,
                    "generation": run.generation,
                    "state": run.state(),
                    "ranks": {
                        str(r): p.report().model_dump(mode="json") for r, p in run.ranks.items()
                    },
                    "updated_at": time.time(),
                },
            )
            if self._exited:
                self._announce_exit()
        self._dirty = self._exited = False
        while self._log_lines:  # after the progress: a full log must not hold a report back
            job = self._log_lines[0][0]
            batch = []
            while self._log_lines and self._log_lines[0][0] == job and len(batch) < 500:
                batch.append(self._log_lines.popleft()[1:])
            try:
                self.store.add_log_lines(job, batch)
            except redis.exceptions.NoPermissionError:  # as an event above: another job's now
                log.warning("job %s: %d log lines not recorded: not assigned", job, len(batch))

    def _echo(self, run: Run, p: RankProcess) -> None:
        """The trainer's new output lines: on the agent's own stdout, each prefixed with its
        job, generation and rank (on Kubernetes `kubectl logs` shows the agent's stream only),
        and queued for the job's log stream in Redis (`meshkeeper logs`)."""
        lines = p.new_log_lines()
        if not lines:
            return
        prefix = f"[{run.job} g{run.generation} rank {p.rank}] "
        sys.stdout.write("".join(f"{prefix}{line}\n" for line in lines))
        sys.stdout.flush()
        self._log_lines.extend((run.job, run.generation, p.rank, line) for line in lines)

    def _announce_exit(self) -> None:
        """Wake the controller's pass for the exit just reported. Best effort: without it the
        next pass (0.25 s) finds the report anyway."""
        try:
            self.store.announce_exit(self.cfg.wid)
        except redis.ResponseError as e:  # a user created before agents could publish
            log.debug("controller wake-up refused (%s); the next pass will see the exit", e)

    def _may_commit(self, job: str, generation: int) -> bool:
        """The commit lease: an agent that cannot confirm its generation commits nothing. A run
        that already ended (superseded) has nothing to confirm: its CAS is refused in Redis."""
        run = self.run
        if run is None or (run.job, run.generation) != (job, generation):
            return True
        return self.heartbeat.confirmed(job, generation, run.lease_s)

    def _publish_quietly(self) -> None:
        try:
            self._publish()
        except redis.RedisError:
            pass

    def _event(self, reason: str, message: str, warning: bool = False) -> None:
        if self.run is not None:
            self._outbox.append(
                (
                    self.run.job,
                    self.run.generation,
                    {
                        "type": "Warning" if warning else "Normal",
                        "reason": reason,
                        "message": message,
                    },
                )
            )

    def _now(self) -> float:
        return time.time() + self.heartbeat.clock_offset

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.store.set_worker(self.cfg.wid, {"state": state})

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # trainers import worker.* from here
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        return {**env, **gloo_env(self.cfg.address, env)}

    def _shutdown(self) -> None:
        if self.run is not None:
            self._end_run("agent stopping")
        self._stop_kept()
        self._host_store(None)
        self.launcher.close()
        self.prober.close()
        self.devices.close()
        self.heartbeat.stop()
        self._close_pubsub()
        try:
            self.store.deregister_worker(self.cfg.wid)
        except redis.RedisError:
            pass
        log.info("agent %s stopped", self.cfg.wid)


def _failed(report: object, why: str) -> dict:
    """A rank report marked failed for `why`, keeping what it said (a malformed one: only that)."""
    try:
        old = RankReport.model_validate(report)
    except ValidationError:
        old = RankReport()
    return old.model_copy(update={"state": "failed", "error": why}).model_dump(mode="json")


def default_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
