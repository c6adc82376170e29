"""Mixture of experts against a single process on the same batches, fp32 within rtol 1e-5
(issue 17): expert parallelism alone and with DP, PP and TP, dropless; and, with a capacity
that drops choices, an ep2 run whose checkpoint resumes resharded on ep1.

Routing is computed per sequence (worker/trainer/moe.py), so every layout must route, drop
and balance exactly as the single process: each case compares the tokens every expert
computed at every step, not only the losses."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.launch import run_trainer, step_records, train
from worker.ckpt_store import CheckpointStore

STEPS = 6
BASE = {
    "name": "moe",
    "model": {"preset": "tiny", "experts": 4, "top_k": 2},
    "data": {"source": "synthetic", "seed": 3},
    "train": {"steps": STEPS, "global_batch": 8, "lr": 1.0e-3, "warmup_steps": 3, "grad_clip": 1.0},
}
# parallel.ep is carved out of dp: "dp2 x ep2" is four DP ranks in two groups of two
LAYOUTS = {
    "ep2": {"dp": 2, "ep": 2},
    "dp2xep2": {"dp": 4, "ep": 2, "zero": 0},
    "pp2xep2": {"dp": 2, "ep": 2, "pp": 2, "microbatches": 2},
    "tp2xep2": {"dp": 2, "ep": 2, "tp": 2},
}


def with_(parallel: dict, **model) -> dict:
    spec = copy.deepcopy(BASE)
    spec["parallel"] = parallel
    spec["model"].update(model)
    return spec


def assert_same_training(got: list[dict], want: list[dict], what: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want], what
    for g, w in zip(got, want, strict=True):
        step = g["step"]
        assert g["experts"]["tokens"] == w["experts"]["tokens"], f"{what}: step {step} routing"
        assert g["experts"]["dropped"] == w["experts"]["dropped"], f"{what}: step {step} drops"
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), f"{what}: step {step} loss"


@pytest.fixture(scope="module")
def reference(uninterrupted) -> list[dict]:
    records = uninterrupted(with_({}))
    assert records[-1]["loss"] < records[0]["loss"] - 0.1, "the reference did not learn"
    # dropless: every choice computed, 8 sequences x 32 tokens x top 2 x 4 layers per step
    assert all(r["experts"]["dropped"] == 0 for r in records)
    assert all(sum(r["experts"]["tokens"]) == 8 * 32 * 2 * 4 for r in records)
    return records


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_moe_parity(layout, reference, uninterrupted):
    assert_same_training(uninterrupted(with_(LAYOUTS[layout])), reference, layout)


def history_of(root: Path, step: int, path: Path) -> list[str]:
    """`--restore-from` a pointer history naming only `step` of the standalone run in `root`."""
    kept = [p for p in CheckpointStore(root, BASE["name"]).history() if p.step == step]
    assert kept, f"no committed checkpoint of step {step} in {root}"
    path.write_text(json.dumps([asdict(p) for p in kept]))
    return ["--restore-from", str(path)]


@pytest.mark.slow
def test_capacity_drops_and_resumes_resharded_from_ep2_to_ep1(tmp_path, uninterrupted):
    capped = with_({}, capacity_factor=1.0)
    want = uninterrupted(capped)
    assert all(r["experts"]["dropped"] > 0 for r in want), "capacity 1.0 should drop choices"
    root = tmp_path / "root"
    saved = with_({"dp": 2, "ep": 2}, capacity_factor=1.0)
    saved["checkpoint"] = {"every_steps": 3, "keep": 5, "mode": "sync"}
    got = train(saved, tmp_path / "ep2", extra=["--checkpoint-root", str(root)])
    assert_same_training(got, want, "ep2 with capacity")
    resumed = with_({}, capacity_factor=1.0)  # ep1: every expert on the one rank
    out = run_trainer(
        resumed,
        tmp_path / "ep1",
        extra=["--checkpoint-root", str(tmp_path / "root-ep1")]
        + history_of(root, 3, tmp_path / "history.json"),
    )
    assert "resumed from step 3 " in out.stdout and "resharded" in out.stdout, out.stdout
    assert_same_training(step_records(tmp_path / "ep1"), want[3:], "resumed on ep1")
