"""Which device a rank gets: the controller gives a moved rank a slot of its new worker
(controller/recovery.py), and the agent re-derives the device index from its own device
count at every launch (worker/devices.py `device_indices`)."""

from __future__ import annotations

import pytest

from controller.placement import FreeWorker
from controller.recovery import replace_workers
from services.assignment import RankEntry
from services.mesh import MeshShape
from worker.devices import device_indices


def test_a_replacement_with_fewer_devices_gives_the_moved_ranks_its_own_slots():
    # ranks 6 and 7 ran in slots 6 and 7 of the 8-device worker w1 (as a shrink that dropped
    # its other replicas leaves them); w1 dies, and the spare s1 has 2 devices
    shape = MeshShape(1, 1, 8)
    ranks = [RankEntry(r, "w0" if r < 6 else "w1", r, shape.coord(r)) for r in range(8)]
    spare = FreeWorker("s1", "b", "10.0.0.2", 2)
    layout = replace_workers(shape, ranks, 1, {"w1"}, [spare], [], {"w0": "a", "w1": "a"})
    moved = [(r.rank, r.wid, r.local_rank) for r in layout.ranks if r.wid == "s1"]
    assert moved == [(6, "s1", 0), (7, "s1", 1)]
    kept = [(r.rank, r.local_rank) for r in layout.ranks if r.wid == "w0"]
    assert kept == [(r, r) for r in range(6)]


def test_valid_slots_are_the_devices():
    assert device_indices({4: 1, 5: 0}, 2) == {4: 1, 5: 0}


def test_slots_beyond_the_workers_devices_are_renumbered_in_slot_order():
    # an assignment written before slots were renumbered on replacement: slots 6 and 7
    assert device_indices({7: 7, 6: 6}, 2) == {6: 0, 7: 1}


def test_duplicate_slots_get_distinct_devices():
    assert device_indices({3: 0, 2: 0}, 4) == {2: 0, 3: 1}


def test_more_ranks_than_devices_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="3 ranks assigned to a worker with 2 device"):
        device_indices({0: 0, 1: 1, 2: 2}, 2)
