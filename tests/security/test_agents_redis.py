"""Agents and Redis (docs/security.md): Redis refuses unauthenticated clients; agents become
workers only by joining with the join token; each agent's Redis user writes only its own keys;
a worker forged straight into Redis never gets a rank.

A real redis-server with an aclfile, a real controller process and real agent processes (no
warm trainers: nothing here trains), over real HTTP.
"""

from __future__ import annotations

import sys
import time
from urllib.parse import unquote, urlsplit

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services import discovery
from services.store import Store, agent_user
from tests.stack import ApiStack, Proc, agent_argv, tiny_spec, wait_until

BODY = {
    "host": "h1",
    "address": "127.0.0.1",
    "devices": 1,
    "memory_bytes": 1 << 30,
    "device_kind": "cpu",
    "pid": 4242,
}


@pytest.fixture
def admin(api):
    s = Store(api.redis.url)
    yield s
    s.close()


def raw(url: str) -> redis.Redis:
    """A client that fails at once (no reconnect retries): refusals are what is tested."""
    return redis.Redis.from_url(
        url, decode_responses=True, socket_timeout=3, retry=Retry(NoBackoff(), 0)
    )


def join(
    api: ApiStack, wid: str, token: str | None, credential: str | None = None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"id": wid, **BODY, **({"credential": credential} if credential else {})}
    return httpx.post(api.url + "/v1/agents/join", json=body, headers=headers, timeout=10)


def agent(api: ApiStack, wid: str, work) -> Proc:
    return Proc(
        f"agent-{wid}", [*agent_argv(api.url, api.secrets, wid, work), "--warm", "0"], work / "logs"
    )


def test_redis_refuses_an_unauthenticated_connection(api):
    for url in (
        api.redis.anonymous_url,  # the default user is off
        api.redis.anonymous_url.replace("redis://", "redis://admin:wrong@"),
        api.redis.anonymous_url.replace(
            "redis://", f"redis://default:{api.secrets.redis_admin_password}@"
        ),
    ):
        with pytest.raises(redis.AuthenticationError):
            raw(url).set("mk:worker:evil", "x")
    assert raw(api.redis.url).ping()  # the admin user, as a control


@pytest.mark.parametrize("token", [None, "not-the-join-token", "admin"])
def test_a_join_without_the_join_token_is_refused_and_writes_nothing(api, admin, token):
    token = api.secrets.admin_token if token == "admin" else token  # an API token is no join token
    r = join(api, "intruder", token)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "join token" in r.json()["detail"] and "redis" not in r.text.lower()
    assert admin.r.exists(admin.keys.worker("intruder")) == 0
    assert agent_user("intruder") not in admin.r.execute_command("ACL", "USERS")


def test_an_agent_process_without_the_join_token_exits_and_is_not_listed(api, tmp_path):
    bad = tmp_path / "join-token"
    bad.write_text("guessed")
    p = Proc(
        "agent-guess",
        [
            sys.executable,
            "-m",
            "worker",
            "--controller",
            api.url,
            "--join-token-file",
            str(bad),
            "--id",
            "guess",
            "--warm",
            "0",
            "--metrics-port",
            "0",
            "--run-dir",
            str(tmp_path / "w"),
        ],
        tmp_path,
    )
    assert p.p.wait(30) != 0
    assert "refused the join (401)" in p.tail()
    with api.controller.client() as c:
        assert "guess" not in {w.id for w in c.workers()}


def test_a_join_registers_the_worker_and_gives_it_its_own_redis_user(api, admin):
    r = join(api, "wa", api.secrets.join_token)
    assert r.status_code == 200, r.text
    url = r.json()["redis_url"]
    assert url.startswith(f"redis://{agent_user('wa')}:") and r.json()["prefix"] == "mk:"
    reg = admin.workers(["wa"])["wa"]
    assert (
        reg["address"] == "127.0.0.1"
        and reg["device_kind"] == "cpu"
        and float(reg["joined_at"]) > 0
    )
    me = Store(url)
    try:  # everything an agent does (worker/agent.py) is allowed ...
        me.heartbeat("wa")  # its own keys, through the heartbeat script
        me.set_worker("wa", {"state": "idle"})
        me.write_progress("wa", {"state": "idle"})
        assert me.worker_assignment("wa") == {}
        admin.r.hset(admin.keys.job("j"), "generation", 1)  # as the controller assigns it
        admin.r.hset(admin.keys.job_assignment("j"), "generation", 1)
        admin.r.hset(admin.keys.worker_assignment("wa"), mapping={"job": "j", "role": "rank"})
        admin.grant_jobs({"wa": "j"})  # and grants j's pointer with it
        beat = me.heartbeat("wa", "j", 1)
        assert (beat.job, beat.generation) == ("j", 1)
        listener = me.r.pubsub()
        listener.subscribe(admin.keys.job_assignment("j"))  # where its job's generations are told
        assert listener.get_message(timeout=2)["type"] == "subscribe"  # NOPERM would raise
        listener.close()
        assert me.commit_checkpoint("j", 1, 10, "/ck/g1/step-10", wid="wa") == []
        assert me.checkpoint_history("j")[0]["step"] == 10
        me.add_event("j", {"reason": "TrainerStarted"})
        discovery.advertise(me, "wa", "127.0.0.1:9400")
        me.announce_exit("wa")  # the controller's wake-up channel
        assert me.job("j")["generation"] == "1"
        # ... and nothing else
        denied = [
            lambda: me.r.hset(admin.keys.worker("wb"), "address", "10.6.6.6"),  # another worker
            lambda: me.r.hset(
                admin.keys.worker("wa-forged"), "joined_at", "1"
            ),  # a name sharing its prefix
            lambda: me.r.hset(
                admin.keys.worker_assignment("wa"), "job", "j"
            ),  # its pointer is the controller's
            lambda: me.r.hset(admin.keys.job("j"), "generation", "9"),
            lambda: me.r.set("mk:controller:lease", "me:1"),
            lambda: me.r.execute_command("ACL", "SETUSER", "agent-wa", "~*"),
            lambda: me.r.flushall(),
            lambda: me.r.publish(admin.keys.worker_assignment("wb"), "j"),  # another's channel
            # a job's assignment channel: it may listen, never wake every agent of a job
            lambda: me.r.publish(admin.keys.job_assignment("j"), "2"),
            lambda: me.heartbeat("wb"),  # the script writes worker:wb: refused inside it
            lambda: me.commit_checkpoint(
                "j", 1, 10, "/ck", wid="wb"
            ),  # reads another worker's pointer
            lambda: me.r.hset(
                admin.keys.job_checkpoint("k"), "generation", "999999"
            ),  # not its job
            # shared keys whose wrong type would stop every reconcile pass: only ZADD/XADD
            lambda: me.r.set(admin.keys.workers_seen(), "x"),
            lambda: me.r.delete(admin.keys.workers_seen()),
            lambda: me.r.set(admin.keys.workers_reported(), "x"),
            lambda: me.r.set(admin.keys.job_events("j"), "x"),
            lambda: me.r.delete(admin.keys.job_events("j")),
            lambda: me.r.eval("return redis.call('SET', KEYS[1], 'x')", 1, "mk:workers:seen"),
        ]
        for i, attempt in enumerate(denied):
            with pytest.raises(redis.ResponseError, match="(?i)permission|can't access|NOPERM"):
                attempt()
                pytest.fail(f"attempt {i} was allowed")
    finally:
        me.close()
    # wa beats: a re-join needs its credential (its current password), and rotates it: the
    # old URL no longer authenticates
    assert join(api, "wa", api.secrets.join_token).status_code == 409
    password = unquote(urlsplit(url).password)
    assert join(api, "wa", api.secrets.join_token, password).status_code == 200
    with pytest.raises(redis.AuthenticationError):
        raw(url).ping()


def test_bootstrap_never_hands_out_credentials(api):
    r = httpx.get(api.url + "/v1/agent/bootstrap", timeout=10)
    assert r.status_code == 401 and "redis" not in r.text.lower()
    r = httpx.get(
        api.url + "/v1/agent/bootstrap",
        headers={"Authorization": f"Bearer {api.secrets.admin_token}"},
        timeout=10,
    )
    assert r.json()["redis_url"] == api.redis.anonymous_url  # where Redis is; no user, no password


def test_a_forged_worker_is_never_given_a_rank(api, admin, tmp_path):
    """A real agent w1 joins; a dp=2 job needs a second worker. A forger holding the Redis
    credentials of another joined worker (wz), and one with none, try to add a worker
    'forged' (whose address would become the job's rendezvous if it got rank 0): their writes
    are refused, and what an agent user may do, beat for any name in `workers:seen`, plus a
    registration that no join wrote (as agents used to write them straight into Redis), gives
    'forged' no rank. The job waits until a second real agent joins and then runs on w1, w2."""
    client = api.controller.client()
    procs: list[Proc] = []
    try:
        # submitted while no worker is alive: admission then has no pool to judge the job by
        wait_until(lambda: not any(w.alive for w in client.workers()), 30, "no live worker")
        jid = client.submit(tiny_spec("forged-target")).id  # dp 2: two ranks
        procs.append(agent(api, "w1", tmp_path))
        wait_until(
            lambda: any(w.id == "w1" and w.alive for w in client.workers()), 60, "w1 to join"
        )
        r = join(api, "wz", api.secrets.join_token)
        as_wz = raw(r.json()["redis_url"])
        forged = {
            "host": "h9",
            "address": "10.6.6.6",
            "devices": 1,
            "state": "idle",
            "joined_at": "1",
        }
        with pytest.raises(redis.ResponseError, match="NOPERM|permission"):
            as_wz.hset(admin.keys.worker("forged"), mapping=forged)
        with pytest.raises(redis.AuthenticationError):
            raw(api.redis.anonymous_url).hset(admin.keys.worker("forged"), mapping=forged)
        del forged["joined_at"]
        admin.r.hset(admin.keys.worker("forged"), mapping=forged)  # a registration no join wrote
        # a dozen scheduler passes (0.25 s each) while 'forged' beats: a pool that took it
        # would place the job in the first
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            as_wz.zadd(admin.keys.workers_seen(), {"forged": admin.now()})
            assert client.job(jid).phase == "Pending", client.job(jid).mesh
            time.sleep(0.25)
        assert admin.r.hgetall(admin.keys.worker_assignment("forged")) == {}
        procs.append(agent(api, "w2", tmp_path))
        j = wait_until(
            lambda: (j := client.job(jid)).mesh and j.mesh.ranks and j, 90, "the job to be placed"
        )
        assert {r.worker for r in j.mesh.ranks} == {"w1", "w2"}, j.mesh.ranks
        client.cancel(jid)
    finally:
        client.close()
        for p in procs:
            p.stop(10)


def test_the_join_token_cannot_take_over_a_live_worker(api, admin, tmp_path):
    """A real agent w5 joins and beats. An attacker holding the join token joins as w5, with
    no credential and with a wrong one: 409, and w5's registration and Redis password stay
    its own, so it goes on beating. The agent itself, SIGKILLed and restarted with the same
    id and run dir, rejoins at once with the credential it kept; stopped cleanly, it frees
    the id for anyone with the join token."""
    client = api.controller.client()
    p = agent(api, "w5", tmp_path)
    try:
        wait_until(lambda: any(w.id == "w5" and w.alive for w in client.workers()), 60, "w5")
        before = admin.workers(["w5"])["w5"]
        passwords = admin.r.acl_getuser(agent_user("w5"))["passwords"]
        for credential in (None, "guessed"):
            r = join(api, "w5", api.secrets.join_token, credential)
            assert r.status_code == 409, r.text
            assert "held by a live agent" in r.json()["detail"], r.text
        assert admin.workers(["w5"])["w5"]["joined_at"] == before["joined_at"]
        assert admin.r.acl_getuser(agent_user("w5"))["passwords"] == passwords
        beat = admin.last_seen(["w5"])["w5"]
        wait_until(lambda: admin.last_seen(["w5"])["w5"] > beat, 10, "w5 to beat again")
        p.kill()
        p = agent(api, "w5", tmp_path)  # the same id and run dir, while w5 still looks alive
        wait_until(
            lambda: admin.workers(["w5"])["w5"]["joined_at"] != before["joined_at"],
            30,  # far below the 120 s an id stays held after its agent's last beat
            "the restarted agent to rejoin",
        )
        assert admin.r.acl_getuser(agent_user("w5"))["passwords"] != passwords  # rotated
        p.stop(10)  # a clean stop deregisters: the id is free
        assert join(api, "w5", api.secrets.join_token).status_code == 200
    finally:
        client.close()
        p.stop(10)


def test_a_joined_attacker_cannot_free_a_live_id_by_erasing_its_beat(api, admin, tmp_path):
    """The attacker joins under a fresh id with the join token, and with that agent's own
    Redis user removes the live w7 from `workers:seen` (any agent may ZREM there). The join
    as w7 is still 409: a live id is judged by the beat in w7's own hash, which no other
    agent can write."""
    client = api.controller.client()
    p = agent(api, "w7", tmp_path)
    try:
        wait_until(lambda: any(w.id == "w7" and w.alive for w in client.workers()), 60, "w7")
        r = join(api, "x7", api.secrets.join_token)
        assert r.status_code == 200, r.text
        attacker = Store(r.json()["redis_url"])
        try:
            assert attacker.r.zrem(admin.keys.workers_seen(), "w7") == 1
            with pytest.raises(redis.exceptions.NoPermissionError):
                attacker.r.hset(admin.keys.worker("w7"), "beat", 0)
        finally:
            attacker.close()
        r = join(api, "w7", api.secrets.join_token)
        assert r.status_code == 409 and "held by a live agent" in r.json()["detail"], r.text
    finally:
        client.close()
        p.stop(10)


def test_an_agent_whose_password_redis_refuses_joins_again(api, admin, tmp_path):
    """Redis loses the agent's user (deleted, its connections cut, as after a restart without
    the users file): the agent's calls get WRONGPASS, and rather than retrying that password
    forever it joins again with the join token and beats under a fresh password."""
    client = api.controller.client()
    p = agent(api, "w6", tmp_path)
    try:
        wait_until(lambda: any(w.id == "w6" and w.alive for w in client.workers()), 60, "w6")
        joined = admin.workers(["w6"])["w6"]["joined_at"]
        # its connections first: Redis cannot name a deleted user's
        admin.r.execute_command("ACL", "SETUSER", agent_user("w6"), "off")
        admin.r.execute_command("CLIENT", "KILL", "USER", agent_user("w6"))
        admin.r.execute_command("ACL", "DELUSER", agent_user("w6"))
        wait_until(
            lambda: admin.workers(["w6"])["w6"]["joined_at"] != joined, 30, "w6 to join again"
        )
        beat = admin.now()
        wait_until(lambda: admin.last_seen(["w6"])["w6"] > beat, 10, "w6 to beat as its new user")
        assert "joining again" in p.tail(), p.tail()
    finally:
        client.close()
        p.stop(10)


def test_the_join_log_names_the_callers_address_beside_the_claimed_one(api):
    """A join may claim any address; the log keeps where it really came from."""
    body = {"id": "wlog", **BODY, "address": "10.9.9.9"}
    r = httpx.post(
        api.url + "/v1/agents/join",
        json=body,
        headers={"Authorization": f"Bearer {api.secrets.join_token}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    wait_until(
        lambda: (
            "worker wlog joined from 127.0.0.1 (claims address 10.9.9.9"
            in api.controller.proc.tail()
        ),
        10,
        "the join's log line",
    )
