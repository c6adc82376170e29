"""Waited writes under Sentinel when the replica stops answering (services/store.py
`Store._replicated`): one write waits out WAIT's timeout, the writes after it do not, none is
lost, and once the replica is back a write again returns only when the replica has it.
Real redis-servers and Sentinels (tests/sentinel_redis.py), auth on."""

from __future__ import annotations

import signal
import time

import redis

from services.store import Store
from tests.stack import wait_until

RECHECK_S = 3.0


def events_on(sentinel, port: int, key: str) -> list[str]:
    """The `n` of every event in the stream `key` on the data node at `port`."""
    with redis.Redis(
        port=port, username="admin", password=sentinel.secrets.redis_admin_password
    ) as r:
        return [f[b"n"].decode() for _, f in r.xrange(key)]


def timed_write(store: Store, jid: str, n: int) -> float:
    t0 = time.monotonic()
    store.add_event(jid, {"n": str(n)})
    return time.monotonic() - t0


def test_writes_stop_waiting_for_a_stopped_replica_and_wait_again_once_it_is_back(sentinel):
    store = Store(sentinel.controller_url, replica_recheck_s=RECHECK_S)
    timeout_s = store.sentinel.wait_timeout_ms / 1000
    replica, jid = sentinel.nodes[1], "j1"
    key = store.keys.job_events(jid)
    master_port, replica_port = sentinel.node_ports
    replica.kill(signal.SIGSTOP)
    try:
        first = timed_write(store, jid, 0)
        assert first >= 0.9 * timeout_s, f"the first write did not wait for the replica: {first}"
        # each would wait out the whole timeout again: ten of them 10 x timeout_s at least
        rest = sum(timed_write(store, jid, n) for n in range(1, 11))
        assert rest < 2 * timeout_s, f"10 writes took {rest:.1f}s: they still wait"
    finally:
        replica.kill(signal.SIGCONT)
    want = [str(n) for n in range(11)]
    assert events_on(sentinel, master_port, key) == want  # none lost
    wait_until(lambda: events_on(sentinel, replica_port, key) == want, 30, "the replica's copy")
    time.sleep(RECHECK_S)
    timed_write(store, jid, 11)  # waits, and the replica answers: writes wait from now on
    replica.kill(signal.SIGSTOP)
    try:
        again = timed_write(store, jid, 12)
        assert again >= 0.9 * timeout_s, f"writes no longer wait for the replica: {again}"
    finally:
        replica.kill(signal.SIGCONT)
    store.close()
