"""The on-disk side of checkpoints: layout, commit marker, verification, the pointer history.

    {root}/{job}/g{G:06d}/step-{N:08d}/                 DCP shards + .metadata of generation G
    {root}/{job}/g{G:06d}/step-{N:08d}/.digests/rank-{R:05d}.json   rank R's digests of its files
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

Integrity that scales with the checkpoint (docs/architecture.md, "Generation and fencing"):
each rank hashes only the files it wrote, on a thread of its own, and leaves its digests in
`.digests/`; rank 0 gathers them from the filesystem into the manifest, so no rank waits in a
collective while another hashes. A restore splits the manifest's files over the ranks by size
(`share`) and each hashes its part on a thread pool.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST = "manifest.json"
HISTORY = "committed.json"
DIGESTS = ".digests"  # each rank's digests of its own files, gathered into the manifest
# Waits on other ranks' hashing are sized for a slow disk and hash (the reference machine
# hashes sha256 at ~200 MB/s per thread), never the 60 s of a collective: 100 GB -> ~67 min.
HASH_FLOOR_BYTES_PER_S = 25e6
HASH_THREADS = 8


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
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)  # releases the GIL: a thread pool hashes files in parallel
    return h.hexdigest()


def digest(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _files(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST and p.relative_to(directory).parts[0] != DIGESTS
    )


def hash_timeout_s(directory: Path) -> float:
    """How long to wait for others to hash `directory`'s files (see HASH_FLOOR_BYTES_PER_S)."""
    size = sum(p.stat().st_size for p in _files(directory)) if directory.is_dir() else 0
    return 60.0 + size / HASH_FLOOR_BYTES_PER_S


def write_digests(step_dir: Path, rank: int, names: list[str]) -> None:
    """Hash the files `rank` wrote into `step_dir` and leave the digests there for rank 0's
    commit; a file it cannot read is reported as the rank's error, so the commit fails at
    once instead of waiting for digests that never come."""
    try:
        payload: dict = {"files": {n: digest(step_dir / n) for n in names}}
    except OSError as e:
        payload = {"error": f"rank {rank} could not hash its files: {e}"}
    (step_dir / DIGESTS).mkdir(exist_ok=True)
    _write_atomically(step_dir / DIGESTS / f"rank-{rank:05d}.json", payload)


def gather_digests(step_dir: Path, ranks: int) -> dict:
    """Every rank's digests of `step_dir` (name -> size and sha256), waiting for those still
    hashing; DamagedCheckpoint if one reported an error or none came in time."""
    paths = [step_dir / DIGESTS / f"rank-{r:05d}.json" for r in range(ranks)]
    deadline = time.monotonic() + hash_timeout_s(step_dir)
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise DamagedCheckpoint(f"{step_dir.name}: no digests from {', '.join(missing)}")
        time.sleep(0.02)
    files: dict = {}
    for p in paths:
        got = json.loads(p.read_text())
        if "error" in got:
            raise DamagedCheckpoint(f"{step_dir.name}: {got['error']}")
        files.update(got["files"])
    return files


def share(files: dict, rank: int, world: int) -> list[str]:
    """The names of `files` (a manifest's) that `rank` of `world` verifies: the largest first,
    each to the least-loaded rank, the same split on every rank."""
    load = [0] * world
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += files[name]["bytes"]
        if r == rank:
            mine.append(name)
    return mine


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


def check_files(ckpt: Committed, names: list[str]) -> None:
    """DamagedCheckpoint unless each of `names` matches its manifest entry (hashed on a
    thread pool); the first bad one in name order is reported."""
    where = f"{ckpt.path.parent.name}/{ckpt.path.name}"
    want = ckpt.manifest["files"]

    def problem(name: str) -> str | None:
        p = ckpt.path / name
        if not p.is_file():
            return f"missing file {name}"
        if p.stat().st_size != want[name]["bytes"] or _sha256(p) != want[name]["sha256"]:
            return f"checksum mismatch in {name}"
        return None

    names = sorted(names)
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, len(names)))) as pool:
        found = [x for x in pool.map(problem, names) if x]
    if found:
        raise DamagedCheckpoint(f"{where}: {found[0]}")


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

    def commit(self, step: int, meta: dict, ranks: int) -> Path:
        """Write the manifest last and atomically, with every file's digest: those the
        `ranks` ranks left in `.digests/` (waiting for ranks still hashing) and `.metadata`,
        which DCP's coordinator (rank 0, the caller) wrote last. A file no rank vouches for
        fails the commit: the manifest must cover everything a restore may read."""
        d = self.step_dir(step)
        files = gather_digests(d, ranks)
        files[".metadata"] = digest(d / ".metadata")
        unvouched = [str(p.relative_to(d)) for p in _files(d) if str(p.relative_to(d)) not in files]
        if unvouched:
            raise DamagedCheckpoint(f"{d.name}: no rank hashed {unvouched[0]}")
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

    def read_manifest(self, ptr: Pointer) -> Committed:
        """The checkpoint `ptr` names, if its manifest matches the pointer (files unchecked)."""
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
        if ".metadata" not in manifest.get("files", {}):
            raise DamagedCheckpoint(f"{where}: manifest lists no DCP .metadata")
        return Committed(ptr.step, d, manifest)

    def verify(self, ptr: Pointer) -> Committed:
        """The checkpoint `ptr` names, if its manifest and every file match the pointer."""
        ckpt = self.read_manifest(ptr)
        check_files(ckpt, list(ckpt.manifest["files"]))
        return ckpt

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
