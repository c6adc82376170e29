"""Which snapshots are whole and which are logged steps (worker/trainer/snapshot.py), and a
chain restoring the very bits on real gloo ranks, with sharded (FSDP) and TP-placed
parameters: the first snapshot is whole, then one in `full_every`, a checked one, and the
first after a failed copy; the rings keep the chains their sizes promise.

The rank side is this module's `__main__`: two ranks under tests/rankrun.py, each a buddy of
the other, snapshot after every step of a tiny model and print one JSON line per scenario.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import rank_scenarios

SCENARIOS = ("dp2-zero3", "dp2-zero3-mb2", "tp2")
PARALLEL = {  # mb2: two microbatches, whose gradients FSDP adds into the first one's
    "dp2-zero3": {"dp": 2, "zero": 3},
    "dp2-zero3-mb2": {"dp": 2, "zero": 3, "microbatches": 2},
    "tp2": {"tp": 2},
}
STEPS = 10
CHECKED = 6  # a snapshot taken right after a passed corruption check
BLOCKED = 2  # this step's copy fails: its slot's file cannot be mapped
REPLAYED_AT = 9  # the state after this step is restored from its chain after step 10


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("snapshots")  # both ranks' worker directory
    return rank_scenarios(2, "tests.unit.test_snapshot_chain", SCENARIOS, [str(root)])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_whole_snapshots_come_first_every_fourth_when_checked_and_after_a_failed_copy(
    results, scenario
):
    want = {
        0: "whole",  # the first
        1: "grads",
        BLOCKED: None,  # failed
        3: "whole",  # the chain had a gap
        4: "grads",
        5: "grads",
        CHECKED: "whole",
        7: "grads",
        8: "grads",
        9: "grads",
        10: "whole",  # full_every (4) after the last whole one
    }
    for r in results[scenario]:
        assert {int(s): k for s, k in r["kinds"].items()} == want, r


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_rings_keep_every_chain_since_the_newest_whole_snapshots(results, scenario):
    """keep 2 whole slots (6, 10) and the logged steps after the older (7, 8, 9): a held
    ring has full_every + keep - 3 = 3 logged slots, a rank's own two more (5), claimed a
    step earlier and by every step, so the chains survive there too."""
    for r in results[scenario]:
        assert r["restorable"] == [6, 7, 8, 9, 10], r
        assert r["held_restorable"] == [6, 7, 8, 9, 10], r


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_chain_restores_the_state_bit_for_bit(results, scenario):
    for r in results[scenario]:
        assert r["chain"] == [CHECKED, 7, 8, REPLAYED_AT], r
        assert r["same_as_live"], r
        assert r["differs_after_the_next_step"], r  # the comparison can fail


@pytest.mark.parametrize("scenario", ["dp2-zero3", "dp2-zero3-mb2"])
def test_fsdp_reduces_a_logged_steps_gradients_into_its_slot(results, scenario):
    """From the second step on (the first teaches each reduce-scatter its output's size), a
    logged step under FSDP copies only its buffers: its gradients were reduced into its slot
    (with microbatches, the first one's, which FSDP adds the others into)."""
    for r in results[scenario]:
        copied = {int(s): c for s, c in r["copied"].items()}
        assert copied[1] > 100 * r["buffer_bytes"], copied  # step 1: every gradient copied
        assert [copied[s] for s in (4, 5, 7, 8, 9)] == [r["buffer_bytes"]] * 5, copied


def test_without_fsdp_a_logged_step_copies_its_gradients(results):
    """Under TP alone nothing reduces into slots: every logged step copies all it holds."""
    for r in results["tp2"]:
        copied = {int(s): c for s, c in r["copied"].items()}
        assert [copied[s] for s in (4, 5, 7, 8, 9)] == [copied[1]] * 5, copied


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_training_with_snapshots_gives_the_bits_of_training_without(results, scenario):
    """Gradients reduced into slots are the very gradients of a run without snapshots (FSDP
    views them out of the slot: a wrong offset there would alias them)."""
    for r in results[scenario]:
        assert r["same_as_without_snapshots"], r


# -- the rank side -----------------------------------------------------------------------
def _scenario(name: str, parallel: dict, rank: int, device, root) -> dict:
    import torch

    from services.spec import parse_spec
    from worker.snapshots import SnapshotPlan, chains, complete_slots
    from worker.trainer.parallel import ParallelDims, RankContext
    from worker.trainer.sdc import state_tensors
    from worker.trainer.snapshot import Snapshotter
    from worker.trainer.snapshot_state import load_chain
    from worker.trainer.step import Trainer

    spec = parse_spec(
        {
            "name": name,
            "model": {"preset": "tiny"},
            "data": {"source": "synthetic", "seed": 7},
            "parallel": parallel,
            "train": {"steps": STEPS, "global_batch": 4, "lr": 3e-3, "warmup_steps": 2},
        }
    )
    dims = ParallelDims(spec.parallel, device.type)
    mesh = dims.build_mesh()
    reference = Trainer(spec, RankContext(dims, mesh, rank, device))  # never snapshotted
    for index in range(REPLAYED_AT):
        reference.train_step(index)
    t = Trainer(spec, RankContext(dims, mesh, rank, device))
    plan = SnapshotPlan(root / name, 1, 1, 2, {0: 1, 1: 0}, full_every=4)
    lines: dict[int, dict] = {}
    snaps = Snapshotter(plan, rank, device, lambda x: lines.update({x["step"]: x}), t.parts)
    parts = (t.parts, t.optimizers, t.schedulers)

    def state() -> list:
        return [x.clone() for _, x in state_tensors(t.parts, t.optimizers)]

    live = None
    blocked = plan.own_dir(rank) / "grads-1.bin"  # the logged ring's second slot, first used at 2
    snaps.take(0, *parts, {"step": 0})
    for index in range(STEPS):
        step = index + 1
        if step == BLOCKED:  # before the step: its gradients are reduced into its slot
            blocked.mkdir(parents=True)  # a directory: the slot's file cannot be mapped
        t.train_step(index, before_update=lambda s=step: snaps.before_update(s, t.optimizers))
        snaps.take(step, *parts, {"step": step}, checked=step == CHECKED)
        snaps.wait_held()
        if step == BLOCKED:
            blocked.rmdir()
        if step == REPLAYED_AT:
            live = state()
    snaps.close()

    own = chains(complete_slots(plan.own_dir(rank), 1))
    held = chains(complete_slots(plan.held_dir(1 - rank), 1))
    differs = any(not torch.equal(a, b) for a, b in zip(state(), live, strict=True))
    chain = own[REPLAYED_AT]
    images = [
        (s.manifest, torch.from_file(str(s.bin), size=s.manifest["nbytes"], dtype=torch.uint8))
        for s in chain
    ]
    load_chain(t.parts, t.optimizers, t.schedulers, images)
    return {
        "scenario": name,
        "rank": rank,
        "kinds": {s: line.get("kind") for s, line in sorted(lines.items())},
        "copied": {s: line.get("copied_bytes") for s, line in sorted(lines.items())},
        "buffer_bytes": sum(b.nbytes for part in t.parts for b in part.buffers()),
        "restorable": sorted(own),
        "held_restorable": sorted(held),
        "chain": [s.step for s in chain],
        "same_as_live": all(torch.equal(a, b) for a, b in zip(state(), live, strict=True)),
        "differs_after_the_next_step": differs,
        "same_as_without_snapshots": all(
            torch.equal(a, b.detach())
            for a, (_, b) in zip(
                live, state_tensors(reference.parts, reference.optimizers), strict=True
            )
        ),
    }


def _main() -> None:
    import sys
    from pathlib import Path

    import torch

    from worker.trainer.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    rank, _, device = init_distributed(timeout_s=60)
    root = Path(sys.argv[1])
    try:
        for name in SCENARIOS:
            print(json.dumps(_scenario(name, PARALLEL[name], rank, device, root)), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    _main()
