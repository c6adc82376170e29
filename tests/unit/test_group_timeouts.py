"""Every process group a trainer uses times out after the spec's `hang_after_s`
(worker/trainer/distributed.py `hold_timeouts`): the world, each mesh dimension's group, and
the checkpoint's own gloo group (made at the first save) and the group each rank shares with
its snapshot buddy, which torch would otherwise give its 30-minute default. Read back from
the groups of a real 4-rank trainer (dp2 x tp2)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tests.launch import read_records, train
from tests.stack import tiny_spec
from worker.snapshots import SnapshotPlan

HANG_AFTER_S = 75.0


def test_every_group_the_trainer_uses_times_out_after_hang_after_s(tmp_path):
    spec = tiny_spec(
        "group-timeouts",
        parallel={"dp": 2, "tp": 2},
        train={"steps": 2},
        checkpoint={"every_steps": 1, "mode": "async"},
        fault_tolerance={"hang_after_s": HANG_AFTER_S},
    )
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        plan = SnapshotPlan(Path(shm) / "job", 0, 1, 2, {0: 1, 1: 0, 2: 3, 3: 2})
        plan_file = tmp_path / "snapshot.json"
        plan_file.write_text(json.dumps(plan.to_json()))
        extra = ["--checkpoint-root", str(tmp_path / "ckpt"), "--snapshot-plan", str(plan_file)]
        train(spec, tmp_path, extra=extra, timeout=240)
    groups = {}
    for r in read_records(tmp_path):  # rank 0's: at start, then the checkpoint's at its save
        if r.get("event") == "groups":
            groups.update(r["timeout_s"])
    names = ("world", "dp", "pp", "tp", "checkpoint", "snapshot:1")  # rank 0's buddy is 1
    assert groups == {name: HANG_AFTER_S for name in names}
