"""The Redis contract (services/store.py) against a real redis-server: lease and fencing,
the generation-guarded checkpoint pointer, heartbeats on server time, bounded events."""

from __future__ import annotations

import time

import pytest

from services.store import EVENTS_MAXLEN, Fenced, Store, Tx, TxRefused


def snapshot(store: Store) -> dict:
    """Every key with its type and content: what a refused transaction must leave as it was."""
    dump = {
        "hash": store.r.hgetall,
        "string": store.r.get,
        "stream": lambda k: store.r.xrange(k),
        "zset": lambda k: store.r.zrange(k, 0, -1, withscores=True),
    }
    return {k: (store.r.type(k), dump[store.r.type(k)](k)) for k in store.r.keys("*")}


def test_lease_is_exclusive_and_fences_a_deposed_holder(store):
    a = store.acquire_lease("ctl-a", ttl_s=0.5)
    assert a == "ctl-a:1"
    assert store.acquire_lease("ctl-b", ttl_s=0.5) is None  # held
    assert store.acquire_lease("ctl-a", ttl_s=0.5) == a  # renewal keeps the token
    store.commit(Tx().hset("t:x", {"v": 1}), a)
    time.sleep(0.6)  # a stops renewing (paused, partitioned): the lease runs out
    b = store.acquire_lease("ctl-b", ttl_s=5)
    assert b == "ctl-b:2"  # a new, larger fencing token
    store.r.hset("t:y", "job", "j1")
    before = snapshot(store)
    with pytest.raises(Fenced):
        store.commit(Tx().hset("t:x", {"v": 2}).delete("t:y").event("t:ev", {"reason": "x"}), a)
    assert snapshot(store) == before  # nothing of the fenced transaction applied
    store.commit(Tx().hset("t:x", {"v": 3}), b)
    assert store.r.hget("t:x", "v") == "3"
    store.release_lease(a)  # a stale holder cannot release someone else's lease
    assert store.lease_holder() == b


def test_fenced_transaction_applies_every_command_and_delete_if_only_on_a_match(store):
    lease = store.acquire_lease("ctl", ttl_s=5)
    store.r.hset("t:p1", mapping={"job": "j1"})
    store.r.hset("t:p2", mapping={"job": "j2"})
    store.r.set("t:p3", "a string, as an older version wrote this pointer")
    big = {f"rank:{i}": i for i in range(1500)}  # more fields than one HSET chunk
    store.commit(
        Tx()
        .hset("t:big", big)
        .delete_if("t:p1", "job", "j1")
        .delete_if("t:p2", "job", "j1")
        .event("t:ev", {"reason": "Placed"})
        .delete("t:p3")
        .hset("t:p3", {"job": "j1"}),
        lease,
    )  # DEL makes room for the hash
    assert store.r.hlen("t:big") == 1500
    assert not store.r.exists("t:p1") and store.r.exists("t:p2")
    assert store.r.xlen("t:ev") == 1 and store.r.hgetall("t:p3") == {"job": "j1"}


def test_a_refused_transaction_writes_nothing(store):
    """A command that would fail midway (WRONGTYPE: HSET on a string) refuses the whole
    transaction before its first write: none of the commands before it is applied, however
    many (an HSET of three chunks, a matching DELIFEQ, DEL, XADD, ZREM, a new key)."""
    lease = store.acquire_lease("ctl", ttl_s=5)
    store.r.hset("t:big", mapping={"rank:0": "kept"})
    store.r.hset("t:p1", mapping={"job": "j1"})
    store.r.hset("t:p2", mapping={"job": "j2"})
    store.r.set("t:s", "plain string")
    store.r.zadd("t:z", {"j1": 1})
    before = snapshot(store)
    tx = (
        Tx()
        .hset("t:big", {f"rank:{i}": "moved" for i in range(1500)})
        .delete_if("t:p1", "job", "j1")
        .delete("t:p2")
        .event("t:ev", {"reason": "Lost"})
        .zrem("t:z", "j1")
        .hset("t:new", {"f": "v"})
        .hset("t:s", {"f": "v"})
    )
    with pytest.raises(
        TxRefused,
        match=r"command 9 \(HSET t:s\): key t:s holds a string, "
        r"HSET needs a hash",
    ):
        store.commit(tx, lease)
    assert snapshot(store) == before
    assert not store.r.exists("t:new") and not store.r.exists("t:ev")

    with pytest.raises(TxRefused, match="t:z holds a zset, XADD needs a stream"):
        store.commit(Tx().hset("t:new", {"f": "v"}).event("t:z", {"reason": "x"}), lease)
    assert snapshot(store) == before


def test_fenced_transaction_refuses_undeclared_keys_and_unknown_verbs(store):
    lease = store.acquire_lease("ctl", ttl_s=5)
    store.r.hset("t:a", "v", "1")
    before = snapshot(store)
    tx = Tx().hset("t:a", {"v": "2"}).hset("t:b", {"v": "2"})
    del tx.keys["t:b"]  # a hand-built Tx that writes a key it does not declare
    with pytest.raises(TxRefused, match="key t:b is not declared in KEYS"):
        store.commit(tx, lease)
    tx = Tx().hset("t:a", {"v": "2"})
    tx.keys[store.keys.lease()] = None  # declaring the lease does not make it writable
    tx.cmds.append(["DEL", store.keys.lease()])
    with pytest.raises(TxRefused, match="is not declared in KEYS"):
        store.commit(tx, lease)
    tx = Tx().hset("t:a", {"v": "2"})
    tx.cmds.append(["FLUSHALL"])
    with pytest.raises(TxRefused, match="unknown verb"):
        store.commit(tx, lease)
    tx = Tx().hset("t:a", {"v": "2"})
    tx.cmds.append(["HSET", "t:a", "field-without-value"])
    with pytest.raises(
        TxRefused, match=r"command 2 \(HSET t:a\): wrong number or form of arguments"
    ):
        store.commit(tx, lease)
    assert snapshot(store) == before


def test_heartbeats_use_redis_server_time(store):
    t = store.heartbeat("w1", "job-a", 4).time
    assert abs(t - store.now()) < 1.0
    assert store.alive_workers(within_s=2.0) == ["w1"]
    w = store.r.hgetall(store.keys.worker("w1"))
    assert (w["job"], w["generation"]) == ("job-a", "4")
    assert store.alive_workers(within_s=2.0, now=t + 5) == []  # liveness by score, no scan


def test_events_stream_is_bounded(store):
    for i in range(EVENTS_MAXLEN * 2):
        store.add_event("j", {"type": "Normal", "reason": "Tick", "message": str(i)})
    n = store.r.xlen(store.keys.job_events("j"))
    assert EVENTS_MAXLEN <= n < EVENTS_MAXLEN * 2  # approximate trimming, but trimmed
    first = store.events("j", limit=2)
    later = store.events("j", after=first[0]["id"], limit=1)
    assert later[0]["id"] == first[1]["id"]
