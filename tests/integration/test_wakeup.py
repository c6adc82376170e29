"""The controller's wake-up (controller/wakeup.py): an agent's announcement of a trainer exit
ends the reconcile loop's wait at once; woken passes keep their floor apart; the listener
subscribes again after Redis drops it. A real redis-server, the real Store on both sides."""

from __future__ import annotations

import threading
import time

import pytest

from controller.wakeup import Wakeup
from services.store import Store
from tests.stack import wait_until

INTERVAL_S = 60.0  # far above anything the tests wait: a return before it is the wake-up


@pytest.fixture
def wakeup(store: Store, redis_server):
    stop = threading.Event()
    w = Wakeup(Store(redis_server.url, prefix="t:"), stop)
    listener = threading.Thread(target=w.listen, daemon=True)
    listener.start()
    wait_until(lambda: listening(store), 10, "the listener subscribed")
    yield w
    stop.set()
    w.interrupt()
    listener.join(5)
    w.store.close()


def listening(store: Store) -> bool:
    return store.r.pubsub_numsub(store.keys.controller_wake())[0][1] == 1


def timed_wait(w: Wakeup) -> float:
    t0 = time.monotonic()
    w.wait(INTERVAL_S)
    return time.monotonic() - t0


def announce_soon(store: Store, after_s: float) -> None:
    threading.Timer(after_s, store.announce_exit, args=("w1",)).start()


def test_an_announced_exit_ends_the_wait(store, wakeup):
    announce_soon(store, 0.2)
    waited = timed_wait(wakeup)
    assert 0.1 < waited < INTERVAL_S / 4, waited  # woken by the message, not the interval
    assert wakeup.woken == 1


def test_woken_passes_start_at_least_the_floor_apart(store, wakeup):
    wakeup.min_gap_s = 0.5
    wakeup.wait(0)  # a pass starts now
    wakeup.event.set()  # an announcement arrived during that pass
    assert 0.4 < timed_wait(wakeup) < INTERVAL_S / 4


def test_the_listener_subscribes_again_after_redis_drops_it(store, wakeup):
    store.r.client_kill_filter(_type="pubsub")
    wait_until(lambda: listening(store), 10, "the listener subscribed again")
    announce_soon(store, 0.2)
    assert timed_wait(wakeup) < INTERVAL_S / 4
