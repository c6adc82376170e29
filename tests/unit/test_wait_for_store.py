"""The non-zero ranks' wait for rank 0's rendezvous store (worker/trainer/distributed.py): it
returns once the store listens, so the torch client that follows connects without a refused
try; a store that never comes up is named in the error, with rank 0 as the thing to check."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from services.procs import free_port
from worker.trainer.distributed import wait_for_store

TIMEOUT = timedelta(seconds=30)


def test_returns_once_the_store_listens_and_the_client_connects():
    port, started = free_port(), {}

    def host_later() -> None:
        time.sleep(0.3)
        started["at"] = time.monotonic()
        started["store"] = TCPStore("127.0.0.1", port, 2, True, TIMEOUT, wait_for_workers=False)

    t = threading.Thread(target=host_later)
    t.start()
    wait_for_store("127.0.0.1", port, 30)
    returned = time.monotonic()
    t.join()
    assert returned >= started["at"]  # it waited for the server, it did not return early
    client = TCPStore("127.0.0.1", port, 2, False, TIMEOUT)
    client.set("k", "v")
    assert started["store"].get("k") == b"v"


def test_a_store_that_never_listens_is_named_with_rank_0():
    port = free_port()
    with pytest.raises(RuntimeError, match=rf"rendezvous store at 127\.0\.0\.1:{port}.*rank 0"):
        wait_for_store("127.0.0.1", port, 0.3)
