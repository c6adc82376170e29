"""Checkpoint storage must be one filesystem for the whole world (docs/architecture.md,
"Checkpoints"): rank 0 gathers the shards' digests from it and every rank restores from it.
A node-local root (each agent's own `--checkpoint-root` on its own disk) would let a job train
and then fail at its first commit, every commit, each only a warning. Checked once at start,
before anything is restored: rank 0 writes a random nonce there and every rank reads it back.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
from pathlib import Path

import torch.distributed as dist


class StorageNotShared(ValueError):
    """Some rank cannot read what rank 0 wrote under the checkpoint root; names the fix."""


def check_shared(job_dir: Path) -> None:
    """Every rank of the world sees rank 0's nonce under `job_dir` (its own root's path for
    this job), or every rank raises StorageNotShared naming the ranks and hosts that did not."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    probe = job_dir / ".shared-check"
    nonce = [None]
    made: list[Path] = []  # directories the check creates, removed after it
    if rank == 0:
        nonce[0] = secrets.token_hex(16)
        made = [d for d in (probe, *probe.parents) if not d.exists()]
        probe.mkdir(parents=True, exist_ok=True)
        (probe / nonce[0]).write_text(nonce[0])
    dist.broadcast_object_list(nonce, src=0)  # only once it is written
    mine = probe / nonce[0]
    try:
        seen = mine.read_text() == nonce[0]
    except OSError:
        seen = False
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (seen, socket.gethostname(), str(job_dir)))
    if rank == 0:  # a job that never saves leaves no trace
        mine.unlink(missing_ok=True)
        for d in made:  # deepest first; one another process wrote into stays
            with contextlib.suppress(OSError):
                d.rmdir()
    blind = [(r, host, path) for r, (ok, host, path) in enumerate(every) if not ok]
    if blind:
        where = ", ".join(f"rank {r} on {host} ({path})" for r, host, path in blind[:8])
        raise StorageNotShared(
            f"checkpoint storage is not shared: rank 0 wrote a file under {every[0][2]} on "
            f"{every[0][1]} that {len(blind)} rank(s) cannot read ({where}). Checkpoints need "
            "one filesystem for every rank: give every agent a --checkpoint-root on shared "
            "storage (NFS, a ReadWriteMany volume) or set checkpoint.root to such a path"
        )
