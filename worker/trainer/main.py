"""Trainer entry point: `torchrun --nproc-per-node N -m worker.trainer --spec job.yaml`.

Also callable in-process as `main(argv)` (the agent's warm processes do that), with the
same torchrun environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
Without them it runs as a single process.

Exit codes the controller reads as deterministic failures (a restart would repeat them;
docs/architecture.md, "Failure handling"): 2 for a spec, data or checkpoint that cannot be
used as given, 3 for a non-finite loss or gradient, 5 for an allocator out of memory
(worker/trainer/oom.py; the job fails with reason OutOfMemory). Exit code 7: a device error
(worker/trainer/device_fault.py; its worker is replaced and quarantined). Exit code 4: silent
data corruption, found by DP replicas whose state disagreed (worker/trainer/sdc.py) or by a
re-executed microbatch that differed (worker/trainer/spot_check.py); the evidence is the
metrics file's `sdc` line, and the controller replaces the blamed rank's worker and rolls
back.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from dataset.format import DatasetError, content_id, read_manifest
from services.hang_bounds import collective_timeout_s
from services.procs import write_output_to
from services.records import EXIT_DEVICE, EXIT_SUSPENDED
from services.spec import JobSpec, SpecError, check_world_size, load_spec
from worker.ckpt_store import CheckpointStore, DamagedCheckpoint, read_history
from worker.flight_record import dump_prefix
from worker.handoff_order import Order
from worker.hf.export import ExportError, export_in_place
from worker.hf.weights import WeightsError
from worker.mfu import default_peak_flops, device_peak_flops, flops_per_token, mfu
from worker.progress import Collectives, counters_path
from worker.snapshots import SnapshotPlan
from worker.trainer.anomaly import AnomalyWatch
from worker.trainer.at_rest import AtRestCheck
from worker.trainer.chaos import BackwardNoise, BitFlips, DeviceErrors, DeviceOoms, StepFloor
from worker.trainer.checkpoint import Checkpointer, restored_line
from worker.trainer.device_fault import DeviceFault, explain_fault, is_device_fault
from worker.trainer.distributed import hold_timeouts, init_distributed, shutdown_distributed
from worker.trainer.drain import Drain
from worker.trainer.handoff import Handoff, abort_connections
from worker.trainer.io_progress import IoProgress
from worker.trainer.memory import return_freed_memory
from worker.trainer.metrics_file import MetricsFile
from worker.trainer.oom import EXIT_OOM, OutOfMemory, explain, is_out_of_memory
from worker.trainer.parallel import ParallelDims, RankContext, mesh_groups
from worker.trainer.run_record import RunRecord
from worker.trainer.sdc import ReplicaCheck, SilentCorruption
from worker.trainer.sdc_guard import CorruptionGuard
from worker.trainer.snapshot import Snapshotter
from worker.trainer.snapshot_restore import restore_from_memory
from worker.trainer.spot_check import SpotCheck
from worker.trainer.step import NonFiniteError, StepResult, Trainer
from worker.trainer.storage_check import StorageNotShared, check_shared
from worker.trainer.train_state import DataStream, ResumeRefused


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m worker.trainer", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--spec", required=True, help="job spec (YAML or JSON)")
    ap.add_argument(
        "--metrics-out", help="JSON lines, one per step; '{rank}' in the path = one file per rank"
    )
    ap.add_argument(
        "--checkpoint-root", help="checkpoint directory root (overrides checkpoint.root)"
    )
    ap.add_argument(
        "--generation",
        type=int,
        default=0,
        help="the job's generation: checkpoints are written under g{generation}/ only",
    )
    ap.add_argument(
        "--job-id",
        help="the controller's job id, recorded as every checkpoint's "
        "writer (default: the spec's name)",
    )
    ap.add_argument(
        "--restore-from",
        help="JSON file with the committed checkpoint pointers, "
        "newest first (the agent writes it from Redis); without it a standalone run "
        "follows its own {checkpoint root}/{name}/committed.json",
    )
    ap.add_argument(
        "--snapshot-plan",
        help="JSON file with the in-memory snapshot plan (worker/snapshots.py; the agent writes "
        "it): where this worker keeps snapshots, the buddy holders, and what a recovery "
        "restores from; without it no snapshots are taken",
    )
    ap.add_argument(
        "--run-record",
        help="directory of the job's TensorBoard run record, shared by its generations "
        "(worker/trainer/run_record.py; the agent passes it); rank 0 writes it",
    )
    ap.add_argument(
        "--drain-file",
        help="file the agent writes a step number to when the job is suspended: the trainer "
        f"commits that step and exits {EXIT_SUSPENDED} (worker/trainer/drain.py)",
    )
    ap.add_argument(
        "--handoff",
        help="file the agent writes the next generation's order to, for this process to run "
        "it in place instead of exiting (worker/trainer/handoff.py)",
    )
    ap.add_argument("--quiet", action="store_true", help="no per-step lines")
    return ap.parse_args(argv)


def mesh_record(spec: JobSpec) -> dict[str, int]:
    """The layout a checkpoint manifest names; ep only where experts are split, so a dense
    job's manifests read as before."""
    p = spec.parallel
    return {"dp": p.dp, "pp": p.pp, "tp": p.tp} | ({"ep": p.ep} if p.ep > 1 else {})


def make_checkpointer(
    args,
    spec: JobSpec,
    trainer: Trainer,
    metrics: MetricsFile,
    stream: DataStream,
    timeout_s: float,
) -> Checkpointer | None:
    root = args.checkpoint_root or spec.checkpoint.root
    if not root:
        return None
    meta = {
        "job": spec.name,
        "torch": torch.__version__,
        "mesh": mesh_record(spec),
        "model": spec.model.model_dump(mode="json"),  # what an export writes (worker/hf)
    }
    store = CheckpointStore(root, spec.name, generation=args.generation, writer=args.job_id)
    history = read_history(args.restore_from) if args.restore_from else None
    return Checkpointer(
        store,
        model_parts=trainer.parts,
        optimizers=trainer.optimizers,
        lr_schedulers=trainer.schedulers,
        data=stream,
        device=trainer.ctx.device,
        mode=spec.checkpoint.mode,
        keep=spec.checkpoint.keep,
        meta=meta,
        report=metrics.write,
        history=history,
        write_delay_s=spec.chaos.save_delay_s if spec.chaos else 0.0,
        timeout_s=timeout_s,
    )


def resume(
    ckpt: Checkpointer | None,
    plan: SnapshotPlan | None,
    trainer: Trainer,
    spec: JobSpec,
    say,
    metrics: MetricsFile,
    io: IoProgress,
    stream: DataStream,
) -> tuple[int, str]:
    """Steps already completed, and where this rank's state came from: the old generation's
    in-memory snapshots when every rank's state is there (and no disk checkpoint is newer),
    else the newest committed checkpoint that verifies, else 0 (and only then are the seed's
    weights generated)."""
    if plan is not None:
        ctx = trainer.ctx
        history = ckpt.history if ckpt else None
        hot = restore_from_memory(
            plan,
            ctx.rank,
            dist.get_world_size(),
            model_parts=trainer.parts,
            optimizers=trainer.optimizers,
            lr_schedulers=trainer.schedulers,
            data=stream,
            disk_step=history[0].step if history else None,
        )
        if hot is not None:
            say(
                f"[meshkeeper] resumed from step {hot.step} in host memory "
                f"(generation {plan.restore_generation}, this rank from {hot.source}, "
                f"via {hot.via}, {hot.replayed} logged steps replayed) in "
                f"{hot.restore_s:.2f}s",
                flush=True,
            )
            metrics.write(
                {
                    "event": "restored",
                    "step": hot.step,
                    "restore_s": hot.restore_s,
                    "source": hot.source,
                    "via": hot.via,
                    "replayed": hot.replayed,
                }
            )
            return hot.step, f"host memory ({hot.source}, via {hot.via})"
    t0 = time.perf_counter()
    with io.phase("restore"):
        restored = ckpt.restore() if ckpt else None
    if restored is None:
        with io.phase("init"):  # a fresh start: nothing was restored over the parameters
            trainer.init_weights()
        return 0, "the seed"
    say(restored_line(restored, mesh_record(spec)), flush=True)
    metrics.write(
        {
            "event": "restored",
            "step": restored.step,
            "restore_s": time.perf_counter() - t0,
            "source": "disk",
        }
    )
    return restored.step, f"the checkpoint {restored.path}"


def corrupted(
    e: SilentCorruption, ckpt: Checkpointer | None, snaps: Snapshotter | None, metrics: MetricsFile
) -> int:
    """Report the evidence, keep only checked snapshots for the recovery, exit 4."""
    metrics.write({"event": "sdc", **e.evidence})
    if ckpt:
        ckpt.close()
    if snaps:
        snaps.close()
        snaps.discard_after(e.evidence["clean_step"])
    metrics.close()
    print(f"meshkeeper: silent data corruption: {e}", file=sys.stderr, flush=True)
    return 4


def export_final(out: Path, ckpt: Checkpointer, steps: int, write, say) -> None:
    """`checkpoint.export_hf`: the committed final step as a Hugging Face directory, reported
    as an `export` event (with `error` when it failed). A failed export fails no training: the
    job still succeeds, and its status says the export did not happen and why."""
    if ckpt.last_committed != steps:
        error = f"the last committed checkpoint is step {ckpt.last_committed}, not {steps}"
        write({"event": "export", "path": str(out), "step": steps, "error": error})
        say(f"[meshkeeper] export to {out} skipped: {error}", flush=True)
        return
    try:
        done = export_in_place(ckpt.store.step_dir(steps), out, say=lambda line: None)
    except (ExportError, DamagedCheckpoint, OSError) as e:
        write({"event": "export", "path": str(out), "step": steps, "error": str(e)[:500]})
        say(f"[meshkeeper] export to {out} FAILED: {e}", flush=True)
        return
    write({"event": "export", "path": str(out), "step": steps, "bytes": done["bytes"]})
    say(
        f"[meshkeeper] exported step {steps} to {out}: {done['tensors']} tensors, "
        f"{done['bytes'] / 1e9:.2f} GB in {done['seconds']} s",
        flush=True,
    )


def sdc_line(spec: JobSpec, replicas: bool, spot: bool) -> str:
    """What this layout checks for silent data corruption, for the job's log."""
    at_rest = spec.sdc.at_rest
    rest = "; each rank verifies its own state at rest between steps" if at_rest else ""
    if replicas:
        return f"DP replicas compare state fingerprints every {spec.sdc.every_steps} steps{rest}"
    if spot:
        return (
            f"no DP replicas with identical state: every {spec.sdc.spot_every_steps} steps each "
            "rank re-executes one microbatch and compares the results bitwise (spot check)" + rest
        )
    return (
        f"no DP replicas with identical state, and pipeline layouts (pp {spec.parallel.pp}) run "
        "no spot checks (one microbatch cannot run through a schedule built for "
        f"{spec.parallel.microbatches}): "
        + (
            "only state at rest is checked, each rank its own between steps"
            if at_rest
            else "silent data corruption is not checked"
        )
    )


def run_record(args, start: int, origin: str, rank: int) -> RunRecord | None:
    """Rank 0's TensorBoard record of the job, when the agent names its directory; every
    generation after the first notes where it took up the run, a start over from the seed
    too (a fault before anything was saved)."""
    if not args.run_record or rank != 0:
        return None
    record = RunRecord(Path(args.run_record), start)
    if start or args.generation > 1:
        record.note(start, f"generation {args.generation} resumed after step {start} from {origin}")
    return record


def peak_flops(spec: JobSpec, device: torch.device) -> float:
    """One rank's peak FLOP/s, as the agent's MFU gauge takes it (worker/mfu.py)."""
    if device.type == "cuda":
        found = device_peak_flops(
            torch.cuda.get_device_name(device), spec.parallel.matmul_precision
        )
        if found:
            return found
    return default_peak_flops(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def data_stream(spec: JobSpec) -> DataStream:
    """What a checkpoint of this job must match; a prepared dataset by its content, so a
    resume onto another one is refused rather than trained on silently."""
    kind, _, path = spec.data.source.partition(":")
    source = content_id(read_manifest(path)) if kind == "dataset" else None
    return DataStream(spec.data.seed, spec.train.global_batch, source)


def run(args: argparse.Namespace, restartable: bool = False) -> int:
    """One generation's training; `restartable`: this process takes its next generation's
    order in place (worker/trainer/handoff.py), which its agent reads from `started`."""
    started_at = time.time()
    spec = load_spec(args.spec)
    metrics = MetricsFile(args.metrics_out, int(os.environ.get("RANK", 0)))
    # Milestones as they happen: the controller reads them as progress (a slow start is not
    # a hang) and turns them into a recovery's phase durations.
    metrics.write({"event": "started", "started_at": started_at, "restartable": restartable})
    hang_after_s = spec.fault_tolerance.hang_after_s
    io = IoProgress(metrics.write, hang_after_s)
    return_freed_memory()  # before the first large tensor (memory.py)
    timeout_s = collective_timeout_s(
        hang_after_s, torch.cuda.is_available(), stepping=False, params=spec.model.params
    )
    # NCCL's flight recorder dumps beside the metrics file, where the agent reads it
    flight = dump_prefix(Path(args.metrics_out)) if args.metrics_out else None
    rank, world, device = init_distributed(timeout_s=timeout_s, flight=flight)
    world_at = time.time()  # the store met and the world group formed (bench/recovery_scale.py)
    quiesce = True
    # what a failed generation stops before this process takes the next (handoff.py): no
    # thread of this one may still write a snapshot or a checkpoint while the next restores
    unwind = contextlib.ExitStack()
    try:
        check_world_size(spec, world)
        dims = ParallelDims(spec.parallel, device.type)
        ctx = RankContext(dims, dims.build_mesh(), rank, device)
        metrics.write({"event": "rendezvous", "rendezvous_at": time.time(), "world_at": world_at})
        # Collective progress for the agent, next to this rank's own metrics file. Only with a
        # per-rank template: without '{rank}' every rank would map the same file and truncate
        # it under the others (SIGBUS, "mmap length is greater than file size"), and no agent
        # reads it there anyway.
        per_rank = args.metrics_out and "{rank}" in args.metrics_out
        collectives = (
            Collectives(counters_path(args.metrics_out.replace("{rank}", str(rank))))
            if per_rank
            else None
        )
        trainer = Trainer(spec, ctx, collectives, weights=False)  # written by `resume`
        say = print if rank == 0 else (lambda *a, **k: None)
        floor = trainer.batches.entropy_floor()
        windows = trainer.batches.source.windows
        epochs = spec.train.steps * spec.train.global_batch / windows if windows else None
        say(
            f"[meshkeeper] {spec.name}: mesh dp={spec.parallel.dp} pp={spec.parallel.pp} "
            f"tp={spec.parallel.tp} zero={spec.parallel.zero}, {spec.train.steps} steps"
            + (f", entropy floor {floor:.4f} nats" if floor is not None else "")
            + (f", {windows:,} windows an epoch ({epochs:.2f} epochs)" if windows else ""),
            flush=True,
        )
        stream = data_stream(spec)
        ckpt = make_checkpointer(args, spec, trainer, metrics, stream, timeout_s)
        if ckpt is not None:
            unwind.callback(ckpt.abandon)
            check_shared(ckpt.store.dir)  # at start, never only at the first commit
        else:  # the agent always names a root: only a standalone run gets here
            say(
                "[meshkeeper] no checkpoints: neither --checkpoint-root nor checkpoint.root "
                f"is set, so checkpoint.every_steps ({spec.checkpoint.every_steps}) is unused and "
                "a crash loses the run; give one of them to save",
                flush=True,
            )
        plan = (
            SnapshotPlan.from_json(json.loads(Path(args.snapshot_plan).read_text()))
            if args.snapshot_plan
            else None
        )
        checks = ReplicaCheck.applies(spec)
        snaps = (
            Snapshotter(
                plan,
                rank,
                device,
                metrics.write,
                trainer.parts,
                pin_checked=checks,
                timeout_s=timeout_s,
            )
            if plan
            else None
        )
        if snaps:
            unwind.callback(snaps.abandon)
        # the checkpoint's group is made at its first use (Checkpointer.group), and says so
        groups = {"world": dist.group.WORLD, **mesh_groups(ctx.mesh)}
        if trainer.tied_copies:
            groups["tied head"] = trainer.tied_copies.group
        groups.update({f"snapshot:{peer}": g for peer, g in snaps.links.items()} if snaps else {})
        held = hold_timeouts(groups, timeout_s)
        metrics.write({"event": "groups", "timeout_s": held, "at": time.time()})
        guard = CorruptionGuard(ReplicaCheck(spec, ctx), trainer, snaps) if checks else None
        flips = (
            BitFlips(
                spec.chaos.bitflip,
                rank,
                args.generation,
                trainer.parts,
                trainer.optimizers,
                metrics.write,
            )
            if spec.chaos and spec.chaos.bitflip
            else None
        )
        ooms = (
            DeviceOoms(spec.chaos.device_oom, rank, device)
            if spec.chaos and spec.chaos.device_oom
            else None
        )
        device_errors = (
            DeviceErrors(spec.chaos.device_error, rank, args.generation)
            if spec.chaos and spec.chaos.device_error
            else None
        )
        if spec.chaos and spec.chaos.nondeterministic:
            trainer.backward_noise = BackwardNoise()
        paced = spec.chaos is not None and spec.chaos.min_step_s is not None
        pace = StepFloor(spec.chaos.min_step_s) if paced else None
        spot = SpotCheck(spec, trainer, flips) if SpotCheck.applies(spec) else None
        at_rest = AtRestCheck(trainer) if spec.sdc.enabled and spec.sdc.at_rest else None
        if spec.sdc.enabled:
            say(f"[meshkeeper] sdc: {sdc_line(spec, checks, spot is not None)}", flush=True)
        watch = AnomalyWatch(spec.sdc.anomaly_window, spec.sdc.anomaly_z)
        start, origin = resume(ckpt, plan, trainer, spec, say, metrics, io, stream)
        metrics.write({"event": "ready", "ready_at": time.time(), "start_step": start})
        record = run_record(args, start, origin, rank)
        flops, peak = flops_per_token(spec.model), peak_flops(spec, device)
        results: list[StepResult] = []
        every, steps = spec.checkpoint.every_steps, spec.train.steps
        drain, stopped = Drain(args.drain_file), None

        def before_update(step: int) -> None:
            if ckpt:  # nothing still copying may see the parameters change
                ckpt.wait_staged()
            if snaps:
                snaps.before_update(step, trainer.optimizers)
            if flips:
                flips.before_update(step)
            if ooms:
                ooms.during(step)
            if device_errors:
                device_errors.during(step)

        def settle(step: int, checked: bool) -> None:
            """Check the state after `step` when due, then snapshot it; the start state too,
            so a fault before the first periodic snapshot still restores from memory. A spot
            check runs after the snapshot: it vouches for that state (it never changes it), so
            its failure rolls back to `step` itself."""
            if at_rest:  # before anything copies the state
                at_rest.verify(checked_step=guard.clean_step if guard else None)
            if checked and guard:
                guard.verify(step)
            if snaps:
                snaps.poll()
                if snaps.due(step) or checked:
                    snaps.take(
                        step,
                        trainer.parts,
                        trainer.optimizers,
                        trainer.schedulers,
                        stream.train_state(step),
                        checked=checked and guard is not None,
                    )
            if spot and spot.due(step):
                spot.verify(step)

        try:
            if at_rest:
                at_rest.seal(start)
            if start < steps:
                settle(start, checked=True)
            for index in range(start, steps):
                if at_rest and index > start:  # settle(start) has just verified the start
                    at_rest.verify_here(checked_step=guard.clean_step if guard else None)
                r = trainer.train_step(index, before_update=lambda s=index + 1: before_update(s))
                if at_rest:  # as the update wrote it, before anything else runs
                    at_rest.seal(r.step)
                if flips:
                    flips.after_step(r.step)
                if guard:
                    guard.record(r.step)
                results.append(r)
                evaluated = spec.eval and (r.step % spec.eval.every_steps == 0 or r.step == steps)
                eval_loss, eval_s = (
                    trainer.evaluate(
                        spec.eval.batches,
                        lambda k, s=r.step: metrics.write({"event": "eval", "step": s, "batch": k}),
                    )
                    if evaluated
                    else (None, None)
                )
                metrics.step(r, eval_loss, eval_s)
                if record:
                    record.step(r, eval_loss, mfu(flops, r.tokens / r.step_s, world, peak))
                if r.step == start + 1 and device.type == "cuda":  # the first step is done
                    steady = collective_timeout_s(
                        hang_after_s, cuda=True, stepping=True, params=spec.model.params
                    )
                    metrics.write({"event": "groups", "timeout_s": hold_timeouts(groups, steady)})
                    if ckpt:
                        ckpt.hold_timeout(steady)
                for line in watch.observe(r.step, r.loss, r.grad_norm):
                    metrics.write(line)
                    say(
                        f"[meshkeeper] step {r.step}: {line['signal']} {line['value']:.4g} is "
                        f"{line['z']:+.1f} robust sigmas from the last {spec.sdc.anomaly_window} "
                        "steps' median",
                        flush=True,
                    )
                if r.step < steps and drain.due(r.step):
                    stopped = r.step
                save = ckpt is not None and (r.step % every == 0 or r.step == steps or stopped)
                # a checkpoint is only ever written of checked state
                # a check due (at most one kind runs: replicas or spot checks) snapshots first
                check = guard or spot
                settle(r.step, checked=save or (check is not None and check.due(r.step)))
                if not args.quiet:
                    say(
                        f"step {r.step:>6}/{steps}  loss {r.loss:.4f}  lr {r.lr:.2e}  "
                        f"|g| {r.grad_norm:.3f}  {r.tokens / r.step_s:,.0f} tok/s  "
                        f"{r.step_s * 1e3:.0f} ms"
                        + (f"  eval {eval_loss:.4f} ({eval_s:.2f} s)" if evaluated else ""),
                        flush=True,
                    )
                if ckpt:
                    ckpt.poll()
                    if save:
                        with io.phase("save", r.step):
                            ckpt.save(r.step)
                if flips:
                    flips.between_steps(r.step)
                if pace:
                    pace.wait()
                if stopped:
                    break
        except SilentCorruption as e:
            quiesce = not e.alone  # found alone: the peers wait in a collective, not a barrier
            return corrupted(e, ckpt, snaps, metrics)
        finally:
            if record:
                record.close()
        if ckpt:
            with io.phase("save", stopped or steps):  # the last save's upload and commit
                ckpt.close()
        if snaps:
            snaps.close()
        if ckpt and spec.checkpoint.export_hf and not stopped:
            # the group's last act first, on every rank: no peer may wait at the teardown
            # barrier for as long as rank 0's export takes (minutes at real sizes)
            shutdown_distributed(quiesce=True)
            if rank == 0:
                with io.phase("export", steps):
                    export_final(Path(spec.checkpoint.export_hf), ckpt, steps, metrics.write, say)
        if stopped:
            metrics.write({"event": "suspended", "step": stopped})
            metrics.close()
            kept = "committed, the job resumes from it" if ckpt else "no checkpoint root: lost"
            say(f"[meshkeeper] suspended after step {stopped}: {kept}", flush=True)
            return EXIT_SUSPENDED
        if not results:
            say(f"[meshkeeper] nothing to do: the checkpoint is at the last step ({steps})")
            return 0
        tps = sum(r.tokens for r in results) / sum(r.step_s for r in results)
        summary = {
            "event": "done",
            "final_loss": results[-1].loss,
            "entropy_floor": floor,
            "tokens_per_s": tps,
            "steps": len(results),
        }
        metrics.write(summary)
        metrics.close()
        gap = (
            f" (entropy floor {floor:.4f}, gap {results[-1].loss / floor - 1:+.1%})"
            if floor
            else ""
        )
        say(
            f"[meshkeeper] done: final loss {results[-1].loss:.4f}{gap}, {tps:,.0f} tokens/s",
            flush=True,
        )
        return 0
    except BaseException as e:
        quiesce = False  # failed on its own: the peers may never reach a barrier
        if restartable:  # every collective of every thread fails now, so each can be joined
            abort_connections()
            unwind.close()
        if is_out_of_memory(e):
            raise explain(e, spec, device) from e
        if is_device_fault(e):
            raise explain_fault(e, device) from e
        raise
    finally:
        shutdown_distributed(quiesce)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # `kill -USR1 <trainer pid>` writes every thread's Python stack to the rank's log, where
    # `meshkeeper logs JOB --rank R` reads it: where a hung or slow rank is, without a debugger
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    while True:
        outcome = attempt(args)
        if isinstance(outcome, int):
            return outcome
        args = take_order(outcome, args.generation)


def attempt(args: argparse.Namespace) -> int | Order:
    """One generation in this process: its exit code, or the next generation's order when the
    agent handed one over (worker/trainer/handoff.py)."""
    handoff = None
    try:
        spec = load_spec(args.spec) if args.handoff else None
    except SpecError:
        spec = None  # `run` says what is wrong with it (exit 2)
    if spec is not None and not torch.cuda.is_available():  # why not on CUDA: handoff.py
        # the order follows the controller's decision, which a dead worker's silence
        # (dead_after_s) and a lost pub/sub message (the agent's 5 s re-read) can delay
        park_s = spec.fault_tolerance.dead_after_s + 10.0
        handoff = Handoff(Path(args.handoff), args.generation, park_s)
    try:
        outcome = run_guarded(args, handoff)
        if isinstance(outcome, int):
            return outcome
        # The generation's objects are garbage once its traceback is: freed now, while the
        # order is awaited (a rank whose peer died waits here from the moment it failed)
        gc.collect()
        if spec.chaos and spec.chaos.unwind_stall_s:  # a rank stuck in native code, for tests
            time.sleep(spec.chaos.unwind_stall_s)
        order = handoff.wait()
        if order is None:  # no recovery came: exit as an uncaught error would
            print(outcome, file=sys.stderr, end="", flush=True)
            return 1
        last = outcome.strip().splitlines()[-1][:300]
        print(
            f"[meshkeeper] generation {args.generation} ended here ({last}); this process "
            f"goes on as generation {order.generation}",
            flush=True,
        )
        return order
    finally:
        if handoff:
            handoff.close()


def run_guarded(args: argparse.Namespace, handoff: Handoff | None) -> int | str:
    """`run`, its known failures turned into exit codes. A failure that may end in an order
    (one arrived, or a peer's failure caused it) is returned as its traceback's text."""
    try:
        return run(args, restartable=handoff is not None)
    except (SpecError, DatasetError, StorageNotShared, WeightsError) as e:
        print(f"meshkeeper: {e}", file=sys.stderr)
        return 2
    except ResumeRefused as e:
        print(f"meshkeeper: cannot resume: {e}", file=sys.stderr)
        return 2
    except OutOfMemory as e:
        print(f"meshkeeper: {e}", file=sys.stderr)
        return EXIT_OOM
    except DeviceFault as e:  # never kept for the next generation: its CUDA context is lost
        print(f"meshkeeper: {e}", file=sys.stderr)
        return EXIT_DEVICE
    except NonFiniteError as e:
        print(f"meshkeeper: training stopped: {e}", file=sys.stderr)
        return 3
    except Exception as e:
        if handoff is None or not handoff.may_follow(e):
            raise
        return traceback.format_exc()


def take_order(order: Order, was: int) -> argparse.Namespace:
    """Become the order's rank: its log, its environment, its arguments."""
    write_output_to(order.log)
    os.environ.update(order.env)
    print(
        f"[meshkeeper] trainer pid {os.getpid()} kept for rank {order.env.get('RANK')} "
        f"(generation {was} -> {order.generation})",
        flush=True,
    )
    return parse_args(order.argv)
