"""Which in-memory snapshot slots count as complete (worker/snapshots.py): only those whose
manifest was written, for the generation asked, over bytes that are all there and stamped
with the manifest's id."""

from __future__ import annotations

from pathlib import Path

from worker.snapshots import (
    SnapshotPlan,
    complete_slots,
    prune_generations,
    stamp,
    write_manifest,
)


def slot(d: Path, i: int, *, step: int, generation: int, nbytes: int, written: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    manifest = {"id": f"{step:016x}", "step": step, "generation": generation, "nbytes": nbytes}
    image = stamp(manifest) + b"\0" * (written - 8)
    (d / f"slot-{i}.bin").write_bytes(image)
    write_manifest(d / f"slot-{i}.json", manifest)


def test_a_slot_with_its_manifest_and_all_its_bytes_is_complete(tmp_path):
    slot(tmp_path, 0, step=7, generation=3, nbytes=128, written=128)
    slot(tmp_path, 1, step=8, generation=3, nbytes=128, written=128)
    assert sorted(complete_slots(tmp_path, 3)) == [7, 8]


def test_a_slot_without_a_manifest_is_never_read(tmp_path):
    slot(tmp_path, 0, step=7, generation=3, nbytes=128, written=128)
    (tmp_path / "slot-0.json").unlink()  # what a rewrite does first
    assert complete_slots(tmp_path, 3) == {}


def test_a_slot_shorter_than_its_manifest_says_is_not_complete(tmp_path):
    slot(tmp_path, 0, step=7, generation=3, nbytes=128, written=64)
    assert complete_slots(tmp_path, 3) == {}


def test_a_slot_whose_image_lost_its_stamp_is_not_complete(tmp_path):
    """What a ward's rewrite does to the file its holder links: its manifest stays, but the
    bytes are no longer the ones it describes."""
    slot(tmp_path, 0, step=7, generation=3, nbytes=128, written=128)
    with (tmp_path / "slot-0.bin").open("r+b") as f:
        f.write(bytes(8))
    assert complete_slots(tmp_path, 3) == {}


def test_a_slot_stamped_for_another_manifest_is_not_complete(tmp_path):
    slot(tmp_path, 0, step=7, generation=3, nbytes=128, written=128)
    with (tmp_path / "slot-0.bin").open("r+b") as f:
        f.write(stamp({"id": f"{8:016x}"}))
    assert complete_slots(tmp_path, 3) == {}


def test_another_generations_slot_is_not_this_ones(tmp_path):
    slot(tmp_path, 0, step=7, generation=2, nbytes=128, written=128)
    assert complete_slots(tmp_path, 3) == {}


def test_a_torn_manifest_is_ignored(tmp_path):
    slot(tmp_path, 0, step=7, generation=3, nbytes=128, written=128)
    (tmp_path / "slot-0.json").write_text('{"step": 7, "gener')
    assert complete_slots(tmp_path, 3) == {}


def test_pruning_keeps_only_the_named_generations(tmp_path):
    for g in (1, 2, 3):
        (tmp_path / f"g{g}" / "r0").mkdir(parents=True)
    prune_generations(tmp_path, {3, 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g2", "g3"]


def test_the_plan_round_trips_and_names_each_rank_its_wards(tmp_path):
    plan = SnapshotPlan(tmp_path, 4, 1, 2, {0: 1, 1: 0, 2: 1}, 3, {0: 0, 1: 0, 2: 2})
    back = SnapshotPlan.from_json(plan.to_json())
    assert back == plan
    assert (back.wards(1), back.wards(0), back.wards(2)) == ([0, 2], [1], [])
    assert back.held_dir(2, 3) == tmp_path / "g3" / "held" / "r2"
