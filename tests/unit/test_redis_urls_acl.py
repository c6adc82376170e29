"""Redis URLs with and without credentials, and the agent ACL's refusal of glob characters."""

from __future__ import annotations

import pytest

from services.store import agent_acl, with_credentials, without_credentials


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
    rules = agent_acl("mk:", "w1")
    own = [r for r in rules if "worker:" in r]
    assert own == [
        "%RW~mk:worker:w1",
        "%RW~mk:worker:w1:progress",
        "%RW~mk:worker:w1:probe",
        "%RW~mk:worker:w1:metrics",
        "%R~mk:worker:w1:assignment",
        "%R~mk:worker:w1:health",
        "&mk:worker:w1:assignment",
    ]
