"""The on-disk side of checkpoints: layout, commit marker, verification, retention.

    {root}/{job}/step-{N:08d}/      DCP shards + .metadata, written by every rank
    {root}/{job}/step-{N:08d}/manifest.json   the commit marker, written last, atomically

A directory without a valid manifest is not a checkpoint (a save still running, killed,
or failed). No torch here: the controller and tools can read it too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"


class DamagedCheckpoint(Exception):
    pass


@dataclass(frozen=True)
class Committed:
    step: int
    path: Path
    manifest: dict


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


class CheckpointStore:
    def __init__(self, root: str | Path, job: str):
        self.dir = Path(root) / job

    def step_dir(self, step: int) -> Path:
        return self.dir / f"step-{step:08d}"

    def candidates(self) -> list[Path]:
        """Step directories, newest first (committed or not)."""
        if not self.dir.is_dir():
            return []
        return sorted((p for p in self.dir.glob("step-*") if p.is_dir()), reverse=True)

    def commit(self, step: int, meta: dict) -> Path:
        """Write the manifest (with every file's checksum) last and atomically."""
        d = self.step_dir(step)
        files = {str(p.relative_to(d)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in _files(d)}
        manifest = {**meta, "step": step, "committed_at": time.time(), "files": files}
        tmp = d / (MANIFEST + ".tmp")
        with tmp.open("w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / MANIFEST)
        dir_fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return d

    def verify(self, d: Path) -> Committed:
        try:
            manifest = json.loads((d / MANIFEST).read_text())
        except FileNotFoundError:
            raise DamagedCheckpoint(f"{d.name}: no commit marker (partial or interrupted save)") from None
        except (OSError, ValueError) as e:
            raise DamagedCheckpoint(f"{d.name}: unreadable manifest: {e}") from None
        for name, want in manifest.get("files", {}).items():
            p = d / name
            if not p.is_file():
                raise DamagedCheckpoint(f"{d.name}: missing file {name}")
            if p.stat().st_size != want["bytes"] or _sha256(p) != want["sha256"]:
                raise DamagedCheckpoint(f"{d.name}: checksum mismatch in {name}")
        if ".metadata" not in manifest.get("files", {}):
            raise DamagedCheckpoint(f"{d.name}: manifest lists no DCP .metadata")
        return Committed(manifest["step"], d, manifest)

    def latest_valid(self, warn) -> Committed | None:
        """Newest checkpoint that verifies; `warn(msg)` for every one skipped."""
        for d in self.candidates():
            try:
                return self.verify(d)
            except DamagedCheckpoint as e:
                warn(str(e))
        return None

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` committed checkpoints; drop older ones and old partials."""
        committed = [d for d in self.candidates() if (d / MANIFEST).is_file()]
        if not committed:
            return
        newest_kept = committed[: keep]
        oldest_kept = newest_kept[-1]
        for d in self.candidates():
            if d not in newest_kept and d < oldest_kept:
                shutil.rmtree(d, ignore_errors=True)

    def discard(self, step: int) -> None:
        shutil.rmtree(self.step_dir(step), ignore_errors=True)
