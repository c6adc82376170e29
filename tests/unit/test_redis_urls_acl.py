"""Redis URLs with and without credentials, and the agent ACL's refusal of glob characters."""

from __future__ import annotations

import re

import pytest

from services.redis_url import RedisURLError, parse_sentinel, with_credentials, without_credentials
from services.store import agent_acl


def test_credentials_are_replaced_and_the_rest_of_the_url_kept():
    url = "rediss://controller:s3cret@redis.ml.svc:6380/2?ssl_ca_certs=/etc/ca.pem"
    mine = with_credentials(url, "agent-w1", "p/w@x")
    assert mine == "rediss://agent-w1:p%2Fw%40x@redis.ml.svc:6380/2?ssl_ca_certs=/etc/ca.pem"
    assert with_credentials("redis://[::1]:6379/0", "admin", "a") == "redis://admin:a@[::1]:6379/0"
    assert without_credentials(url) == "rediss://redis.ml.svc:6380/2?ssl_ca_certs=/etc/ca.pem"


@pytest.mark.parametrize("wid", ["w*", "w?", "w[0-9]", "w\\x", "", "-w"])
def test_a_worker_id_that_would_widen_its_key_patterns_is_refused(wid):
    with pytest.raises(ValueError, match="not allowed in an ACL pattern"):
        agent_acl("mk:", wid)


def test_an_agent_owns_exactly_its_own_keys():
    """Across the root rules and every selector: the worker keys it may touch are its own, and
    what the controller writes for it (assignment, health) it may only read."""
    rules = agent_acl("mk:", "w1")
    patterns = [
        (access, key)
        for rule in rules
        for access, key in re.findall(r"%(R|W|RW)~(\S*worker:\S*?)(?=[\s)]|$)", rule)
    ]
    me = "mk:worker:w1"
    assert {key for _, key in patterns} == {
        me,
        f"{me}:progress",
        f"{me}:probe",
        f"{me}:metrics",
        f"{me}:assignment",
        f"{me}:health",
    }, patterns
    assert {key for access, key in patterns if "W" in access} == {
        me,
        f"{me}:progress",
        f"{me}:probe",
        f"{me}:metrics",
    }, patterns
    assert [r for r in rules if r.startswith("&") and "worker:" in r] == [f"&{me}:assignment"]


SENTINEL_URL = (
    "redis+sentinel://controller:s3cret@10.0.0.1:26379,[fd00::2]:26380/mk/2"
    "?sentinel_username=discover&sentinel_password=d1sc&wait_replicas=2"
)


def test_a_sentinel_url_names_its_sentinels_service_db_and_replicas_to_wait_for():
    t = parse_sentinel(SENTINEL_URL)
    assert t.sentinels == [("10.0.0.1", 26379), ("fd00::2", 26380)]
    assert (t.service, t.db, t.username, t.password) == ("mk", 2, "controller", "s3cret")
    assert (t.sentinel_username, t.sentinel_password) == ("discover", "d1sc")
    assert (t.wait_replicas, t.wait_timeout_ms) == (2, 1000)


def test_a_sentinel_url_keeps_its_sentinels_when_credentials_change_and_hides_secrets():
    mine = with_credentials(SENTINEL_URL, "agent-w1", "pw")
    assert mine.startswith("redis+sentinel://agent-w1:pw@10.0.0.1:26379,[fd00::2]:26380/mk/2?")
    assert parse_sentinel(mine).sentinel_password == "d1sc"  # agents discover the master too
    shown = without_credentials(SENTINEL_URL)
    assert "s3cret" not in shown and "d1sc" not in shown
    assert shown == (
        "redis+sentinel://10.0.0.1:26379,[fd00::2]:26380/mk/2"
        "?sentinel_username=discover&wait_replicas=2"
    )


@pytest.mark.parametrize(
    "url, names",
    [
        ("redis+sentinel://s1:26379", "/SERVICE"),
        ("redis+sentinel://s1:26379/mk/x", "/SERVICE/DB"),
        ("redis+sentinel://s1/mk", "HOST:PORT"),
        ("redis+sentinel://s1:26379/mk?wait_replica=1", "wait_replica"),
        ("redis+sentinel://s1:26379/mk?wait_timeout_ms=0", "wait_timeout_ms"),
        ("redis://s1:26379/mk", "redis+sentinel://"),
        ("redis+sentinel://s1:26379/mk?ssl_ca_certs=/ca.pem", "rediss+sentinel://"),
        ("rediss+sentinel://s1:26379/mk?ssl_certfile=/c.pem", "ssl_keyfile"),
    ],
)
def test_a_bad_sentinel_url_is_refused_naming_the_part_to_fix(url, names):
    with pytest.raises(RedisURLError, match=re.escape(names)):
        parse_sentinel(url)


def test_a_tls_sentinel_url_carries_its_ca_and_client_certificate_to_every_connection():
    t = parse_sentinel(
        "rediss+sentinel://controller:s3cret@s1:26380,s2:26380/mk"
        "?ssl_ca_certs=/etc/ca.pem&ssl_certfile=/etc/c.pem&ssl_keyfile=/etc/k.pem"
    )
    assert t.tls == {
        "ssl": True,
        "ssl_ca_certs": "/etc/ca.pem",
        "ssl_certfile": "/etc/c.pem",
        "ssl_keyfile": "/etc/k.pem",
    }
    assert parse_sentinel("rediss+sentinel://s1:26380/mk").tls == {"ssl": True}
    assert parse_sentinel("redis+sentinel://s1:26379/mk").tls == {}
