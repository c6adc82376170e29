"""A job's run record (worker/trainer/run_record.py), read back the way TensorBoard reads it
(its own EventAccumulator): every scalar at its step with the value written, a recovered
generation's record appended to the same directory with each step there exactly once, and a
disk that fails mid-run costs one warning line, never the trainer."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.stack import ROOT
from worker.trainer.run_record import RunRecord
from worker.trainer.step import StepResult


def result(step: int, loss: float) -> StepResult:
    return StepResult(
        step=step,
        loss=loss,
        grad_norm=0.75,
        lr=0.001,
        step_s=0.25,
        compute_s=0.2,
        wait_s=0.05,
        tokens=4096,
        probe_s=None,
        peak_mem_bytes=1 << 20,
    )


def f32(x: float) -> float:
    """What a TensorBoard scalar holds: a float32."""
    return float(np.float32(x))


def read(logdir) -> EventAccumulator:
    ea = EventAccumulator(str(logdir))
    ea.Reload()
    return ea


def scalars(ea: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def notes(ea: EventAccumulator) -> list[tuple[int, str]]:
    return [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors("notes/text_summary")
    ]


def test_every_scalar_reads_back_at_its_step_with_its_value(tmp_path):
    rec = RunRecord(tmp_path / "tb", start_step=0)
    for n in (1, 2, 3):
        rec.step(result(n, 4.0 - n / 3), eval_loss=2.5 if n == 2 else None, mfu=0.125 * n)
    rec.note(3, "resumed at step 2 from memory (generation 2)")
    rec.close()
    ea = read(tmp_path / "tb")
    assert scalars(ea, "train/loss") == [(n, f32(4.0 - n / 3)) for n in (1, 2, 3)]
    assert scalars(ea, "train/lr") == [(n, f32(0.001)) for n in (1, 2, 3)]
    assert scalars(ea, "train/grad_norm") == [(n, 0.75) for n in (1, 2, 3)]
    assert scalars(ea, "train/tokens_per_s") == [(n, 16384.0) for n in (1, 2, 3)]
    assert scalars(ea, "train/step_s") == [(n, 0.25) for n in (1, 2, 3)]
    assert scalars(ea, "train/mfu") == [(n, 0.125 * n) for n in (1, 2, 3)]
    # only the step an eval ran after has one
    assert scalars(ea, "eval/loss") == [(2, 2.5)]
    assert scalars(ea, "eval/perplexity") == [(2, f32(math.exp(2.5)))]
    assert notes(ea) == [(3, "resumed at step 2 from memory (generation 2)")]


def test_no_mfu_no_mfu_series(tmp_path):
    rec = RunRecord(tmp_path, start_step=0)
    rec.step(result(1, 3.0), eval_loss=None, mfu=None)
    rec.close()
    tags = read(tmp_path).Tags()["scalars"]
    assert "train/mfu" not in tags and "eval/loss" not in tags and "train/loss" in tags


def test_a_recovered_generation_appends_and_each_step_reads_once(tmp_path):
    """Generation 1 ran to step 10 (evals at 5 and 10) and died; generation 2 restored step 6
    and redid 7..12 with other losses. TensorBoard keeps 1..6 of the first and 7..12 of the
    second: nothing twice, nothing lost, the eval at 10 the second generation's."""
    first = RunRecord(tmp_path, start_step=0)
    for n in range(1, 11):
        first.step(result(n, 10.0 + n), eval_loss=100.0 + n if n % 5 == 0 else None, mfu=None)
    first.close()
    second = RunRecord(tmp_path, start_step=6)
    second.note(6, "resumed at step 6 from disk (generation 2)")
    for n in range(7, 13):
        second.step(result(n, 20.0 + n), eval_loss=200.0 + n if n % 5 == 0 else None, mfu=None)
    second.close()

    ea = read(tmp_path)
    assert scalars(ea, "train/loss") == [(n, 10.0 + n) for n in range(1, 7)] + [
        (n, 20.0 + n) for n in range(7, 13)
    ]
    assert scalars(ea, "eval/loss") == [(5, 105.0), (10, 210.0)]
    assert notes(ea) == [(6, "resumed at step 6 from disk (generation 2)")]


def test_a_failing_disk_turns_the_record_off_with_one_warning(tmp_path):
    """A real write failure (the file size limit: EFBIG, as a full disk gives ENOSPC) in a real
    process: the steps after it go on, the process ends normally, and stderr says so once."""
    script = textwrap.dedent(
        f"""
        import resource, signal
        from pathlib import Path
        from tests.unit.test_run_record import result
        from worker.trainer.run_record import RunRecord

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
        rec = RunRecord(Path({str(tmp_path / "tb")!r}), start_step=0)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        for n in range(1, 2001):
            rec.step(result(n, 1.0), eval_loss=None, mfu=None)
        rec.note(2000, "done")
        rec.close()
        print("trained to", n, "record on:", rec.writer is not None)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "trained to 2000 record on: False"
    # once, wherever it lands among the lines of tensorboard's writer thread's traceback
    assert out.stderr.count("meshkeeper: run record off") == 1, out.stderr
    assert "meshkeeper: run record off: OSError: [Errno 27] File too large\n" in out.stderr
    # what reached the file before the limit reads back in order, once each, and stops short
    # (which steps the reader keeps of a file cut mid-event depends on where the cut fell)
    steps = [e.step for e in read(tmp_path / "tb").Scalars("train/loss")]
    assert steps == sorted(set(steps)) and 0 < len(steps) < 2000


def test_a_directory_it_cannot_make_is_a_warning_not_an_error(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    rec = RunRecord(tmp_path / "file" / "tb", start_step=0)
    rec.step(result(1, 1.0), eval_loss=2.0, mfu=None)
    rec.note(1, "x")
    rec.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("meshkeeper: run record off:"), err
