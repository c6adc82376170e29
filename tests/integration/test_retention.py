"""Bounded state (controller/retention.py; docs/architecture.md, "Redis keys"; issue 15): a
finished job is archived to a JSON line and every key of it deleted once its retention has
passed; a worker silent past its retention is forgotten, its Redis ACL user and its metric
series included. A real redis-server, controller and agent, with retentions of seconds."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from services.client import ApiError
from services.store import Store, agent_user
from tests.observability.exposition import samples
from tests.security.smallpool import SmallPool
from tests.stack import tiny_spec, wait_phase, wait_until

JOB_RETENTION_S, WORKER_RETENTION_S = 8, 3  # the job: long enough to see it end first


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    work = tmp_path_factory.mktemp("retention")
    flags = [
        "--job-retention",
        str(JOB_RETENTION_S),
        "--worker-retention",
        str(WORKER_RETENTION_S),
        "--archive-dir",
        str(work / "archive"),
    ]
    p = SmallPool(work, agents=1, controller_flags=flags)
    p.store = Store(p.redis.url)  # as admin: to see every key
    yield p
    p.store.close()
    p.close()


def heartbeat_ages(pool, wid: str) -> list:
    """The controller's heartbeat-age series of `wid`, scraped as Prometheus does."""
    text = httpx.get(
        f"{pool.controller.url}/metrics",
        headers={"Authorization": f"Bearer {pool.secrets.scrape_token}"},
        timeout=5,
    ).text
    return samples(text, "meshkeeper_worker_heartbeat_age_seconds", worker=wid)


def job_keys(pool, jid: str) -> list[str]:
    return sorted(pool.store.r.scan_iter(match=f"mk:job:{{{jid}}}*"))


def test_a_finished_job_is_archived_then_deleted(pool):
    jid = pool.client.submit(tiny_spec("kept-briefly", parallel={"dp": 1})).id
    pool.client.cancel(jid)
    wait_phase(pool.client, jid, ("Cancelled",), 60)
    assert job_keys(pool, jid), "the job's keys exist while it is retained"

    def deleted() -> bool:
        try:
            pool.client.job(jid)
        except ApiError as e:
            return e.status == 404
        return False

    wait_until(deleted, 30, f"job {jid} deleted after {JOB_RETENTION_S}s of retention")
    assert job_keys(pool, jid) == []
    for index in ("mk:jobs", "mk:jobs:open", "mk:jobs:finished"):
        assert pool.store.r.zscore(index, jid) is None, index
    lines = [json.loads(x) for x in (pool.work / "archive" / "jobs.jsonl").read_text().splitlines()]
    (archived,) = [x for x in lines if x["id"] == jid]
    assert archived["job"]["phase"] == "Cancelled"
    assert json.loads(archived["job"]["spec"])["name"] == "kept-briefly"
    assert "Cancelled" in [e["reason"] for e in archived["events"]]


def test_a_silent_worker_is_forgotten_with_its_acl_user(pool):
    (agent,) = pool.agents
    wid = "p0"
    user = agent_user(wid)
    assert pool.store.r.execute_command("ACL", "GETUSER", user) is not None
    assert heartbeat_ages(pool, wid), "the live worker has its series"
    os.killpg(agent.p.pid, signal.SIGKILL)  # gone for good, as a deleted pod

    wait_until(
        lambda: wid not in [w.id for w in pool.client.workers()],
        30,
        f"worker {wid} forgotten after {WORKER_RETENTION_S}s of silence",
    )
    assert sorted(pool.store.r.scan_iter(match=f"mk:worker:{wid}*")) == []
    assert pool.store.r.zscore("mk:workers:seen", wid) is None
    assert pool.store.r.execute_command("ACL", "GETUSER", user) is None
    assert heartbeat_ages(pool, wid) == []
