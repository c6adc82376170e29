"""Buddy copies that cross the network stream their bytes (worker/trainer/snapshot_wire.py,
`ImageStream`): every chunk leaves once the copy has written it, the stamped header last, then
whether the copy completed. Two real gloo ranks, each in memory of its own (a mount namespace
with a fresh tmpfs on /dev/shm, as two hosts have), holding each other's copies, in chunks of
4 KiB so every snapshot takes many: whole snapshots, and logged steps whose gradients FSDP
reduced into the slot before the copy began. The holder's copy must be the ward's slot byte
for byte; an image whose copy failed after its offer must not be committed.

The rank side is this module's `__main__`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from bench.common import start_apart
from services.procs import free_port

CHUNK = 4096
STEPS = 6


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    # as on hosts of their own: no process outside a rank sees its slots
    procs = start_apart([sys.executable, "-m", "tests.unit.test_snapshot_stream"], 2, free_port())
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"this test needs root (unshare, mount): {err[-3000:]}"
    out: dict[str, list[dict]] = {}
    for stdout, _ in outs:
        for r in map(json.loads, (x for x in stdout.splitlines() if x.startswith("{"))):
            out.setdefault(r["scenario"], []).append(r)
    for rows in out.values():
        rows.sort(key=lambda r: r["rank"])
    return out


@pytest.mark.parametrize("scenario", ["whole", "logged"])
def test_a_holder_on_another_host_gets_the_wards_slots_byte_for_byte(results, scenario):
    rows = results[scenario]
    for holder in rows:
        ward = rows[1 - holder["rank"]]
        assert not holder["holder_here"], holder  # apart: the bytes crossed the network
        assert holder["held_via"] == {str(ward["rank"]): "network"}, holder
        assert holder["errors"] == [], holder
        common = sorted(set(holder["held"]) & set(ward["own"]))
        assert str(STEPS) in common, (holder["held"], ward["own"])
        for step in common:
            assert holder["held"][step] == ward["own"][step], step
        assert min(ward["nbytes"].values()) > 8 * CHUNK, ward["nbytes"]  # many chunks each
    if scenario == "logged":  # gradients reduced into the slot went with the copied rest
        kinds = {k for r in rows for k in r["kinds"].values()}
        assert kinds == {"whole", "grads"}, kinds


def test_an_image_whose_copy_failed_after_its_offer_is_not_committed(results):
    complete, failed = results["stream-flag"][0]["received"]
    assert complete == {"complete": True, "same": True}
    assert failed["complete"] is False


# -- the rank side -----------------------------------------------------------------------
def _digests(d: Path) -> dict[str, str]:
    from worker.snapshots import complete_slots

    return {
        str(step): hashlib.sha256(slot.bin.read_bytes()[: slot.manifest["nbytes"]]).hexdigest()
        for step, slot in complete_slots(d, 1).items()
    }


def _buddies(rank: int, device, scenario: str) -> dict:
    from services.spec import parse_spec
    from tests.stack import tiny_spec
    from worker.snapshots import SnapshotPlan, complete_slots
    from worker.trainer.parallel import ParallelDims, RankContext
    from worker.trainer.snapshot import Snapshotter
    from worker.trainer.step import Trainer

    parallel = {"dp": 2, "zero": 3}
    spec = parse_spec(
        tiny_spec("stream", parallel=parallel, train={"steps": STEPS, "global_batch": 4})
    )
    dims = ParallelDims(spec.parallel, device.type)
    t = Trainer(spec, RankContext(dims, dims.build_mesh(), rank, device))
    full_every = 4 if scenario == "logged" else 1
    root = Path("/dev/shm") / "stream" / scenario / "job"  # each rank's own tmpfs
    plan = SnapshotPlan(root, 1, 1, 2, {0: 1, 1: 0}, full_every=full_every)
    lines: dict[int, dict] = {}
    report = lambda x: lines.update({x["step"]: x})  # noqa: E731
    snaps = Snapshotter(plan, rank, device, report, t.parts, chunk_bytes=CHUNK)
    parts = (t.parts, t.optimizers, t.schedulers)
    for index in range(STEPS):
        t.train_step(index, before_update=lambda s=index + 1: snaps.before_update(s, t.optimizers))
        snaps.take(index + 1, *parts, {"step": index + 1})
    snaps.close()
    own = complete_slots(plan.own_dir(rank), 1)
    return {
        "scenario": scenario,
        "rank": rank,
        "holder_here": snaps.holder_here,
        "held_via": lines[STEPS].get("held_via"),
        "errors": [x["error"] for x in lines.values() if "error" in x],
        "own": _digests(plan.own_dir(rank)),
        "held": _digests(plan.held_dir(1 - rank)),
        "nbytes": {str(s): slot.manifest["nbytes"] for s, slot in own.items()},
        "kinds": {str(s): slot.manifest["kind"] for s, slot in own.items()},
    }


def _stream_flag(rank: int) -> dict:
    """Rank 1 streams one image completely and one whose copy 'failed'; rank 0 receives."""
    import torch

    from worker.trainer.snapshot_wire import ImageReceipt, ImageStream

    nbytes = 64 + 5 * CHUNK + 100
    sent = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    received = []
    for complete in (True, False):
        if rank == 1:
            stream = ImageStream(sent, nbytes, 0, None, CHUNK)
            stream.upto(nbytes // 2)
            for w in stream.end(complete):
                w.wait()
        else:
            image = torch.zeros(nbytes, dtype=torch.uint8)
            got = ImageReceipt(image, nbytes, 1, None, CHUNK).complete()
            received.append({"complete": got, "same": bool(torch.equal(image, sent))})
    return {"scenario": "stream-flag", "rank": rank, "received": received}


def _main() -> None:
    import torch

    from worker.trainer.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    rank, _, device = init_distributed(timeout_s=60)
    try:
        for scenario in ("whole", "logged"):
            print(json.dumps(_buddies(rank, device, scenario)), flush=True)
        print(json.dumps(_stream_flag(rank)), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    _main()
