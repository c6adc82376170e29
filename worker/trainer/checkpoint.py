"""Sharded checkpoints on torch.distributed.checkpoint (DCP): save, commit, restore.

What is saved: the model and optimizer state of every pipeline part, keyed by FQN (so a
different mesh reshards on load, optimizer state included), and `train_state`: the steps
completed, consumed samples, data seed (worker/trainer/train_state.py; a restore that
does not match them is refused) and the LR schedule. No RNG state is kept: training draws
no random numbers (no dropout; data is a pure function of seed and step).

The checkpointer is handed what it saves (model parts, optimizers, LR schedulers, the data
stream) and knows nothing of the trainer that owns them.

Async saves use a dedicated gloo group and DCP's stager: `save()` returns once the copy
is scheduled, `wait_staged()` is called just before the next optimizer step (the step
must not change tensors that are still being copied), and at most one upload is in flight.

Integrity off the training thread (docs/architecture.md, "Generation and fencing"): as soon as
DCP wrote a rank's files, that rank hashes them on its own `hashing` thread and leaves the
digests beside them (worker/ckpt_store.py, `write_digests`). Once the upload finished
(DCP reports it after every rank wrote its shards and the coordinator wrote `.metadata`),
rank 0's hashing thread gathers every rank's digests from the filesystem and writes the commit
marker; the training thread reports the commit at its next `poll()`. Restore splits the
files over the ranks, each hashes its share, and the verdicts meet in the rendezvous store
with a wait sized for hashing: no collective ever waits on a hash.

Where a checkpoint lives and which one is restored is fenced (worker/ckpt_store.py): saves go
to this generation's own directory, restore follows the pointer history it is handed (from
Redis through the agent) and never looks for "the newest" on disk. Under an agent the trainer
deletes nothing: the agent prunes what the Redis CAS dropped. Standalone, rank 0 keeps the
pointer in `committed.json` and prunes what falls out of it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from worker.ckpt_store import (
    CheckpointStore,
    Committed,
    DamagedCheckpoint,
    Pointer,
    check_files,
    hash_timeout_s,
    remove_checkpoints,
    share,
    write_digests,
)
from worker.trainer.distributed import rendezvous_store
from worker.trainer.train_state import DataStream

# DCP gathers every rank's failure into one CheckpointException, a BaseException.
SAVE_ERRORS = (Exception, CheckpointException)
OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
LOAD = StateDictOptions(strict=False, flatten_optimizer_state_dict=True)  # a part owns a subset


@dataclass
class Pending:
    step: int
    started: float
    blocking_s: float
    upload: Future
    staging: Future | None


@dataclass
class Settling:
    """A save whose upload finished, while the hashing thread hashes and (rank 0) commits."""

    save: Pending
    done: Future  # the commit error, or None


class DigestingWriter(dcp.FileSystemWriter):
    """DCP's file writer that passes the names of the files this rank wrote to `on_written`
    as soon as they are on disk, before the ranks gather their write results."""

    def __init__(self, path: Path, on_written: Callable[[list[str]], None], delay_s: float = 0.0):
        super().__init__(path)
        self.on_written, self.delay_s = on_written, delay_s

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        if self.delay_s:  # chaos.save_delay_s: storage this much slower, for the tests
            time.sleep(self.delay_s)
        written = super().write_data(plan, planner)
        written.add_done_callback(self._written)
        return written

    def _written(self, written: torch.futures.Future) -> None:
        try:
            results = written.value()
        except Exception:  # noqa: BLE001 - DCP reports the failed write itself
            return
        self.on_written(sorted({r.storage_data.relative_path for r in results}))


class Checkpointer:
    def __init__(
        self,
        store: CheckpointStore,
        *,
        model_parts: list[nn.Module],
        optimizers: list[Optimizer],
        lr_schedulers: list[LRScheduler],
        data: DataStream,
        device: torch.device,
        mode: str,
        keep: int,
        meta: dict,
        report: Callable[[dict], None],
        history: list[Pointer] | None = None,
        write_delay_s: float = 0.0,
        timeout_s: float = 1800.0,
    ):
        """One optimizer and LR scheduler per model part (they share one schedule, saved
        once). `history`: the committed pointers (newest first) handed down by the agent;
        None for a standalone run, which keeps its own pointer file."""
        self.store, self.mode, self.keep, self.meta = store, mode, keep, meta
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.data, self.report, self.history = data, report, history
        self.write_delay_s = write_delay_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = None  # `group`
        self.pending: Pending | None = None
        # One thread, first in first out: a rank's digests are written before its commit runs.
        self.hashing = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
        self.settling: list[Settling] = []
        self.last_committed: int | None = None
        if mode == "async":
            self.stager = DefaultStager(staging_options(device))

    @property
    def group(self) -> dist.ProcessGroup:
        """The saves' and restores' own gloo group (saves never queue behind training
        collectives), made at its first use: a recovery that restores from memory forms one
        world-sized group fewer before its first step (issue 48). Every rank first gets here
        at the same save or restore, after every other group is made, so the collective
        creation lines up on all of them."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            self.report({"event": "groups", "timeout_s": {"checkpoint": self.timeout_s}})
        return self._group

    def hold_timeout(self, timeout_s: float) -> None:
        """The group's timeout from now on (the shorter one after the first step on CUDA)."""
        self.timeout_s = timeout_s
        if self._group is not None:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), self._group)

    # -- state ---------------------------------------------------------------------------
    def state_dict(self, step: int) -> dict:
        model, optim = {}, {}
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            model.update(get_model_state_dict(part))
            optim.update(get_optimizer_state_dict(part, opt, options=OPTIM))
        train_state = {
            **self.data.train_state(step),
            "lr_scheduler": self.lr_schedulers[0].state_dict(),
        }
        return {"model": model, "optim": optim, "train_state": train_state}

    # -- save ----------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Checkpoint the state after `step` completed steps."""
        self.finish()  # at most one in flight
        t0 = time.perf_counter()
        path = self.store.step_dir(step)
        if self.rank == 0:
            self.store.discard(step)  # leftovers of an interrupted save of the same step
        dist.barrier(group=self.group)
        state = self.state_dict(step)
        writer = DigestingWriter(
            path,
            lambda names: self.hashing.submit(write_digests, path, self.rank, names),
            self.write_delay_s,
        )
        try:
            if self.mode == "sync":
                dcp.save(
                    state, checkpoint_id=str(path), storage_writer=writer, process_group=self.group
                )
                done: Future = Future()
                done.set_result(None)
                self.pending = Pending(step, t0, time.perf_counter() - t0, done, None)
            else:
                resp = dcp.async_save(
                    state,
                    checkpoint_id=str(path),
                    storage_writer=writer,
                    process_group=self.group,
                    async_stager=self.stager,
                )
                self.pending = Pending(
                    step,
                    t0,
                    time.perf_counter() - t0,
                    resp.upload_completion,
                    resp.staging_completion,
                )
        except SAVE_ERRORS as e:  # storage errors must not stop training
            self._failed(step, e, time.perf_counter() - t0)
            return
        if self.mode == "sync":
            self.finish()

    def wait_staged(self) -> None:
        """Block until the in-flight save has its own copy of the tensors."""
        p = self.pending
        if p is not None and p.staging is not None and not p.staging.done():
            t0 = time.perf_counter()
            p.staging.result()
            p.blocking_s += time.perf_counter() - t0

    def poll(self) -> None:
        """Hand a finished upload to the hashing thread; report the commits it finished."""
        if self.pending is not None and self.pending.upload.done():
            self.finish()
        while self.settling and self.settling[0].done.done():
            self._settled(self.settling.pop(0))

    def finish(self) -> None:
        """Wait for the in-flight upload (not for its hashing), then queue its commit. A wait
        here holds the training thread (the next save's, or the last at close): it counts as
        the save's blocking time."""
        p, self.pending = self.pending, None
        if p is None:
            return
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            p.upload.result()
        except SAVE_ERRORS as e:
            error = e
        p.blocking_s += time.perf_counter() - t0
        if error is not None:
            self._failed(p.step, error, p.blocking_s)
            return
        # Every rank reached here: DCP's upload future completes only after the
        # coordinator gathered all ranks' write results.
        self.settling.append(Settling(p, self.hashing.submit(self._commit, p.step)))

    def _commit(self, step: int) -> BaseException | None:
        """On the hashing thread: rank 0 gathers every rank's digests into the manifest."""
        if self.rank != 0:
            return None
        try:
            self.store.commit(step, self.meta, ranks=self.world)
            if self.history is None:  # standalone: this process is the pointer's only writer
                remove_checkpoints(self.store.dir, self.store.record(step, self.keep))
        except (OSError, DamagedCheckpoint) as e:
            return e
        return None

    def _settled(self, s: Settling) -> None:
        p = s.save
        err = s.done.result()
        if err is not None:
            self._failed(p.step, err, p.blocking_s)
            return
        self.last_committed = p.step
        self.report(
            {
                "event": "checkpoint",
                "step": p.step,
                "path": str(self.store.step_dir(p.step)),
                "keep": self.keep,
                "blocking_s": p.blocking_s,
                "total_s": time.perf_counter() - p.started,
            }
        )

    def _failed(self, step: int, err: BaseException, blocking_s: float) -> None:
        if self.rank == 0:
            self.store.discard(step)
            print(
                f"[meshkeeper] WARNING: checkpoint at step {step} FAILED and was discarded: "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; training "
                f"continues, last committed checkpoint: step {self.last_committed}",
                file=sys.stderr,
                flush=True,
            )
        self.report(
            {
                "event": "checkpoint_failed",
                "step": step,
                "error": f"{type(err).__name__}: {err}"[:500],
                "blocking_s": blocking_s,
            }
        )

    def close(self) -> None:
        self.finish()
        t0 = time.perf_counter()
        self.hashing.shutdown(wait=True)  # the last commit: the trainer waits for it to exit
        if self.settling:
            self.settling[-1].save.blocking_s += time.perf_counter() - t0
        for s in self.settling:
            self._settled(s)
        self.settling = []
        if self.mode == "async":
            self.stager.close()

    def abandon(self) -> None:
        """A failed generation's end in a process that goes on (handoff.py): no queued commit
        starts. An upload or commit already running is not waited for (a large one takes
        minutes): it writes only into this generation's directory, which nothing restores
        from, since its `committed` line goes to a metrics file no agent reads any more."""
        self.hashing.shutdown(wait=False, cancel_futures=True)
        self.pending = None

    # -- restore -------------------------------------------------------------------------
    def restore(self) -> Committed | None:
        """Load the newest committed checkpoint that verifies; None when there is none.
        Raises ResumeRefused when it was trained on other data than this job's stream."""
        history = self.store.history() if self.history is None else self.history
        verdicts = _VerdictBoard(self.rank, self.world)
        ckpt = None
        for ptr in history:
            ckpt, problem = self._verify_shared(ptr, verdicts)
            if ckpt is not None:
                break
            if self.rank == 0:
                print(
                    f"[meshkeeper] WARNING: skipping checkpoint {problem}; trying the previous one",
                    file=sys.stderr,
                    flush=True,
                )
                self.report({"event": "checkpoint_skipped", "reason": problem})
        if ckpt is None:
            return None
        state = self.state_dict(0)
        dcp.load(state, checkpoint_id=str(ckpt.path), process_group=self.group)
        self.data.check_resume(state["train_state"])  # the same on every rank: all refuse
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            set_model_state_dict(part, state["model"], options=LOAD)
            set_optimizer_state_dict(part, opt, state["optim"], options=LOAD)
        for sched in self.lr_schedulers:
            sched.load_state_dict(state["train_state"]["lr_scheduler"])
        self.last_committed = ckpt.step
        return ckpt

    def _verify_shared(self, ptr: Pointer, verdicts: _VerdictBoard) -> tuple[Committed | None, str]:
        """Every rank checks the manifest and hashes its share of the files; all ranks then
        agree on the first problem any of them found ("" when none)."""
        ckpt, problem = None, ""
        try:
            ckpt = self.store.read_manifest(ptr)
            files = ckpt.manifest["files"]
            check_files(ckpt, share(files, self.rank, self.world))
        except DamagedCheckpoint as e:
            problem = str(e)
        problem = verdicts.agree(f"{ptr.generation}/{ptr.step}", problem, Path(ptr.path))
        return (None if problem else ckpt), problem


class _VerdictBoard:
    """Restore verdicts exchanged through this generation's rendezvous store (its own key
    space of the job's store: `rendezvous_store`). A store wait has its own timeout, sized
    for hashing the checkpoint; a collective would give up after max(60 s, hang_after_s)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.kv = rendezvous_store("meshkeeper/restore-verdicts")

    def agree(self, key: str, mine: str, directory: Path) -> str:
        """The first non-empty verdict in rank order, once every rank posted its own."""
        self.kv.set(f"{key}/{self.rank}", mine)
        keys = [f"{key}/{r}" for r in range(self.world)]
        self.kv.wait(keys, timedelta(seconds=hash_timeout_s(directory)))
        return next((v for v in (self.kv.get(k).decode() for k in keys) if v), "")


MESH_KEYS = ("dp", "pp", "tp", "ep")  # a manifest without ep was saved with ep 1


def staging_options(device: torch.device) -> StagingOptions:
    """How an async save copies the state off the device: on a GPU into pinned host memory,
    without blocking the training stream; in the background everywhere."""
    on_gpu = device.type == "cuda"
    return StagingOptions(
        use_pinned_memory=on_gpu,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=on_gpu,
    )


def restored_line(ckpt: Committed, now: dict) -> str:
    was = ckpt.manifest.get("mesh", {})
    fmt = lambda m: " ".join(f"{k}{m.get(k, 1 if k == 'ep' else '?')}" for k in MESH_KEYS)  # noqa: E731
    note = "same mesh" if was == now else "resharded"
    return (
        f"[meshkeeper] resumed from step {ckpt.step} ({ckpt.path}): saved on {fmt(was)}, "
        f"now {fmt(now)} ({note})"
    )
