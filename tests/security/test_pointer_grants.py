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
from tests.stack import tiny_spec, wait_phase, wait_until

STEPS = 40


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
