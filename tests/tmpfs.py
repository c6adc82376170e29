"""A small tmpfs mounted for one test: a real full disk, as ENOSPC or SIGBUS, without filling
the machine's. Mounting needs root, as the suite runs."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def small_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    mount.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"this test needs root to mount a small tmpfs: {proc.stderr}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
