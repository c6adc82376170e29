"""The checkpoint pointer in a real Redis: moved only by the generation CAS, with the history a
restore falls back to, and the one list of directories anyone may delete."""

from __future__ import annotations


def assign(store, wid: str, job: str, generation: int) -> None:
    """The job's generation (its record and its assignment) and the worker's pointer, as the
    controller writes them."""
    store.r.hset(store.keys.job(job), "generation", generation)
    store.r.hset(store.keys.job_assignment(job), "generation", generation)
    store.r.hset(store.keys.worker_assignment(wid), mapping={"job": job, "role": "rank"})


def test_pointer_moves_only_in_the_current_generation_and_forward(store):
    assign(store, "w1", "j", 2)
    assert (
        store.commit_checkpoint("j", 1, 10, "/ck/g1/step-10", wid="w1") is None
    )  # a superseded world
    assert store.commit_checkpoint("j", 2, 10, "/ck/g2/step-10", wid="w1") == []
    assert (
        store.commit_checkpoint("j", 2, 10, "/ck/g2/step-10-again", wid="w1") is None
    )  # not forward
    assert store.commit_checkpoint("j", 2, 5, "/ck/g2/step-5", wid="w1") is None
    assert store.commit_checkpoint("j", 2, 20, "/ck/g2/step-20", wid="w1") == []
    assign(store, "w1", "j", 3)  # a restart restored an older step
    assert store.commit_checkpoint("j", 3, 15, "/ck/g3/step-15", wid="w1") == []
    ck = store.checkpoint("j")
    assert (ck["step"], ck["path"], ck["generation"]) == ("15", "/ck/g3/step-15", "3")
    assert [h["path"] for h in store.checkpoint_history("j")] == [
        "/ck/g3/step-15",
        "/ck/g2/step-20",
        "/ck/g2/step-10",
    ]


def test_only_entries_past_keep_are_returned_for_deletion(store):
    assign(store, "w1", "j", 1)
    dropped = [
        store.commit_checkpoint("j", 1, s, f"/ck/g1/step-{s}", keep=2, wid="w1")
        for s in (5, 10, 15, 20)
    ]
    assert dropped == [
        [],
        [],
        [{"step": 5, "generation": 1, "path": "/ck/g1/step-5"}],
        [{"step": 10, "generation": 1, "path": "/ck/g1/step-10"}],
    ]
    assert [h["step"] for h in store.checkpoint_history("j")] == [20, 15]
    # a refused commit deletes nothing and leaves the history as it was
    assert store.commit_checkpoint("j", 0, 25, "/ck/g0/step-25", keep=1, wid="w1") is None
    assert [h["step"] for h in store.checkpoint_history("j")] == [20, 15]


def test_only_a_worker_assigned_to_that_job_moves_its_pointer(store):
    assign(store, "w1", "j", 2)
    assign(store, "w2", "other", 2)
    assert (
        store.commit_checkpoint("j", 2, 10, "/ck/g2/step-10", wid="w2") is None
    )  # another job's worker, in a generation of the same number
    assert (
        store.commit_checkpoint("j", 2, 10, "/ck/g2/step-10", wid="w3") is None
    )  # no pointer at all (a worker the job released)
    assert store.checkpoint("j") == {}
    assert store.commit_checkpoint("j", 2, 10, "/ck/g2/step-10", wid="w1") == []


def test_heartbeat_answers_with_the_pointers_job_and_its_current_generation(store):
    assert (b := store.heartbeat("w1", "", 0)).job == "" and b.generation == 0
    assign(store, "w1", "j", 4)
    b = store.heartbeat("w1", "j", 3)
    assert (b.job, b.generation) == ("j", 4)  # the agent serving 3 learns it is superseded
    # a generation that keeps the worker in its role rewrites the job's assignment only
    store.r.hset(store.keys.job_assignment("j"), "generation", 5)
    assert store.worker_assignment("w1") == {"job": "j", "role": "rank", "generation": "5"}
    assert (store.heartbeat("w1", "j", 4).job, store.heartbeat("w1", "j", 4).generation) == (
        "j",
        5,
    )
