"""The on-disk side of checkpoints: layout, commit marker, verification, the pointer history.

    {root}/{job}/g{G:06d}/step-{N:08d}/                 DCP shards + .metadata of generation G
    {root}/{job}/g{G:06d}/step-{N:08d}/manifest.json    its commit marker, written last, atomically
    {root}/{job}/committed.json                         standalone runs only: the pointer history

Fencing on disk (docs/architecture.md, "Generation and fencing"):
- a generation writes only inside its own `g{G}` directory, so a superseded world (cut off
  from Redis, or frozen and resumed) can never overwrite what a newer generation restores;
- a directory is a checkpoint only when a committed pointer names it and its manifest
  verifies against that pointer (job, generation, step, checksums). Nothing here scans the
  disk for "the newest": a forged or stale `step-*` directory is never read;
- only entries that fell out of the pointer history are ever deleted, and only by whoever
  just moved the pointer (rank 0's agent after its CHECKPOINT_CAS under a controller, rank 0
  itself standalone).

Under a controller the pointer history lives in Redis (`job:{id}:checkpoint`, moved only by
the generation CAS) and the agent hands it to the trainer; standalone (torchrun, no Redis)
rank 0 keeps it in `committed.json`. No torch here: the controller and tools can read it too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST = "manifest.json"
HISTORY = "committed.json"


class DamagedCheckpoint(Exception):
    pass


@dataclass(frozen=True)
class Pointer:
    """One committed checkpoint as the pointer names it."""

    step: int
    generation: int
    path: str

    @classmethod
    def from_json(cls, d: dict) -> Pointer:
        return cls(int(d["step"]), int(d["generation"]), str(d["path"]))


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


def _write_atomically(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_history(path: str | Path) -> list[Pointer]:
    """A pointer history file (newest first), as the agent or a standalone run wrote it."""
    return [Pointer.from_json(d) for d in json.loads(Path(path).read_text())]


def remove_checkpoints(job_dir: Path, ptrs: list[Pointer]) -> None:
    """Delete checkpoints that no pointer references any more, and never anything but a
    `g*/step-*` directory of `job_dir`: a pointer is data, it must not aim rmtree elsewhere."""
    job_dir = Path(job_dir).resolve()
    for ptr in ptrs:
        d = Path(ptr.path).resolve()
        if (
            d.parent.parent == job_dir
            and d.parent.name.startswith("g")
            and d.name.startswith("step-")
        ):
            shutil.rmtree(d, ignore_errors=True)


class CheckpointStore:
    """The checkpoints of one job as written by one generation.

    `writer` names the job that owns them (its controller job id, or the spec name
    standalone); a manifest written by anyone else never verifies."""

    def __init__(
        self, root: str | Path, job: str, *, generation: int = 0, writer: str | None = None
    ):
        self.dir = Path(root) / job
        self.generation = generation
        self.writer = writer or job
        self.gen_dir = self.dir / f"g{generation:06d}"

    def step_dir(self, step: int) -> Path:
        return self.gen_dir / f"step-{step:08d}"

    def pointer(self, step: int) -> Pointer:
        return Pointer(step, self.generation, str(self.step_dir(step)))

    def commit(self, step: int, meta: dict) -> Path:
        """Write the manifest (with every file's checksum) last and atomically."""
        d = self.step_dir(step)
        files = {
            str(p.relative_to(d)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in _files(d)
        }
        manifest = {
            **meta,
            "writer": self.writer,
            "generation": self.generation,
            "step": step,
            "committed_at": time.time(),
            "files": files,
        }
        _write_atomically(d / MANIFEST, manifest)
        return d

    def verify(self, ptr: Pointer) -> Committed:
        """The checkpoint `ptr` names, if its manifest and every file match the pointer."""
        d = Path(ptr.path)
        where = f"{d.parent.name}/{d.name}"
        try:
            manifest = json.loads((d / MANIFEST).read_text())
        except FileNotFoundError:
            raise DamagedCheckpoint(
                f"{where}: no commit marker (partial or interrupted save)"
            ) from None
        except (OSError, ValueError) as e:
            raise DamagedCheckpoint(f"{where}: unreadable manifest: {e}") from None
        claims = (manifest.get("writer"), manifest.get("generation"), manifest.get("step"))
        if claims != (self.writer, ptr.generation, ptr.step):
            raise DamagedCheckpoint(
                f"{where}: manifest says job {claims[0]!r} generation {claims[1]} "
                f"step {claims[2]}, the pointer says job {self.writer!r} "
                f"generation {ptr.generation} step {ptr.step}"
            )
        for name, want in manifest.get("files", {}).items():
            p = d / name
            if not p.is_file():
                raise DamagedCheckpoint(f"{where}: missing file {name}")
            if p.stat().st_size != want["bytes"] or _sha256(p) != want["sha256"]:
                raise DamagedCheckpoint(f"{where}: checksum mismatch in {name}")
        if ".metadata" not in manifest.get("files", {}):
            raise DamagedCheckpoint(f"{where}: manifest lists no DCP .metadata")
        return Committed(ptr.step, d, manifest)

    def first_valid(self, history: list[Pointer], warn) -> Committed | None:
        """The newest entry of the pointer history that verifies; `warn(msg)` for each skipped."""
        for ptr in history:
            try:
                return self.verify(ptr)
            except DamagedCheckpoint as e:
                warn(str(e))
        return None

    # -- standalone pointer (no Redis) ----------------------------------------------------
    def history(self) -> list[Pointer]:
        try:
            return read_history(self.dir / HISTORY)
        except FileNotFoundError:
            return []

    def record(self, step: int, keep: int) -> list[Pointer]:
        """Move the standalone pointer to `step`; returns the entries that fell out of the
        newest `keep` (the caller deletes them with `remove_checkpoints`)."""
        history = [self.pointer(step)] + [p for p in self.history() if p != self.pointer(step)]
        _write_atomically(self.dir / HISTORY, [asdict(p) for p in history[:keep]])
        return history[keep:]

    def discard(self, step: int) -> None:
        """Drop this generation's uncommitted leftovers of `step` (its own space only)."""
        shutil.rmtree(self.step_dir(step), ignore_errors=True)
