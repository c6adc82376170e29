"""Room kept for NCCL in the shared memory a GPU rank's snapshots would otherwise fill.

NCCL keeps its intra-node transport buffers and proxy state in `/dev/shm`, the agents'
default snapshot directory (`--snapshot-dir`) too. A snapshot ring sized for the host's memory
can take the last of it, and NCCL then fails the next communicator it sets up (a recovery's)
or dies of a SIGBUS in a buffer it maps. So on a GPU rank whose snapshot directory shares its
file system with `/dev/shm`, a slot gets its memory only while `NCCL_SHM_HEADROOM` stays free
after it; otherwise that one snapshot fails with ENOSPC, naming the fix, and training goes on
(worker/trainer/snapshot.py, `allocate`). The Helm chart gives snapshots a memory-backed
volume of their own, where this never applies; CPU ranks (gloo uses no shared memory) keep
none. What is left is the room an agent registers for snapshots (`snapshot_capacity`), which
admission holds a job's snapshot rings to (controller/admission.py).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

SHM = Path("/dev/shm")
NCCL_SHM_HEADROOM = 1 << 30  # NCCL's buffers for 8 local peers over every channel, and more


def headroom_for(d: Path, gpu: bool) -> int:
    """The bytes to keep free in `d`'s file system: NCCL_SHM_HEADROOM for a GPU rank whose
    snapshots live in /dev/shm's file system, else 0."""
    if not gpu:
        return 0
    return NCCL_SHM_HEADROOM if _same_file_system(d, SHM) else 0


def snapshot_capacity(d: Path, gpu: bool) -> int:
    """The bytes snapshots may fill in `d` (an agent's --snapshot-dir, made or not): its file
    system's size (a tmpfs's `size=`; half the host's memory for /dev/shm by default), less
    NCCL's headroom on a GPU worker; 0 when it cannot be read."""
    existing = _existing(d)
    try:
        st = os.statvfs(existing) if existing is not None else None
    except OSError:
        st = None
    if st is None:
        return 0
    return max(0, st.f_blocks * st.f_frsize - headroom_for(d, gpu))


def check_room(path: Path, need: int, headroom: int) -> None:
    """Raise ENOSPC when `need` more bytes in `path`'s file system would leave less than
    `headroom` free."""
    if headroom <= 0:
        return
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free - need < headroom:
        raise OSError(
            errno.ENOSPC,
            f"a snapshot of {need / 2**20:,.0f} MiB would leave {max(0, free - need) / 2**20:,.0f}"
            f" MiB free in {path.parent}, which shares /dev/shm with NCCL; {headroom / 2**30:.0f}"
            " GiB are kept for NCCL's buffers. Give snapshots a memory-backed volume of their "
            "own (the agent's --snapshot-dir; the Helm chart's snapshots.size), or fewer slots "
            "(snapshot.keep)",
        )


def _existing(d: Path) -> Path | None:
    """`d` or its nearest ancestor that exists: where its file system is read."""
    return next((p for p in (d, *d.parents) if p.exists()), None)


def _same_file_system(d: Path, other: Path) -> bool:
    existing = _existing(d)
    try:
        return existing is not None and os.stat(existing).st_dev == os.stat(other).st_dev
    except OSError:
        return False
