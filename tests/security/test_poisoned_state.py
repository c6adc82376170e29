"""What one agent's own Redis user can do to the pool through the one hash it may write that
the controller parses: its registration (docs/security.md, "What an authenticated agent can
still do"). A malformed field makes that worker unusable and is counted; the reconcile pass,
the other workers, the REST API and readiness carry on.

And what state no agent can write but a bug or a hand edit might leave (docs/security.md,
"Poisoned state"): a job record that does not parse is 404 and leaves the queue; a shared key
that stops every pass turns `/readyz` to 503 within its bound, and back once it is repaired.
(A job whose handling raises: tests/unit/test_stuck_jobs.py.)

A real redis-server, controller and agent processes, over real HTTP, with the poisoning
agent's own credentials (the password it got at join)."""

from __future__ import annotations

import re
import time

import httpx
import redis

from controller.service import PASS_OVERDUE_S
from services.redis_url import with_credentials
from services.store import Store, agent_user
from tests.security.test_agents_redis import agent
from tests.stack import tiny_spec, wait_phase, wait_until


def state_errors(api, kind: str) -> float:
    text = httpx.get(
        api.url + "/metrics",
        headers={"Authorization": f"Bearer {api.secrets.scrape_token}"},
        timeout=5,
    ).text
    m = re.search(rf'^meshkeeper_state_errors_total\{{kind="{kind}"\}} (\S+)$', text, re.M)
    assert m, text[:2000]
    return float(m.group(1))


def test_a_malformed_registration_takes_out_its_worker_and_nothing_else(api, tmp_path):
    client = api.controller.client()
    procs = [agent(api, w, tmp_path) for w in ("p1", "p2")]
    admin = Store(api.redis.url)
    try:
        for w in ("p1", "p2"):
            wait_until(lambda w=w: any(x.id == w and x.alive for x in client.workers()), 60, w)
        password = (tmp_path / "workers" / "p1" / "credential").read_text().strip()
        as_p1 = redis.Redis.from_url(
            with_credentials(api.redis.anonymous_url, agent_user("p1"), password),
            decode_responses=True,
        )
        before = state_errors(api, "registration")
        as_p1.hset(admin.keys.worker("p1"), mapping={"devices": "abc", "labels": '"x"'})
        jid = client.submit(tiny_spec("after-poison", parallel={"dp": 1})).id
        j = wait_until(
            lambda: (j := client.job(jid)).mesh and j.mesh.ranks and j, 60, "the job to be placed"
        )
        assert [r.worker for r in j.mesh.ranks] == ["p2"], j.mesh.ranks
        listed = {w.id: w for w in client.workers()}  # 200, the poisoned worker included
        assert listed["p1"].devices == 1 and listed["p1"].labels == {}, listed["p1"]
        assert httpx.get(api.url + "/readyz", timeout=5).status_code == 200
        assert state_errors(api, "registration") == before + 1  # once, not once a pass
        client.cancel(jid)
    finally:
        client.close()
        admin.close()
        for p in procs:
            p.stop(10)


def ready(api) -> int:
    return httpx.get(api.url + "/readyz", timeout=5).status_code


def test_a_job_record_that_does_not_parse_is_not_found_and_leaves_the_queue(api):
    """An admin's hand edit (no agent may write a job record: test_agents_redis.py) makes
    the job's degrees unreadable: its GET is 404, never a 500, the pass drops it from the
    queue, and the API and readiness carry on."""
    client, admin = api.controller.client(), Store(api.redis.url)
    try:
        bad = client.submit(tiny_spec("garbled", parallel={"dp": 1})).id
        admin.r.hset(admin.keys.job(bad), "current", '{"dp": "x"}')
        r = httpx.get(
            f"{api.url}/v1/jobs/{bad}",
            headers={"Authorization": f"Bearer {api.secrets.admin_token}"},
            timeout=5,
        )
        assert r.status_code == 404, r.text
        wait_until(lambda: bad not in admin.job_ids(open_only=True), 30, "dropped from the queue")
        assert bad not in [j.id for j in client.jobs()]
        assert ready(api) == 200
    finally:
        client.close()
        admin.close()


def test_a_shared_key_that_stops_every_pass_turns_readyz_and_back(api):
    """`workers:seen` of the wrong type (no agent may SET it: test_agents_redis.py): no job
    can be placed, so no pass completes, and no job is blamed. `/readyz` is 503 past
    PASS_OVERDUE_S, naming the controller's log, and 200 once the key is repaired."""
    client, admin = api.controller.client(), Store(api.redis.url)
    seen = admin.keys.workers_seen()
    kept = admin.r.zrange(seen, 0, -1, withscores=True)
    jid = client.submit(tiny_spec("waits-for-a-pool", parallel={"dp": 1})).id
    try:
        admin.r.delete(seen)
        admin.r.set(seen, "x")
        broken_at = time.monotonic()
        answer = wait_until(
            lambda: (r := httpx.get(api.url + "/readyz", timeout=5)).status_code == 503 and r,
            PASS_OVERDUE_S + 30,
            "readyz to turn 503",
        )
        assert time.monotonic() - broken_at >= PASS_OVERDUE_S - 1
        assert "no reconcile pass has completed" in answer.text, answer.text
        assert client.job(jid).phase == "Pending"  # the pool's fault, not the job's
    finally:
        admin.r.delete(seen)
        if kept:
            admin.r.zadd(seen, dict(kept))
    try:
        wait_until(lambda: ready(api) == 200, 30, "readyz back to 200")
        client.cancel(jid)
        wait_phase(client, jid, ("Cancelled",), 30)  # never Failed for the pool's fault
    finally:
        client.close()
        admin.close()
