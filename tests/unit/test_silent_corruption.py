"""The controller's side of silent data corruption (docs/architecture.md, "Silent data
corruption"): the trainers' evidence (`RankReport.sdc`, exit code 4) becomes
`SilentDataCorruption` faults on the ranks re-execution blamed, whose workers are quarantined
and replaced; evidence that blames nobody restarts the world in place, quarantining nobody;
and the controller waits for every rank to exit before it writes the next generation."""

from __future__ import annotations

import pytest

from controller import faults, health
from controller.decisions import Recover
from controller.jobs import Job
from controller.passes import FreePool, JobView, Pass, SchedulerConfig
from controller.placement import FreeWorker
from controller.quarantine import quarantines
from services.api import RankStatus
from services.assignment import Assignment, RankEntry
from services.mesh import Coord, MeshShape
from services.records import Quarantine
from services.spec import parse_spec
from services.store import Store

SPEC = parse_spec(
    {
        "name": "j",
        "model": {"preset": "tiny"},
        "parallel": {"dp": 2, "tp": 2, "zero": 0},
        "train": {"steps": 100, "global_batch": 4},
        "fault_tolerance": {"quarantine_s": 30, "hang_after_s": 60},
    }
)
# rank n of a dp2 x tp2 mesh: dp = n // 2, tp = n % 2, on worker w<n>
EVIDENCE = {
    "step": 40,
    "clean_step": 30,
    "tensor": "layers.1.mlp.up.weight",
    "ranks": [1, 3],
    "suspects": [3],
    "detail": "rank 3's re-executed step 31 differs from its first result",
}


def rank(n: int, **report) -> RankStatus:
    return RankStatus(
        rank=n,
        coord={"dp": n // 2, "pp": 0, "tp": n % 2},
        worker=f"w{n}",
        local_rank=0,
        **{"state": "running", **report},
    )


def exited(n: int, at: float, evidence: dict | None = None) -> RankStatus:
    """Rank n after the trainer found the corruption: exit code 4, the evidence reported."""
    return rank(n, state="failed", exit_code=4, exited_at=at, sdc=evidence or EVIDENCE)


def all_exited(evidence: dict | None = None) -> list[RankStatus]:
    return [exited(n, 50.0 + n, evidence) for n in range(4)]


def test_the_suspect_alone_is_faulty_with_the_evidence():
    found = health.silent_corruption(all_exited(), now=100.0)
    assert [(f.cause, f.rank, f.worker, f.coord) for f in found] == [
        ("SilentDataCorruption", 3, "w3", {"dp": 1, "pp": 0, "tp": 1})
    ]
    f = found[0]
    assert f.fault_at == 50.0  # the first report's exit, not the pass's time
    assert f.evidence == EVIDENCE
    for fact in ("layers.1.mlp.up.weight", "ranks [1, 3]", "step 40", "step 30", "rank 3's"):
        assert fact in f.detail, f.detail


def test_a_spot_check_finding_is_told_as_a_re_execution_not_a_fingerprint_disagreement():
    evidence = {
        "check": "spot",
        "step": 40,
        "clean_step": 40,
        "tensor": "input gradient",
        "ranks": [2],
        "suspects": [2],
        "detail": "re-executing one microbatch at step 40 gave a different result on rank(s) [2]",
    }
    found = health.silent_corruption(all_exited(evidence), now=100.0)
    assert [(f.cause, f.rank) for f in found] == [("SilentDataCorruption", 2)]
    detail = found[0].detail
    assert "different input gradient on ranks [2] at the spot check of step 40" in detail, detail
    assert "fingerprints" not in detail, detail


def test_two_suspects_are_two_faults():
    evidence = {**EVIDENCE, "suspects": [1, 3]}
    found = health.silent_corruption(all_exited(evidence), now=100.0)
    assert [(f.cause, f.rank) for f in found] == [
        ("SilentDataCorruption", 1),
        ("SilentDataCorruption", 3),
    ]


def test_without_a_suspect_nobody_is_blamed_and_the_world_restarts_in_place():
    evidence = {**EVIDENCE, "suspects": []}
    found = health.silent_corruption(all_exited(evidence), now=100.0)
    assert [(f.cause, f.rank) for f in found] == [
        ("SilentDataCorruptionUnattributed", 1),
        ("SilentDataCorruptionUnattributed", 3),
    ]
    assert all(f.cause in health.BLAMELESS for f in found)
    assert quarantines(found, 30.0, 100.0) == []
    assert "could not tell" in found[0].detail


def test_evidence_naming_no_rank_of_the_job_still_restarts_in_place():
    """Ranks the job does not have (a garbled report) blame nobody; the reporting rank
    carries the fault so the restart still happens."""
    evidence = {**EVIDENCE, "ranks": [7, "x"], "suspects": [9, True]}
    found = health.silent_corruption(all_exited(evidence), now=100.0)
    assert [(f.cause, f.rank) for f in found] == [("SilentDataCorruptionUnattributed", 0)]


def test_no_report_no_fault_and_exit_code_4_alone_is_not_deterministic():
    ranks = [rank(0), rank(1, state="failed", exit_code=4, exited_at=5.0)]
    assert health.silent_corruption(ranks, now=10.0) == []
    assert health.deterministic_failure(ranks) is None


def test_the_blamed_worker_is_quarantined_for_silent_data_corruption():
    found = health.silent_corruption(all_exited(), now=100.0)
    assert [q for q, _ in quarantines(found, 30.0, 100.0)] == [
        Quarantine(worker="w3", until=130.0, cause="SilentDataCorruption")
    ]


def test_the_controller_waits_while_peers_are_still_exiting():
    ranks = [exited(0, 50.0), rank(1), rank(2), rank(3)]
    assert health.corruption_pending(ranks, bound_s=60.0, now=55.0)
    # not forever: past the bound the evidence in hand is acted on
    assert not health.corruption_pending(ranks, bound_s=60.0, now=111.0)
    # and not once every rank has exited
    assert not health.corruption_pending(all_exited(), bound_s=60.0, now=55.0)
    assert not health.corruption_pending([rank(n) for n in range(4)], bound_s=60.0, now=55.0)


def assignment() -> Assignment:
    entries = [
        RankEntry(n, f"w{n}", 0, Coord(n // 2, 0, n % 2), local_world_size=1) for n in range(4)
    ]
    return Assignment("j", 3, MeshShape(2, 1, 2), "127.0.0.1", 20001, entries)


@pytest.fixture
def ctx(redis_server) -> Pass:
    """A pass on a real (empty) Redis with one idle worker, w9."""
    store = Store(redis_server.url)
    spare = FreeWorker("w9", "?", "127.0.0.1")
    return Pass(store, SchedulerConfig(), "test", "lease", 100.0, FreePool(lambda: [spare]))


def test_decide_replaces_the_suspect_and_quarantines_only_its_worker(ctx):
    job = Job(id="j", name="j", spec=SPEC, generation=3)
    d = faults.decide(ctx, JobView(job, assignment(), all_exited()), seen=None)
    assert isinstance(d, Recover), d
    assert d.record.cause == "SilentDataCorruption" and d.record.action == "replace"
    assert d.layout.moved == {"w3": "w9"}
    assert [q.worker for q, _ in d.blame.quarantined] == ["w3"]
    assert d.record.faults[0].evidence == EVIDENCE
    # the event the recovery writes (RecoveryStarted) carries the evidence's sentence
    assert "layers.1.mlp.up.weight" in d.message and "w3 -> w9" in d.message


def test_decide_without_a_suspect_restarts_the_same_workers(ctx):
    job = Job(id="j", name="j", spec=SPEC, generation=3)
    view = JobView(job, assignment(), all_exited({**EVIDENCE, "suspects": []}))
    d = faults.decide(ctx, view, seen=None)
    assert isinstance(d, Recover), d
    assert (d.record.cause, d.record.action) == ("SilentDataCorruptionUnattributed", "restart")
    assert d.layout.moved == {} and d.blame.quarantined == []


def test_decide_waits_for_the_peers_rather_than_blaming_their_exits(ctx):
    """One rank exited with the evidence, the others still run: without the wait, the exit
    would read as a blameless TrainerFailed and the generation would be replaced before the
    peers dropped their unchecked snapshots."""
    job = Job(id="j", name="j", spec=SPEC, generation=3)
    ranks = [exited(0, 99.0), rank(1), rank(2), rank(3)]
    assert faults.decide(ctx, JobView(job, assignment(), ranks), seen=None) is None
