"""The room for in-memory snapshots, end to end: an agent whose --snapshot-dir is a small tmpfs
registers that tmpfs's size when it joins, and POST /v1/jobs refuses a job whose snapshot rings
no live worker has room for (controller/admission.py), naming the field and the fixes."""

from __future__ import annotations

from tests.integration.conftest import joining_agent, wait_until
from tests.tmpfs import small_tmpfs

MiB = 2**20
# ~800M parameters at dp 2 (zero 3): a rank fits a test host's memory (about 9 GiB), while
# its 16-slot rings and a buddy's copies need about 200 GiB per worker
BIG_RINGS = {
    "name": "big-rings",
    "model": {"layers": 4, "d_model": 4096, "heads": 32, "vocab": 1024, "seq_len": 128},
    "data": {"source": "synthetic"},
    "parallel": {"dp": 2, "zero": 3},
    "train": {"steps": 5, "global_batch": 8},
    "snapshot": {"keep": 16},
}


def test_an_agent_registers_its_snapshot_room_and_a_job_too_big_for_every_room_is_refused(
    stack, tmp_path
):
    with small_tmpfs(tmp_path / "shm", "32m") as shm:
        # the snapshot directory is made at the first snapshot: its file system counts
        agent = joining_agent(
            stack,
            "room-1",
            tmp_path,
            *("--run-dir", str(tmp_path / "run"), "--snapshot-dir", str(shm / "meshkeeper")),
        )
        try:
            wait_until(
                lambda: any(w.id == "room-1" and w.alive for w in stack.client.workers()),
                30,
                "the agent to join",
            )
            live = [w.id for w in stack.client.workers() if w.alive]
            rooms = {
                w: int(r.get("snapshot_bytes", 0))
                for w, r in stack.store.registrations(live).items()
            }
            assert rooms["room-1"] == 32 * MiB

            r = stack.client.http.post("/v1/jobs", json=BIG_RINGS)
            assert r.status_code == 422, r.text
            (problem,) = r.json()["problems"]
            assert problem["field"] == "snapshot", problem
            roomiest = max(rooms.values())
            assert f"{roomiest / 2**30:,.1f} GiB" in problem["message"], (rooms, problem)
            assert "snapshot.enabled: false" in problem["message"]
        finally:
            agent.stop(10)
