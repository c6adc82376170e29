"""What one agent's own Redis user can do to the pool through the one hash it may write that
the controller parses: its registration (docs/security.md, "What an authenticated agent can
still do"). A malformed field makes that worker unusable and is counted; the reconcile pass,
the other workers, the REST API and readiness carry on.

A real redis-server, controller and agent processes, over real HTTP, with the poisoning
agent's own credentials (the password it got at join)."""

from __future__ import annotations

import re

import httpx
import redis

from services.redis_url import with_credentials
from services.store import Store, agent_user
from tests.security.test_agents_redis import agent
from tests.stack import tiny_spec, wait_until


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
