"""TLS under Sentinel (docs/security.md, "TLS"): data nodes and Sentinels that serve only TLS,
replicate and monitor over it, reached by a rediss+sentinel:// URL. Plaintext and unverified
clients are refused by the Sentinels too, and a failover keeps every acknowledged write with
the client still on TLS. Real openssl, real redis-servers and Sentinels, auth on."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.store import Store
from tests.sentinel_redis import SentinelRedis
from tests.stack import TestSecrets, self_signed_cert, wait_until


@pytest.fixture(scope="module")
def tls_sentinel(tmp_path_factory):
    work = tmp_path_factory.mktemp("tls-sentinel")
    tls = self_signed_cert(work)
    s = SentinelRedis(work / "redis", TestSecrets.create(work / "secrets"), tls=tls)
    s.start()
    try:
        yield s
    finally:
        s.close()


def test_sentinels_refuse_plaintext_and_unverified_clients(tls_sentinel):
    port = tls_sentinel.sentinel_ports[0]
    auth = {"username": "discover", "password": tls_sentinel.discover_password}
    once = {"socket_timeout": 2, "retry": Retry(NoBackoff(), 0)}
    with tls_sentinel.client(port, **auth) as r:
        assert r.sentinel_get_master_addr_by_name("mk")[1] == tls_sentinel.master_port()
    with pytest.raises(redis.ConnectionError):
        redis.Redis("127.0.0.1", port, **auth, **once).ping()
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        redis.Redis("127.0.0.1", port, ssl=True, **auth, **once).ping()  # no CA: not trusted


def test_a_failover_over_tls_keeps_every_acknowledged_write(tls_sentinel):
    store = Store(tls_sentinel.controller_url)
    key = store.keys.job_events("j1")
    for n in range(20):
        store.add_event("j1", {"n": str(n)})  # each waited for the replica (WAIT)
    old = tls_sentinel.master_port()
    tls_sentinel.proc.kill()
    wait_until(lambda: tls_sentinel.master_port() not in (0, old), 60, "a failover")
    wait_until(lambda: _writes(store, "j1"), 60, "the store to write to the new master")
    with tls_sentinel.client(
        tls_sentinel.master_port(),
        username="admin",
        password=tls_sentinel.secrets.redis_admin_password,
    ) as r:
        seen = [f["n"] for _, f in r.xrange(key)]
    assert seen[:20] == [str(n) for n in range(20)]  # none lost
    store.close()


def _writes(store: Store, jid: str) -> bool:
    try:
        store.add_event(jid, {"n": "after"})
        return True
    except redis.RedisError:
        return False
