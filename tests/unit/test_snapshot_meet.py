"""Buddies in one host's memory (worker/trainer/snapshot.py `Snapshotter._meet`): found once
when the snapshotter starts, after which the ward links each slot into its holder's `held/`
ring itself and sends only the step. Two real gloo ranks, each with a snapshot root of its
own, as two agents on one host have: the ward's copies must land under the holder's root,
as links to the ward's own files, and a holder that names a directory of another shape for
them is refused.

The rank side is this module's `__main__`, under tests/rankrun.py.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import run_ranks, scenario_lines

STEPS = 5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("agents")
    proc = run_ranks(2, "tests.unit.test_snapshot_meet", [str(root)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return scenario_lines(proc)


def test_a_wards_copies_land_under_its_holders_root_as_links_to_its_own_files(results):
    for r in results["two-agents"]:
        assert r["held_here"], r
        assert r["holder_reported"] == {str(1 - r["rank"]): "link"}, r
        # every step but the newest one's slot rewritten since: the holder's ring keeps them
        assert r["held_steps"] and r["held_steps"][-1] == STEPS, r
        assert r["held_is_ward_file"], r


def test_a_holder_that_names_a_directory_of_another_shape_is_refused(results):
    ward = results["lying-holder"][1]  # rank 0 lied to rank 1, its ward
    assert "named" in ward["error"] and "held/r1" in ward["error"], ward


# -- the rank side -----------------------------------------------------------------------
def _trainer(rank: int, device):
    from services.spec import parse_spec
    from tests.stack import tiny_spec
    from worker.trainer.parallel import ParallelDims, RankContext
    from worker.trainer.step import Trainer

    spec = parse_spec(
        tiny_spec("meet", parallel={"zero": 3}, train={"steps": STEPS, "global_batch": 4})
    )
    dims = ParallelDims(spec.parallel, device.type)
    return Trainer(spec, RankContext(dims, dims.build_mesh(), rank, device))


def _two_agents(rank: int, device, root) -> dict:
    from worker.snapshots import SnapshotPlan, complete_slots
    from worker.trainer.snapshot import Snapshotter

    t = _trainer(rank, device)
    plans = [SnapshotPlan(root / f"agent{r}" / "job", 1, 1, 2, {0: 1, 1: 0}) for r in (0, 1)]
    lines: dict[int, dict] = {}
    snaps = Snapshotter(plans[rank], rank, device, lambda x: lines.update({x["step"]: x}), t.parts)
    parts = (t.parts, t.optimizers, t.schedulers)
    for index in range(STEPS):
        t.train_step(index, before_update=lambda s=index + 1: snaps.before_update(s, t.optimizers))
        snaps.take(index + 1, *parts, {"step": index + 1})
    snaps.close()
    held_here = snaps.holder_here
    # in a barrier, so both rings are final: this rank's held copies, made by its ward
    import torch.distributed as dist

    dist.barrier()
    ward = 1 - rank
    held = complete_slots(plans[rank].held_dir(ward), 1)
    own = complete_slots(plans[ward].own_dir(ward), 1)
    return {
        "scenario": "two-agents",
        "rank": rank,
        "held_here": held_here,
        "holder_reported": lines[STEPS].get("held_via"),
        "held_steps": sorted(held),
        "held_is_ward_file": all(
            s in own and held[s].bin.stat().st_ino == own[s].bin.stat().st_ino for s in held
        ),
    }


def _lying_holder(rank: int, device, root) -> dict:
    from worker.snapshots import SnapshotPlan
    from worker.trainer.snapshot import Snapshotter

    t = _trainer(rank, device)
    plan = SnapshotPlan(root / "lying" / "job", 1, 1, 2, {0: 1, 1: 0})
    if rank == 0:  # names another directory for its ward's copies
        object.__setattr__(plan, "held_dir", lambda ward, g=None: root / "lying" / "elsewhere")
    try:
        Snapshotter(plan, rank, device, lambda x: None, t.parts).close()
        error = ""
    except ValueError as e:
        error = str(e)
    return {"scenario": "lying-holder", "rank": rank, "error": error}


def _main() -> None:
    import sys
    from pathlib import Path

    import torch

    from worker.trainer.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    rank, _, device = init_distributed(timeout_s=60)
    try:
        root = Path(sys.argv[1])
        print(json.dumps(_two_agents(rank, device, root)), flush=True)
        print(json.dumps(_lying_holder(rank, device, root)), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    _main()
