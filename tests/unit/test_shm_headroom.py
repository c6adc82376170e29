"""Room kept for NCCL where a GPU rank's snapshots share /dev/shm (worker/shm_headroom.py): a
slot that would eat into it fails with ENOSPC naming the fix, before any of its pages get
memory; elsewhere, and on CPU ranks, nothing is kept. The capacity an agent registers for
snapshots is its directory's file system, less that room on a GPU worker."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from worker.shm_headroom import NCCL_SHM_HEADROOM, headroom_for, snapshot_capacity
from worker.trainer.snapshot import allocate

GPU, CPU = True, False


@pytest.fixture
def shm_dir():
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="mk-headroom-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_gpu_ranks_snapshots_in_dev_shm_keep_room_for_nccl(shm_dir):
    # the ring's directory does not exist yet when the snapshotter starts
    assert headroom_for(shm_dir / "w1" / "job" / "g1" / "r0", GPU) == NCCL_SHM_HEADROOM


def test_a_cpu_rank_keeps_none(shm_dir):
    assert headroom_for(shm_dir, CPU) == 0


def test_a_volume_of_their_own_keeps_none(tmp_path):
    if os.stat(tmp_path).st_dev == os.stat("/dev/shm").st_dev:
        pytest.skip("the temporary directory is on /dev/shm's file system here")
    assert headroom_for(tmp_path, GPU) == 0


def test_a_slot_that_would_eat_into_the_headroom_fails_before_taking_memory(shm_dir):
    path = shm_dir / "slot-0.bin"
    path.write_bytes(b"")
    os.truncate(path, 1 << 20)
    st = os.statvfs(path)
    whole = st.f_blocks * st.f_frsize  # more than can ever be free, whatever else runs
    with pytest.raises(OSError) as refused:
        allocate(path, 0, 1 << 20, headroom=whole)
    assert refused.value.errno == errno.ENOSPC
    assert "shares /dev/shm with NCCL" in str(refused.value), refused.value
    assert "--snapshot-dir" in str(refused.value), refused.value
    assert os.stat(path).st_blocks == 0  # no page of it got memory
    allocate(path, 0, 1 << 20, headroom=1 << 20)
    assert os.stat(path).st_blocks * 512 >= 1 << 20


def test_the_registered_capacity_is_the_file_systems_size_less_nccls_room(shm_dir):
    st = os.statvfs("/dev/shm")
    size = st.f_blocks * st.f_frsize
    not_yet_made = shm_dir / "meshkeeper" / "w1"
    assert snapshot_capacity(not_yet_made, CPU) == size
    assert snapshot_capacity(not_yet_made, GPU) == size - NCCL_SHM_HEADROOM
