"""The agent's side of the records (worker/agent/metrics_tail.py, rank_progress.py): a trainer's
metrics file read as it grows, and the RankReport fields folded from it."""

from __future__ import annotations

import json
import logging

from services.records import RankReport, StepRecord
from worker.agent.metrics_tail import (
    CheckpointCommitted,
    CheckpointFailed,
    CorruptionFound,
    MetricsTail,
    Milestone,
    OtherEvent,
    Restored,
    SnapshotTaken,
)
from worker.agent.rank_progress import RankProgress


def step(n: int, compute_s: float = 0.1, time: float = 1000.0) -> dict:
    return {
        "step": n,
        "loss": 5.0 - n / 10,
        "tokens_per_s": 800.0,
        "step_s": 0.2,
        "compute_s": compute_s,
        "wait_s": 0.05,
        "lr": 1e-3,
        "grad_norm": 1.5,
        "rank": 0,
        "time": time,
    }


def test_a_partial_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "metrics-0.jsonl"
    tail = MetricsTail(path, rank=0)
    assert tail.read() == []  # no file yet: the trainer has not opened it
    whole = json.dumps(step(1)) + "\n"
    second = json.dumps(step(2))
    path.write_text(whole + second[:17])
    first = tail.read()
    assert first == [StepRecord(**step(1))]
    with path.open("a") as f:
        f.write(
            second[17:]
            + "\n"
            + json.dumps(
                {"event": "checkpoint", "step": 2, "path": "/c/2", "keep": 3, "blocking_s": 0.01}
            )
            + "\n"
        )
    rest = tail.read()
    assert rest == [
        StepRecord(**step(2)),
        CheckpointCommitted(event="checkpoint", step=2, path="/c/2", keep=3, blocking_s=0.01),
    ]
    assert tail.read() == []


def test_events_are_typed_and_a_bad_line_is_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics-3.jsonl"
    lines = [
        {"event": "started", "started_at": 10.0},
        {"event": "restored", "step": 40, "restore_s": 0.5},
        {"event": "ready", "ready_at": 12.0, "start_step": 40},
        {"step": 41, "loss": "not a number"},
        {"event": "done", "final_loss": 1.0, "steps": 10},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    with caplog.at_level(logging.WARNING, "meshkeeper.agent"):
        got = MetricsTail(path, rank=3).read()
    assert got == [
        Milestone(event="started", started_at=10.0),
        Restored(event="restored", step=40, restore_s=0.5),
        Milestone(event="ready", ready_at=12.0, start_step=40),
        OtherEvent(event="done"),
    ]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all(m.startswith("rank 3: unreadable metrics line") for m in warned)
    assert "loss" in warned[0] and "not json" in warned[1]


def test_step_is_the_trainers_completed_steps_and_the_resume_step_before_the_first():
    p = RankProgress(started_at=100.0, window=2)
    assert p.fields()["step"] == 0 and p.fields()["state"] == "starting"
    offset = 5.0  # server time = trainer time + 5
    p.absorb(Milestone(event="started", started_at=90.0), now=101.0, offset=offset)
    p.absorb(Restored(event="restored", step=40, restore_s=0.5), now=102.0, offset=offset)
    assert p.fields()["step"] == 40  # restoring: it resumes at 40, never reports going back to 0
    p.absorb(Milestone(event="ready", ready_at=97.0, start_step=40), now=103.0, offset=offset)
    for n, compute in ((41, 0.3), (42, 0.1), (43, 0.2)):
        p.absorb(StepRecord(**step(n, compute, time=98.0 + n - 41)), now=104.0, offset=offset)
    report = RankReport(**p.fields())
    assert report.model_dump(exclude_none=True) == {
        "state": "running",
        "step": 43,
        "loss": 5.0 - 4.3,
        "tokens_per_s": 800.0,
        "step_s": 0.2,
        "compute_s": 0.2,
        "wait_s": 0.05,
        "started_at": 95.0,
        "ready_at": 102.0,
        "start_step": 40,
        "first_step_at": 103.0,
        "progress_at": 104.0,
        "compute_avg": (0.1 + 0.2) / 2,
        "compute_min": 0.1,
        "window_n": 2,
        "overheads": {"checkpoint_s": 0.0, "snapshot_s": 0.0, "eval_s": 0.0},
    }


def test_a_fresh_rank_reports_step_zero_and_the_agents_launch_time():
    p = RankProgress(started_at=100.0)
    p.absorb(Milestone(event="ready", ready_at=3.0, start_step=0), now=104.0, offset=100.0)
    f = p.fields()
    assert (f["step"], f["started_at"], f["ready_at"], f["first_step_at"]) == (
        0,
        100.0,
        103.0,
        None,
    )


def test_the_latest_eval_stays_in_the_report_between_evals_and_the_epoch_is_the_latest(tmp_path):
    """Lines as the trainer writes them (a StepRecord dumped to JSON, eval fields on the steps
    an eval ran after), read by the agent's tail: the report carries the newest eval with the
    step it was measured at, through the steps that had none."""
    path = tmp_path / "metrics-0.jsonl"
    evals = {2: (3.25, 0.5), 4: (3.0, 0.75)}  # step -> (eval_loss, eval_s)
    lines = []
    for n in range(1, 6):
        eval_loss, eval_s = evals.get(n, (None, None))
        rec = StepRecord(**step(n), epoch=n // 3, eval_loss=eval_loss, eval_s=eval_s)
        lines.append(json.dumps(rec.model_dump()))
    tail, p = MetricsTail(path, rank=0), RankProgress(started_at=100.0)

    def report(upto: int) -> dict:
        """The report once the trainer has written steps up to `upto`."""
        with path.open("a") as f:
            f.writelines(line + "\n" for line in lines[p.step : upto])
        for line in tail.read():
            p.absorb(line, now=101.0, offset=0.0)
        r = RankReport.model_validate_json(RankReport(**p.fields()).model_dump_json())
        return {k: getattr(r, k) for k in ("step", "epoch", "eval_loss", "eval_step", "eval_s")}

    assert report(1) == {
        "step": 1,
        "epoch": 0,
        "eval_loss": None,
        "eval_step": None,
        "eval_s": None,
    }
    assert report(3) == {"step": 3, "epoch": 1, "eval_loss": 3.25, "eval_step": 2, "eval_s": 0.5}
    assert report(5) == {"step": 5, "epoch": 1, "eval_loss": 3.0, "eval_step": 4, "eval_s": 0.75}


def test_a_gpu_ranks_straggler_window_holds_its_device_probe_not_its_step_clock():
    """On a GPU the step clock counts waits on NCCL as compute (every rank reports its slowest
    peer's time), so the window takes the device probe's GEMM time where a step carries one."""
    p = RankProgress(started_at=100.0, window=3)
    for n, (compute, probe) in enumerate(((0.9, 0.0004), (0.8, 0.0006), (0.9, 0.0005)), 1):
        p.absorb(StepRecord(**step(n, compute), probe_s=probe), now=104.0, offset=0.0)
    f = p.fields()
    assert (f["compute_s"], f["compute_min"], f["window_n"]) == (0.9, 0.0004, 3)
    assert abs(f["compute_avg"] - 0.0005) < 1e-12


def test_a_corruption_report_keeps_which_check_found_it():
    """The controller words its fault by the check (controller/health.py): the agent must pass
    `check` on, not drop it as an unknown field."""
    p = RankProgress(started_at=100.0)
    line = {"event": "sdc", "check": "at_rest", "step": 6, "clean_step": 5, "tensor": "w"}
    p.absorb(
        CorruptionFound(**line, ranks=[1], suspects=[1], detail="moved"), now=104.0, offset=0.0
    )
    assert p.fields()["sdc"]["check"] == "at_rest"


def test_overheads_total_what_the_training_thread_spent_outside_steps_after_the_first():
    """The goodput ledger's checkpoint, snapshot and eval time (controller/goodput.py): each
    save's and snapshot's blocking time and each eval's time, from the generation's first step
    on. The snapshot of the state it resumed at and the first step's eval come before that
    step's line (its first_step_at): they are the start's, which the controller times."""
    p = RankProgress(started_at=100.0)
    p.absorb(Milestone(event="ready", ready_at=1.0, start_step=40), now=101.0, offset=100.0)
    lines = [
        SnapshotTaken(event="snapshot", step=40, blocking_s=0.5),  # the start state's
        StepRecord(**step(41), eval_loss=3.0, eval_s=1.0),  # the first step's eval
        SnapshotTaken(event="snapshot", step=41, blocking_s=0.25),
        CheckpointCommitted(event="checkpoint", step=41, blocking_s=0.125),
        StepRecord(**step(42), eval_loss=2.9, eval_s=1.5),
        CheckpointFailed(event="checkpoint_failed", step=42, blocking_s=0.0625),
        SnapshotTaken(event="snapshot", step=42),  # an older trainer's line: no time
    ]
    for line in lines:
        p.absorb(line, now=102.0, offset=100.0)
    assert RankReport(**p.fields()).overheads.model_dump() == {
        "checkpoint_s": 0.1875,
        "snapshot_s": 0.25,
        "eval_s": 1.5,
    }
