"""Checkpoint pointers and agent users (docs/security.md, "Agents and Redis"): an agent's Redis
user may write the checkpoint pointer of the job it is assigned to, and no other. The commit
CAS runs as its caller, so the grant is the only thing that keeps a direct HSET off another
job's pointer; the controller moves it with each assignment and takes it back at release.

The attacker holds what a compromised idle agent holds: its own Redis user, with the
credential the agent keeps in its run directory. A real stack (SmallPool): redis-server with
an aclfile, a controller, three agents that joined with the join token, a real dp2 job.
"""

from __future__ import annotations

import pytest
import redis

from services.store import Store, agent_user
from tests.security.smallpool import SmallPool
from tests.stack import Controller, tiny_spec, wait_phase, wait_until

STEPS = 40
MAX_ID = "18446744073709551615-18446744073709551615"  # the last id a stream can hold


def as_agent(pool: SmallPool, wid: str) -> Store:
    """A store logged in as worker `wid`'s agent user, with the credential it keeps."""
    credential = (pool.work / "workers" / wid / "credential").read_text().strip()
    url = pool.redis.anonymous_url.replace("://", f"://{agent_user(wid)}:{credential}@", 1)
    return Store(url)


def pointer_grants(admin: Store, wid: str) -> list[str]:
    """The checkpoint pointers worker `wid`'s agent user may write (its ACL selectors)."""
    user = admin.r.acl_getuser(agent_user(wid))
    selectors = [dict(zip(s[::2], s[1::2], strict=True)) for s in user["selectors"]]
    return [s["keys"] for s in selectors if ":checkpoint" in s["keys"]]


@pytest.fixture
def pool(tmp_path):
    p = SmallPool(tmp_path, 3)
    yield p
    p.close()


def test_an_agent_holding_no_job_cannot_move_a_running_jobs_pointer(pool):
    admin = Store(pool.redis.url)
    spec = tiny_spec("grants", train={"steps": STEPS}, checkpoint={"every_steps": 4})
    job = pool.client_as(pool.secrets.submitter_token).submit(spec).id
    running = wait_phase(pool.client, job, ("Running",), 120)
    workers = {r.worker for r in running.mesh.ranks}
    (idle,) = {"p0", "p1", "p2"} - workers
    assert all(pointer_grants(admin, w) == [f"~{admin.keys.job_checkpoint(job)}"] for w in workers)
    assert pointer_grants(admin, idle) == []

    attacker = as_agent(pool, idle)
    try:
        assert attacker.job(job)["generation"] == "1"  # it logged in, and may read
        with pytest.raises(redis.exceptions.NoPermissionError):
            attacker.r.hset(admin.keys.job_checkpoint(job), "generation", 999999)
        with pytest.raises(redis.exceptions.NoPermissionError):  # nor through the commit CAS
            attacker.commit_checkpoint(job, 1, 10**6, "/forged", wid=idle)
        for stream in (admin.keys.job_events(job), admin.keys.job_logs(job)):
            with pytest.raises(redis.exceptions.NoPermissionError):  # nor its news
                attacker.r.xadd(stream, {"reason": "Forged"}, id=MAX_ID)
    finally:
        attacker.close()

    done = wait_phase(pool.client, job, ("Succeeded",), 300)
    assert done.last_checkpoint.step == STEPS and done.last_checkpoint.generation == 1
    assert "/forged" not in str(admin.checkpoint_history(job))
    # released with the job: no worker keeps a grant (the pass after the job ended takes it)
    wait_until(
        lambda: all(pointer_grants(admin, w) == [] for w in workers), 30, "grants taken back"
    )
    admin.close()


def test_a_forged_last_event_id_costs_events_not_the_jobs_state(pool):
    """An agent of the job itself may append to its streams; ending one at the last possible
    id makes every later XADD fail. The controller's transaction writes the job's state all
    the same (the cancel lands, the job leaves the open set, its workers are free), and the
    released agents keep only that job's streams until their next job."""
    admin = Store(pool.redis.url)
    spec = tiny_spec("forged-ids", train={"steps": 10**5}, parallel={"dp": 2})
    submitter = pool.client_as(pool.secrets.submitter_token)
    job = submitter.submit(spec).id
    running = wait_phase(pool.client, job, ("Running",), 120)
    inside = running.mesh.ranks[0].worker
    attacker = as_agent(pool, inside)
    try:
        attacker.r.xadd(admin.keys.job_events(job), {"reason": "Forged"}, id=MAX_ID)
    finally:
        attacker.close()
    submitter.cancel(job)
    done = wait_phase(pool.client, job, ("Cancelled",), 60)
    assert done.phase == "Cancelled" and job not in admin.job_ids(open_only=True)
    busy = {r.worker for r in running.mesh.ranks}
    wait_until(
        lambda: all(w.state == "idle" and not w.job for w in pool.client.workers() if w.id in busy),
        30,
        "the job's workers idle again",
    )
    user = admin.r.acl_getuser(agent_user(inside))
    keys = " ".join(dict(zip(x[::2], x[1::2], strict=True))["keys"] for x in user["selectors"])
    assert admin.keys.job_events(job) in keys and ":checkpoint" not in keys, keys
    submitter.close()
    admin.close()


def test_a_grant_a_dead_controller_left_is_taken_back_by_the_next_leader(pool):
    """A controller that dies between a release and the grant's removal leaves an idle agent
    with a job's pointer. The next leader compares every agent user with its pointer when it
    takes the lease, and takes the grant back: the agent's own HSET is refused again."""
    admin = Store(pool.redis.url)
    victim = "victim-job"
    admin.grant_jobs({"p0": victim})  # what the dead controller's release left behind
    assert pointer_grants(admin, "p0") == [f"~{admin.keys.job_checkpoint(victim)}"]
    pool.controller.proc.p.kill()
    pool.controller.proc.p.wait(10)
    pool.controller = Controller(pool.redis, pool.work / "logs", "controller-2", pool.secrets)
    wait_until(lambda: pointer_grants(admin, "p0") == [], 60, "the stale grant taken back")
    attacker = as_agent(pool, "p0")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attacker.r.hset(admin.keys.job_checkpoint(victim), "generation", 999999)
        attacker.r.xadd(admin.keys.job_events(victim), {"reason": "Left"})  # its last job's news
    finally:
        attacker.close()
    assert "corrected the checkpoint grants of ['p0']" in pool.controller.proc.tail()
    admin.close()
