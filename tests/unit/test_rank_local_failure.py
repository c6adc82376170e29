"""A failure on one rank alone ends that rank at once with its own exit code (worker/trainer
main.py): it does not wait at the teardown barrier for peers that will never come, which
turned a bad token file into a 60-second collective timeout. Here rank 1's first batch holds
a token id past the vocabulary (a DatasetError, exit 2), and rank 0's batches are clean."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dataset.format import DatasetError
from services.spec import parse_spec
from tests.launch import run_trainer
from tests.stack import tiny_spec
from worker.trainer.data import Batches

STEPS, SEQ = 3, 32
HANG_AFTER_S = 60.0  # what the barrier would have waited


def fails(batches: Batches, dp_rank: int) -> bool:
    try:
        for step in range(STEPS):
            batches.local(step, dp_rank)
    except DatasetError:
        return True
    return False


def poisoned_file(tmp_path, spec: dict) -> str:
    """A token file whose one bad id lies in a window rank 1 reads and rank 0 never does."""
    path = tmp_path / "tokens.bin"
    clean = np.random.default_rng(0).integers(0, 256, 40 * SEQ, dtype=np.uint16)
    for bad in range(0, len(clean), SEQ // 2):
        tokens = clean.copy()
        tokens[bad] = 4000
        tokens.tofile(path)
        s = parse_spec({**spec, "data": {"source": f"tokens:{path}", "seed": 7}})
        batches = Batches(s.data, s.model, s.train.global_batch, s.parallel.dp)
        if fails(batches, 1) and not fails(batches, 0):
            return str(path)
    pytest.fail("no position poisons rank 1's batches alone")


def test_a_data_error_on_one_rank_exits_2_within_seconds(tmp_path):
    spec = tiny_spec("rank-local", train={"steps": STEPS})
    spec["data"] = {"source": f"tokens:{poisoned_file(tmp_path, spec)}", "seed": 7}
    spec["fault_tolerance"] = {"hang_after_s": HANG_AFTER_S}
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_trainer(spec, tmp_path / "run", timeout=200)
    took = time.monotonic() - t0
    report = str(failed.value)
    assert "[rankrun] rank 1 exited with 2" in report, report[-3000:]
    assert "token id 4000 >= model.vocab 256" in report, report[-3000:]
    assert took < HANG_AFTER_S / 2, f"the failed rank waited {took:.0f}s"
