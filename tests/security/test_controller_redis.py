"""The controller's two Redis users (docs/security.md, "Threats"): the reconcile loop's
`controller` and the agent `provisioner`. Each attack uses the password the attacker would
hold, never the admin's: the controller's cannot make or change a Redis user, reconfigure
the server or cut others off; the provisioner's touches no key. A controller given no
provisioner refuses joins with 503, naming what to give it.

A real redis-server with the aclfile `acl_file` writes, and a real controller (ApiStack).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.security.test_agents_redis import BODY
from tests.stack import ApiStack, Controller


def raw(url: str) -> redis.Redis:
    """A client that fails at once: refusals are what is tested."""
    return redis.Redis.from_url(
        url, decode_responses=True, socket_timeout=3, retry=Retry(NoBackoff(), 0)
    )


# What a leaked controller password tried in the review: make a user with every right, turn
# the `default` user on, write files as Redis (CONFIG SET dir/dbfilename), read every key,
# cut the admin off, stop or replace the scripts agents run, stop the server. (DEBUG is off
# server-wide, before any ACL: enable-debug-command's default.)
ESCALATIONS = [
    ("ACL", "SETUSER", "attacker", "on", ">pw", "~*", "&*", "+@all"),
    ("ACL", "SETUSER", "default", "on", "nopass"),
    ("ACL", "DELUSER", "admin"),
    ("ACL", "LIST"),
    ("CONFIG", "GET", "dir"),
    ("CONFIG", "SET", "dir", "/tmp"),
    ("CLIENT", "KILL", "USER", "admin"),
    ("SCRIPT", "KILL"),
    ("SCRIPT", "FLUSH"),
    ("FUNCTION", "FLUSH"),
    ("KEYS", "*"),
    ("FLUSHALL",),
    ("MODULE", "LIST"),
    ("SHUTDOWN", "NOSAVE"),
]


@pytest.mark.parametrize("command", ESCALATIONS, ids=lambda c: " ".join(c[:2]))
def test_the_controllers_password_cannot_escalate(api, command):
    with raw(api.redis.controller_url) as r:
        r.hset("mk:job:{probe}", "x", "1")  # logged in, and doing its own work
        assert r.hget("mk:job:{probe}", "x") == "1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.execute_command(*command)
    with raw(api.redis.url) as admin:  # nothing changed behind the refusal
        assert "attacker" not in admin.acl_users() and admin.ping()


def test_the_provisioners_password_touches_no_key(api):
    with raw(api.redis.provisioner_url) as r:
        assert r.acl_getuser("controller") is not None  # what it is for
        for command in (
            ("HGET", "mk:job:{probe}", "x"),
            ("HSET", "mk:job:{probe}", "x", "2"),
            ("XADD", "mk:job:{probe}:events", "*", "reason", "Forged"),
            ("KEYS", "*"),
            ("CONFIG", "GET", "dir"),
            ("PUBLISH", "mk:controller:wake", "1"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.execute_command(*command)


@dataclass(frozen=True)
class WithoutProvisioner:
    controller_url: str
    provisioner_url: str = ""  # an empty file: none given


def test_a_controller_without_a_provisioner_refuses_joins_naming_it(api: ApiStack, tmp_path):
    c = Controller(WithoutProvisioner(api.redis.controller_url), tmp_path, "bare", api.secrets)
    try:
        r = httpx.post(
            f"{c.url}/v1/agents/join",
            json={"id": "w9", **BODY},
            headers={"Authorization": f"Bearer {api.secrets.join_token}"},
            timeout=10,
        )
        assert r.status_code == 503 and "REDIS_PROVISIONER_URL" in r.json()["detail"], r.text
        assert "no REDIS_PROVISIONER_URL: agents cannot join" in c.proc.tail()
    finally:
        c.proc.stop(5)
