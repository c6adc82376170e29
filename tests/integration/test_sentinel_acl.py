"""Agent users reach every Redis data node under Sentinel (services/store.py `sync_acl`): ACL
changes are not replicated, and a promoted replica that lacks them locks every agent out.
Real redis-servers and Sentinels (tests/sentinel_redis.py), auth on."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.redis_url import with_credentials
from services.store import Store, agent_user


@pytest.fixture
def store(sentinel):
    s = Store(sentinel.controller_url, provisioner_url=sentinel.provisioner_url)
    try:
        yield s
    finally:
        s.close()


def replica(sentinel) -> redis.Redis:
    return redis.Redis(
        port=sentinel.node_ports[1],
        username="admin",
        password=sentinel.secrets.redis_admin_password,
        decode_responses=True,
    )


def can_log_in(sentinel, port: int, user: str, password: str) -> bool:
    try:  # no retries: a refused password is the answer, not a blip
        with redis.Redis(
            port=port, username=user, password=password, retry=Retry(NoBackoff(), 0)
        ) as r:
            return bool(r.ping())
    except redis.AuthenticationError:
        return False


def test_a_join_puts_the_agent_user_on_the_replica(sentinel, store):
    store.join_worker("w1", {"host": "h1"}, "pw-1")
    assert can_log_in(sentinel, sentinel.node_ports[1], agent_user("w1"), "pw-1")
    with replica(sentinel) as r:  # and in its aclfile: a restarted replica still knows it
        r.execute_command("ACL", "LOAD")
    assert can_log_in(sentinel, sentinel.node_ports[1], agent_user("w1"), "pw-1")


def test_a_replica_that_missed_users_gets_them_at_the_next_copy(sentinel, store):
    store.join_worker("w2", {"host": "h2"}, "pw-2")
    with replica(sentinel) as r:  # as if it was away when w2 joined
        r.execute_command("ACL", "DELUSER", agent_user("w2"))
    assert not can_log_in(sentinel, sentinel.node_ports[1], agent_user("w2"), "pw-2")
    assert store.sync_acl() == 1
    assert can_log_in(sentinel, sentinel.node_ports[1], agent_user("w2"), "pw-2")
    assert store.sync_acl() == 0  # equal rules in another order are not rewritten


def test_a_rejoin_with_a_new_password_reaches_the_replica(sentinel, store):
    store.join_worker("w3", {"host": "h3"}, "old")
    store.join_worker("w3", {"host": "h3"}, "new")
    assert can_log_in(sentinel, sentinel.node_ports[1], agent_user("w3"), "new")
    assert not can_log_in(sentinel, sentinel.node_ports[1], agent_user("w3"), "old")


def test_a_forgotten_worker_loses_its_user_on_every_node(sentinel, store):
    store.join_worker("w4", {"host": "h4"}, "pw-4")
    store.delete_user(agent_user("w4"))
    store.save_acl()
    for port in sentinel.node_ports:
        assert not can_log_in(sentinel, port, agent_user("w4"), "pw-4")


def test_an_agent_url_reaches_the_master_through_the_sentinels(sentinel, store):
    store.join_worker("w5", {"host": "h5"}, "pw-5")
    agent = Store(with_credentials(sentinel.url, agent_user("w5"), "pw-5"))
    try:
        beat = agent.heartbeat("w5")
        assert store.workers_seen()["w5"] == pytest.approx(beat.time)  # on the master
    finally:
        agent.close()
