"""What the controller reads again on every pass is only what changed (issue 15): progress
through the `workers:reported` index (services/progress.py), registrations per join
(`Store.registrations`), assignments per generation (`services.assignment.current`).
Against a real redis-server; each test one behaviour."""

from __future__ import annotations

import pytest

from services import assignment
from services.assignment import Assignment, RankEntry
from services.mesh import Coord, MeshShape
from services.progress import RESYNC_S, ProgressMirror
from services.store import Store, flat


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def mirrored(store):
    clock = Clock()
    return (
        ProgressMirror(store.r, store.keys.workers_reported(), store.keys.worker_progress, clock),
        clock,
    )


def report(store: Store, wid: str, step: int) -> None:
    store.write_progress(wid, {"job": "j", "generation": 1, "state": "running", "step": step})


def test_unchanged_reports_are_not_read_again(store, mirrored):
    mirror, _ = mirrored
    wids = [f"w{i}" for i in range(50)]
    for i, w in enumerate(wids):
        report(store, w, i)
    assert mirror.read(wids)["w7"]["step"] == "7"
    assert mirror.reads == 50
    assert mirror.read(wids)["w7"]["step"] == "7"
    assert mirror.reads == 50  # nothing was rewritten: nothing read


def test_a_rewritten_report_is_read_again_and_only_it(store, mirrored):
    mirror, _ = mirrored
    wids = [f"w{i}" for i in range(50)]
    for w in wids:
        report(store, w, 1)
    mirror.read(wids)
    report(store, "w3", 2)
    assert mirror.read(wids)["w3"]["step"] == "2"
    assert mirror.reads == 51


def test_a_report_rewritten_while_not_asked_for_is_current_when_asked_again(store, mirrored):
    mirror, _ = mirrored
    report(store, "a", 1)
    report(store, "b", 1)
    mirror.read(["a", "b"])
    report(store, "b", 2)
    mirror.read(["a"])  # the index says b changed: what was kept of b is dropped
    assert mirror.read(["b"])["b"]["step"] == "2"


def test_a_worker_without_a_report_reads_as_empty_until_it_reports(store, mirrored):
    mirror, _ = mirrored
    assert mirror.read(["new"]) == {"new": {}}
    report(store, "new", 5)
    assert mirror.read(["new"])["new"]["step"] == "5"


def test_a_write_that_skips_the_index_is_seen_after_the_resync(store, mirrored):
    """The index decides what is re-read; the periodic full read bounds what it can miss
    (a forged stamp, a lost one)."""
    mirror, clock = mirrored
    report(store, "w", 1)
    mirror.read(["w"])
    store.r.hset(store.keys.worker_progress("w"), "step", "9")  # no REPORT, no stamp
    assert mirror.read(["w"])["w"]["step"] == "1"
    clock.t += RESYNC_S
    assert mirror.read(["w"])["w"]["step"] == "9"


def test_a_restarted_server_drops_what_was_kept(store, mirrored, redis_server):
    """A restart or a failover may lose stamps the old server took (here: one never made)."""
    mirror, _ = mirrored
    report(store, "w", 1)
    mirror.read(["w"])
    store.r.hset(store.keys.worker_progress("w"), "step", "9")  # unstamped
    redis_server.kill()
    redis_server.start()  # the AOF keeps the hash; the run_id is new
    assert mirror.read(["w"])["w"]["step"] == "9"


def test_the_controller_store_reads_progress_through_the_mirror(redis_server):
    writer = Store(redis_server.url, prefix="t:")
    reader = Store(redis_server.url, prefix="t:", mirror_progress=True)
    report(writer, "w", 1)
    assert reader.progress(["w"])["w"]["step"] == "1"
    writer.r.hset(writer.keys.worker_progress("w"), "step", "9")  # unstamped
    assert reader.progress(["w"])["w"]["step"] == "1"  # kept: the raw store would say 9
    assert writer.progress(["w"])["w"]["step"] == "9"
    writer.close()
    reader.close()


def join(store: Store, wid: str, devices: int) -> None:
    store.register_worker(wid, {"devices": devices, "state": "idle", "joined_at": store.now()})


def test_registrations_are_read_once_per_join(store):
    join(store, "w", 2)
    assert store.registrations(["w"])["w"]["devices"] == "2"
    store.r.hset(store.keys.worker("w"), "devices", "8")  # not a join: not read again
    assert store.registrations(["w"])["w"]["devices"] == "2"
    join(store, "w", 4)  # a join again: a new joined_at
    assert store.registrations(["w"])["w"]["devices"] == "4"


def test_a_registration_no_join_indexed_is_not_one(store):
    store.r.hset(store.keys.worker("forged"), mapping=flat({"devices": 8, "joined_at": 1.0}))
    join(store, "w", 1)
    assert set(store.registrations(["forged", "w"])) == {"w"}


def write_assignment(store: Store, generation: int, wid: str) -> None:
    asg = Assignment(
        "j",
        generation,
        MeshShape(1, 1, 1),
        "127.0.0.1",
        20000,
        [RankEntry(0, wid, 0, Coord(0, 0, 0))],
    )
    k = store.keys.job_assignment("j")
    store.r.delete(k)
    store.r.hset(k, mapping=flat(asg.to_fields()))


def test_an_assignment_is_parsed_once_per_generation(store):
    write_assignment(store, 1, "a")
    assert assignment.current(store, "j", 1).ranks[0].wid == "a"
    store.r.delete(store.keys.job_assignment("j"))
    assert assignment.current(store, "j", 1).ranks[0].wid == "a"  # kept: never rewritten


def test_an_assignment_of_another_generation_is_none_until_written(store):
    assert assignment.current(store, "j", 2) is None
    write_assignment(store, 1, "a")
    assert assignment.current(store, "j", 2) is None
    write_assignment(store, 2, "b")
    assert assignment.current(store, "j", 2).ranks[0].wid == "b"
