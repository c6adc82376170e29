"""The flight recorder's dump as the agent reads it (worker/flight_record.py), from a dump
torch itself wrote: two gloo ranks complete two all-reduces in the world and one in a group
of their own, then rank 0 starts a third world all-reduce that rank 1 joins only after rank 0
has dumped its recorder (`_dump_fr_trace`, the pickle the NCCL watchdog writes on a timeout).

The rank side is this module's `__main__` under tests/rankrun.py: argv[1] is the directory
the dump goes to.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path

from tests.launch import run_ranks
from worker.flight_record import dump_path, summarize


def test_a_torch_dump_gives_each_groups_last_completed_and_first_pending_collective(tmp_path):
    proc = run_ranks(2, "tests.unit.test_flight_record", [str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = summarize(dump_path(tmp_path / "metrics-0.jsonl", 0))
    assert got is not None, sorted(p.name for p in tmp_path.iterdir())
    world = got.pop("0")
    assert world == {
        "desc": "default_pg",
        "completed": 2,
        "pending": 3,
        "state": "scheduled",
        "op": "gloo:all_reduce",
    }, world
    [(name, pair)] = got.items()
    assert pair["completed"] == 1 and pair["pending"] is None, (name, pair)


def test_a_dump_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "flight-rank0"
    path.write_bytes(pickle.dumps({"entries": [Exploit()]}))
    assert summarize(path) is None
    assert not marker.exists()


def test_no_dump_is_none(tmp_path):
    assert summarize(tmp_path / "flight-rank3") is None


def _main() -> None:
    import torch
    import torch.distributed as dist

    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t)
    dist.all_reduce(t, group=pair)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        # gloo's completion callback retires an entry just after wait() returns: the dump is
        # taken once the three finished collectives are retired, as they long are by the time
        # a watchdog times out
        deadline = time.monotonic() + 10
        while sum(e["retired"] for e in _entries()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        work = dist.all_reduce(t, async_op=True)  # rank 1 is not there yet: pending
        dump_path(out / "metrics-0.jsonl", 0).write_bytes(
            torch._C._distributed_c10d._dump_fr_trace()
        )
        store.set("dumped", "1")
        work.wait()
    else:
        store.wait(["dumped"])
        dist.all_reduce(t)
    dist.destroy_process_group()


def _entries() -> list[dict]:
    import torch

    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]


if __name__ == "__main__":
    _main()
