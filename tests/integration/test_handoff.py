"""The trainer's side of an in-place restart (worker/trainer/handoff.py), one behaviour each:
an order unblocks a gloo collective that would otherwise wait out its timeout; a rank whose
error is its own does not wait for an order; an order of the generation it runs, or older, is
not one."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from services.procs import free_port
from tests.launch import ENV, ROOT
from worker.handoff_order import Order
from worker.trainer.handoff import Handoff

# Ranks 0 and 1 all-reduce with rank 2, which never joins: only the order can end their wait
# before the group's 120 s timeout.
BLOCKED = """
import json, os, sys, time
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from worker.trainer.handoff import Handoff
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
if rank == 2:
    time.sleep(300)
handoff = Handoff(Path(sys.argv[1]) / f"rank{rank}.json", generation=1, park_s=60)
print(json.dumps({"waiting": rank}), flush=True)
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(4))
except Exception as e:
    order = handoff.wait() if handoff.may_follow(e) else None
    print(json.dumps({"rank": rank, "after_s": time.monotonic() - t0,
                      "generation": order.generation if order else None}), flush=True)
handoff.close()
"""


def test_an_order_ends_a_blocked_collective_at_once(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BLOCKED, str(tmp_path)],
            cwd=ROOT,
            env={
                **ENV,
                "RANK": str(r),
                "WORLD_SIZE": "3",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    try:
        for p in procs[:2]:
            assert json.loads(p.stdout.readline())["waiting"] in (0, 1)
        time.sleep(1.0)  # both inside the all-reduce
        for r in range(2):
            Order(2, ["--spec", "x"], {"RANK": str(r)}, str(tmp_path / "log")).write(
                tmp_path / f"rank{r}.json"
            )
        results = [json.loads(p.stdout.readline()) for p in procs[:2]]
        for p in procs[:2]:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [r["generation"] for r in results] == [2, 2], results
    # the group's timeout is 120 s; the watcher polls every 10 ms
    assert all(r["after_s"] < 30 for r in results), results
    assert not any((tmp_path / f"rank{r}.json").exists() for r in range(2))  # taken


def test_an_error_of_its_own_does_not_wait_for_an_order(tmp_path):
    handoff = Handoff(tmp_path / "rank0.json", generation=3, park_s=60)
    try:
        assert not handoff.may_follow(ValueError("a bug in this rank"))
    finally:
        handoff.close()


def test_a_peers_failure_waits_for_the_order_and_takes_it(tmp_path):
    path = tmp_path / "rank0.json"
    handoff = Handoff(path, generation=3, park_s=60)
    peer_gone = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    )
    try:
        assert handoff.may_follow(peer_gone)
        Order(4, [], {}, "log").write(path)
        order = handoff.wait()
    finally:
        handoff.close()
    assert order is not None and order.generation == 4


def test_an_order_of_this_generation_or_older_is_not_taken(tmp_path):
    path: Path = tmp_path / "rank0.json"
    Order(3, [], {}, "log").write(path)
    handoff = Handoff(path, generation=3, park_s=0.5)
    try:
        time.sleep(0.2)  # the watcher has looked more than once
        assert handoff.wait() is None
    finally:
        handoff.close()
    assert path.exists()  # not taken, so not removed
