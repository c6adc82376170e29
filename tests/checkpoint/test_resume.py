"""Resume with real processes: after SIGKILL mid-save, on other meshes, on other data, past
a corrupt shard.

Cheap by sharing: one uninterrupted dp2 run (`reference`) is both the losses every
resume is compared to and the checkpoints the resumes start from; the killed run serves two
tests; the reshard cases are a chain, each link resuming the previous link's checkpoint.
Resumes that must not touch `reference` get a pointer history of their own
(`--restore-from`, as an agent hands it) into a copy or straight into read-only checkpoints.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.procs import free_port
from tests.checkpoint.jobs import JOB, committed_steps, root_args
from tests.checkpoint.jobs import spec as job_spec
from tests.launch import (
    ENV,
    ROOT,
    kill_all,
    read_records,
    run_trainer,
    start_trainer,
    step_records,
    train,
    trainer_args,
    wait_for,
)
from worker.ckpt_store import MANIFEST

STEPS = 16
SAVED_ON = {"dp": 2}
SAVED_GENERATION = 3


def spec(**parallel) -> dict:
    """The job every resume here trains: STEPS steps, an async save every 2nd."""
    return job_spec(STEPS, 2, **parallel)


def losses(records: list[dict], first: int, last: int) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if first <= r["step"] <= last}


def since_last_restore(run_dir: Path) -> list[dict]:
    """The step records written after the last restore (a resumed run appends to the file)."""
    records = read_records(run_dir)
    last = max(i for i, r in enumerate(records) if r.get("event") == "restored")
    return [r for r in records[last:] if "step" in r and "event" not in r]


def step_dir(root: Path, generation: int, step: int) -> Path:
    return root / JOB / f"g{generation:06d}" / f"step-{step:08d}"


def restore_from(path: Path, root: Path, generation: int, steps: list[int]) -> list[str]:
    """`--restore-from` a pointer history (newest first) naming `steps` of `root`."""
    history = [
        {"step": s, "generation": generation, "path": str(step_dir(root, generation, s))}
        for s in steps
    ]
    path.write_text(json.dumps(history))
    return ["--restore-from", str(path)]


@dataclass(frozen=True)
class Reference:
    records: list[dict]
    root: Path  # checkpoints of every 2nd step, generation SAVED_GENERATION; never modified


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    d = tmp_path_factory.mktemp("reference")
    extra = root_args(d / "root") + ["--generation", str(SAVED_GENERATION)]
    return Reference(train(spec(**SAVED_ON), d / "run", extra=extra), d / "root")


@dataclass(frozen=True)
class Killed:
    run_dir: Path
    partial: list[Path]  # step directories with shards and no manifest at the kill
    committed: int  # the newest committed step at the kill
    resumed: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def killed_mid_save(tmp_path_factory) -> Killed:
    """The reference's spec, SIGKILLed (every rank at once) while an async save is in
    flight after a committed one, then run again to the end."""
    d = tmp_path_factory.mktemp("killed")
    run_dir, root = d / "run", d / "root"
    gen_dir = root / JOB / "g000000"
    proc = start_trainer(spec(**SAVED_ON), run_dir, root_args(root))

    def shards_without_manifest() -> bool:
        return any(
            any(s.glob("*.distcp")) and not (s / MANIFEST).exists() and committed_steps(root)
            for s in gen_dir.glob("step-*")
        )

    wait_for("a save in flight after a committed one", shards_without_manifest, proc)
    kill_all(proc)
    partial = [s for s in gen_dir.glob("step-*") if not (s / MANIFEST).exists()]
    committed = committed_steps(root)[-1]
    again = run_trainer(spec(**SAVED_ON), run_dir, extra=root_args(root), fresh=False)
    return Killed(run_dir, partial, committed, again)


@pytest.mark.slow
def test_sigkill_during_async_save_leaves_no_committed_partial(killed_mid_save):
    k = killed_mid_save
    assert k.partial, "the kill did not land inside a save"
    assert all(int(s.name[5:]) > k.committed for s in k.partial)
    # the partial save is newer but no pointer names it: it is never even looked at
    assert f"resumed from step {k.committed} " in k.resumed.stdout
    assert "WARNING" not in k.resumed.stderr


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(killed_mid_save, reference):
    k = killed_mid_save
    assert "same mesh" in k.resumed.stdout
    resumed = since_last_restore(k.run_dir)
    assert [r["step"] for r in resumed] == list(range(k.committed + 1, STEPS + 1))
    # every step after the restore equals the uninterrupted run's bit for bit
    assert losses(resumed, 1, STEPS) == losses(reference.records, k.committed + 1, STEPS)


RESHARD = [  # each link resumes the previous one's checkpoint of `step`, the first the
    # reference's: dp 2->1, 1->4, 4->2; pp 1->2, 2->1; tp 1->2, 2->1; zero 3->2
    ("dp2-to-pp2tp2", {"pp": 2, "tp": 2, "microbatches": 2}, 4),
    ("pp2tp2-to-dp4zero2", {"dp": 4, "zero": 2}, 8),
    ("dp4-to-dp2", {"dp": 2}, 12),
]


@pytest.fixture(scope="module")
def reshard_chain(tmp_path_factory, reference):
    """link index -> (stdout, step records) of that link's run, each link run once."""
    runs: dict[int, tuple[str, list[dict], Path]] = {}

    def link(i: int) -> tuple[str, list[dict], Path]:
        if i not in runs:
            prev_root, prev_gen = (
                (reference.root, SAVED_GENERATION) if i == 0 else (link(i - 1)[2], 0)
            )
            _, mesh, step = RESHARD[i]
            d = tmp_path_factory.mktemp(f"link{i}")
            extra = root_args(d / "root") + restore_from(d / "h.json", prev_root, prev_gen, [step])
            out = run_trainer(spec(**mesh), d / "run", extra=extra)
            runs[i] = (out.stdout, step_records(d / "run"), d / "root")
        return runs[i]

    return link


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(RESHARD)), ids=[r[0] for r in RESHARD])
def test_resume_on_another_mesh(reshard_chain, reference, i):
    stdout, records, _ = reshard_chain(i)
    step = RESHARD[i][2]
    assert f"resumed from step {step} " in stdout and "resharded" in stdout
    got, want = losses(records, step + 1, STEPS), losses(reference.records, step + 1, STEPS)
    assert got.keys() == want.keys() and len(got) == STEPS - step
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=1e-5), f"step {s}"


def tied(parallel: dict) -> dict:
    """The job with its LM head tied to the embedding."""
    s = spec(**parallel)
    s["model"]["tie_embeddings"] = True
    return s


@pytest.mark.slow
def test_a_tied_head_resumes_onto_a_pipeline_and_back(tmp_path):
    """A pipeline's last stage holds a copy of a tied head's weight under the embedding's own
    name (worker/trainer/tied_copies.py): it restores from the one saved tensor, a pipeline
    saves the two copies as that one tensor, and the losses stay the uninterrupted run's."""
    root = tmp_path / "reference-root"
    extra = root_args(root) + ["--generation", str(SAVED_GENERATION)]
    want = losses(train(tied(SAVED_ON), tmp_path / "reference", extra=extra), 1, STEPS)
    piped = tmp_path / "piped-root"
    extra = root_args(piped) + restore_from(tmp_path / "h1.json", root, SAVED_GENERATION, [4])
    pipeline = {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}
    got = losses(run_and_read(tied(pipeline), tmp_path / "piped", extra), 5, STEPS)
    extra = root_args(tmp_path / "back-root") + restore_from(tmp_path / "h2.json", piped, 0, [10])
    back = losses(run_and_read(tied(SAVED_ON), tmp_path / "back", extra), 11, STEPS)
    assert got.keys() == set(range(5, STEPS + 1)) and back.keys() == set(range(11, STEPS + 1))
    for s, loss in [*got.items(), *back.items()]:
        assert loss == pytest.approx(want[s], rel=1e-5), f"step {s}"


def run_and_read(s: dict, run_dir: Path, extra: list[str]) -> list[dict]:
    out = run_trainer(s, run_dir, extra=extra)
    assert "resharded" in out.stdout, out.stdout[-2000:]
    return step_records(run_dir)


def run_ranks(s: dict, run_dir: Path, extra: list[str]) -> list[subprocess.CompletedProcess]:
    """Every rank as its own `python -m worker.trainer` process, as an agent starts them (no
    torchrun, whose own traceback on a failed rank would hide the trainer's): each rank's
    exit code and output."""
    world, args = trainer_args(s, run_dir, extra)
    cmd = [sys.executable, "-m", "worker.trainer", *args]
    rdzv = {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**ENV, **rdzv, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


REFUSED = {  # a changed spec field -> the message the resume must stop with
    "data.seed": "checkpoint step 16 was trained with data.seed=11; this spec has data.seed=12: "
    "resume with the original seed or start a new job",
    "train.global_batch": "checkpoint step 16 consumed 128 samples (train.global_batch=8); this "
    "spec has train.global_batch=16, which makes 256: resume with the "
    "original global batch or start a new job",
}


@pytest.mark.slow
@pytest.mark.parametrize("field", list(REFUSED))
def test_resume_on_other_data_is_refused(tmp_path, reference, field):
    """A checkpoint resumed with another data seed or global batch would train on samples it
    never saw while claiming its step: the trainer exits 2 (a deterministic failure for the
    controller) with one line naming the field and the fix, and trains nothing."""
    changed = job_spec(20, 2, mode="sync", dp=2)  # another mesh alone would resume (resharded)
    section, key = field.split(".")
    changed[section][key] = {"data.seed": 12, "train.global_batch": 16}[field]
    history = restore_from(tmp_path / "h.json", reference.root, SAVED_GENERATION, [STEPS])
    for rank in run_ranks(changed, tmp_path / "resumed", root_args(tmp_path / "new") + history):
        assert (rank.returncode, rank.stderr) == (
            2,
            f"meshkeeper: cannot resume: {REFUSED[field]}\n",
        )
    assert step_records(tmp_path / "resumed") == []
    assert not (tmp_path / "new").exists()  # nothing was saved


@pytest.mark.slow
def test_corrupt_shard_falls_back_to_previous(tmp_path, reference):
    root = tmp_path / "root"
    shutil.copytree(reference.root, root)
    shard = sorted(step_dir(root, SAVED_GENERATION, STEPS).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    manifest = json.loads((step_dir(root, SAVED_GENERATION, 14) / MANIFEST).read_text())
    assert manifest["generation"] == SAVED_GENERATION
    assert manifest["mesh"] == {"dp": 2, "pp": 1, "tp": 1}
    history = restore_from(tmp_path / "h.json", root, SAVED_GENERATION, [STEPS, 14])
    run_dir = tmp_path / "run"
    again = run_trainer(
        spec(**SAVED_ON), run_dir, extra=root_args(root) + history + ["--generation", "4"]
    )
    assert f"g000003/step-{STEPS:08d}: checksum mismatch in {shard.name}" in again.stderr
    assert "resumed from step 14 " in again.stdout
    assert [r["step"] for r in step_records(run_dir)] == [15, 16]
