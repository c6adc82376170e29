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


def waits_run(sentinel, port: int) -> int:
    """How many WAIT commands the data node at `port` has run (INFO commandstats)."""
    with redis.Redis(
        port=port, username="admin", password=sentinel.secrets.redis_admin_password
    ) as r:
        return int(r.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def test_writes_stop_waiting_for_a_stopped_replica_and_wait_again_once_it_is_back(sentinel):
    store = Store(sentinel.controller_url, replica_recheck_s=RECHECK_S)
    replica, jid = sentinel.nodes[1], "j1"
    key = store.keys.job_events(jid)
    master_port, replica_port = sentinel.node_ports
    before = waits_run(sentinel, master_port)
    replica.kill(signal.SIGSTOP)
    try:
        store.add_event(jid, {"n": "0"})  # waits out WAIT's timeout: no replica answers
        assert waits_run(sentinel, master_port) == before + 1
        for n in range(1, 11):  # would each wait out the whole timeout again
            store.add_event(jid, {"n": str(n)})
        assert waits_run(sentinel, master_port) == before + 1, "writes still wait"
    finally:
        replica.kill(signal.SIGCONT)
    want = [str(n) for n in range(11)]
    assert events_on(sentinel, master_port, key) == want  # none lost
    wait_until(lambda: events_on(sentinel, replica_port, key) == want, 30, "the replica's copy")
    time.sleep(RECHECK_S)
    store.add_event(jid, {"n": "11"})  # waits again, and the replica answers
    store.add_event(jid, {"n": "12"})  # so this one waits too
    assert waits_run(sentinel, master_port) == before + 3, "writes no longer wait"
    store.close()
