"""Where a worker keeps in-memory snapshots, and what marks one complete (no torch here: the
agent prunes them, the trainer writes and reads them; docs/architecture.md, "Hot recovery").

One worker's snapshots live under its snapshot root (default `/dev/shm/meshkeeper/<wid>`:
host shared memory, so a snapshot outlives the trainer that wrote it), per job and generation:

    <root>/<jid>/g<G>/r<R>/slot-<i>.bin       rank R's whole state, a ring of `keep` slots
    <root>/<jid>/g<G>/r<R>/grads-<i>.bin      rank R's logged steps (below), a ring of their own
    <root>/<jid>/g<G>/held/r<W>/...           the copies this worker holds for rank W (its ward)

With `full_every` above 1, only every `full_every`-th snapshot is whole; the ones between
log what the optimizer step consumed (the clipped gradients, about a third of an Adam
state's bytes) and the buffers. Such a *logged step* names the snapshot before it (`prev`,
its id), and a step restores from a chain: a whole snapshot, then every logged step after
it, replayed through the optimizer (`chains`).

Each slot's `slot-<i>.json` (step, generation, tensor layout, train state) is written after
its bytes, by rename: a slot without it is incomplete and never read. A slot being rewritten
loses its manifest first, so the ring always keeps `keep - 1` complete slots.

A held copy of a ward on the same host is the ward's own file under a second name (a hard
link: no bytes copied), and a rewrite by the ward cannot remove the holder's manifest. So
each image also starts with a stamp, its manifest's random id: a rewrite zeroes it first and
writes the new id last, and a slot counts as complete only while image and manifest agree.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import orjson

STAMP_BYTES = 8  # an image's first bytes: its manifest's id
HEADER_BYTES = 64  # the stamp, padded to a cache line: the first tensor starts after it


def stamp(manifest: dict) -> bytes:
    """The bytes an image starts with when it holds what `manifest` describes."""
    return bytes.fromhex(manifest["id"])


@dataclass(frozen=True)
class SnapshotPlan:
    """What the agent hands a generation's trainers (`snapshot.json` in the run directory)."""

    dir: Path  # this worker's directory for the job: <root>/<jid>
    generation: int
    every: int  # snapshot.every_steps
    keep: int  # slots per rank (snapshot.keep)
    holders: dict[int, int]  # rank -> the rank whose worker holds its copy (empty: no copies)
    # a recovery that keeps the mesh: the generation whose snapshots it restores, and for
    # every rank the rank of this generation that has its state (itself, or its holder)
    restore_generation: int | None = None
    sources: dict[int, int] | None = None
    full_every: int = 1  # snapshot.full_every: 1, every snapshot whole

    def grads_slots(self) -> int:
        """Slots of a rank's logged-step ring: while the next step is written, the chains of
        the `keep - 1` steps before it survive, as in the ring of whole snapshots. A logged
        step s extends a chain of at most `full_every - 2` logged steps (s - base <
        full_every), all newer than any other, so it may overwrite the one before those."""
        return self.full_every + self.keep - 3

    def own_grads_slots(self) -> int:
        """Slots of a rank's own logged-step ring, two more than a held one: its slots are
        claimed a step earlier, at the step's first gradient reduced into one (before the
        snapshot of the step before may have ended), and by every step, whatever its snapshot
        becomes (worker/trainer/snapshot_grads.py). Counted in claims, the oldest logged step
        of the chains of the `keep` newest steps is at most `full_every + keep - 2` claims
        before the one being made."""
        return self.full_every + self.keep - 1

    def to_json(self) -> dict:
        return {
            "dir": str(self.dir),
            "generation": self.generation,
            "every": self.every,
            "keep": self.keep,
            "holders": _str_keys(self.holders),
            "restore_generation": self.restore_generation,
            "sources": None if self.sources is None else _str_keys(self.sources),
            "full_every": self.full_every,
        }

    @classmethod
    def from_json(cls, d: dict) -> SnapshotPlan:
        sources = d.get("sources")
        return cls(
            Path(d["dir"]),
            int(d["generation"]),
            int(d["every"]),
            int(d["keep"]),
            {int(k): int(v) for k, v in d.get("holders", {}).items()},
            d.get("restore_generation"),
            None if sources is None else {int(k): int(v) for k, v in sources.items()},
            int(d.get("full_every", 1)),
        )

    def own_dir(self, rank: int, generation: int | None = None) -> Path:
        return self.dir / f"g{self.generation if generation is None else generation}" / f"r{rank}"

    def held_dir(self, ward: int, generation: int | None = None) -> Path:
        g = self.generation if generation is None else generation
        return self.dir / f"g{g}" / "held" / f"r{ward}"

    def wards(self, rank: int) -> list[int]:
        """The ranks whose copies `rank` receives, in rank order."""
        return sorted(w for w, h in self.holders.items() if h == rank and w != rank)


def _str_keys(d: dict[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in d.items()}


@dataclass(frozen=True)
class Slot:
    """One complete snapshot on disk: its bytes and its manifest."""

    bin: Path
    manifest: dict

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def slot_paths(d: Path, i: int, prefix: str = "slot") -> tuple[Path, Path]:
    """Slot `i`'s image and manifest; `prefix` names the ring: `slot` for whole snapshots,
    `grads` for logged steps."""
    return d / f"{prefix}-{i}.bin", d / f"{prefix}-{i}.json"


def is_whole(manifest: dict) -> bool:
    return manifest.get("kind", "whole") == "whole"


def encode_manifest(manifest: dict) -> bytes:
    """A manifest's JSON (orjson: a snapshot's is ~30 KB, encoded or parsed several times
    per training step, where the standard library's codec took ~1 ms of each)."""
    return orjson.dumps(manifest, option=orjson.OPT_NON_STR_KEYS)


def write_manifest(path: Path, manifest: dict | bytes) -> bytes:
    """Atomically: the rename is what makes the slot complete. Bytes are the manifest's JSON
    already encoded (a copy received as such is written as it came); returns them."""
    raw = manifest if isinstance(manifest, bytes) else encode_manifest(manifest)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    return raw


def holds(image: Path, manifest: dict) -> bool:
    """Whether the image file `image` holds all that `manifest` describes: stamped with its
    id (no other slot, on any host, has it) and long enough. False where it cannot be read,
    or the manifest names no id and size."""
    try:
        with image.open("rb") as f:
            return (
                f.read(STAMP_BYTES) == stamp(manifest)
                and os.fstat(f.fileno()).st_size >= manifest["nbytes"]
            )
    except (OSError, KeyError, ValueError, TypeError):
        return False


def complete_slots(d: Path, generation: int) -> dict[int, Slot]:
    """step -> slot, for every complete slot of `generation` in `d` whose bytes are all there
    and still the manifest's (stamped with its id)."""
    out: dict[int, Slot] = {}
    for m in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            manifest = orjson.loads(m.read_bytes())
            b = m.with_suffix(".bin")
            # not holds(): being rewritten, or rewritten since (under another name)
            if manifest["generation"] == generation and holds(b, manifest):
                out[int(manifest["step"])] = Slot(b, manifest)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # torn by a rewrite, or not ours: not a snapshot
    return out


def chains(slots: dict[int, Slot]) -> dict[int, list[Slot]]:
    """step -> the slots that restore it, in the order they load: a whole snapshot, then each
    logged step after it whose `prev` is the slot before it in the chain. A step whose chain
    has a gap (a slot rewritten, or a copy that failed) is not restorable."""
    out: dict[int, list[Slot]] = {}
    for s in sorted(slots):
        slot = slots[s]
        if is_whole(slot.manifest):
            out[s] = [slot]
        elif s - 1 in out and out[s - 1][-1].manifest["id"] == slot.manifest.get("prev"):
            out[s] = [*out[s - 1], slot]
    return out


def discard_after(d: Path, generation: int, step: int | None) -> None:
    """Make every complete slot in `d` newer than `step` (all of them for None) incomplete, by
    removing its manifest: state taken after a failed corruption check is never restored."""
    for s, slot in complete_slots(d, generation).items():
        if step is None or s > step:
            slot.bin.with_suffix(".json").unlink(missing_ok=True)


def prune_generations(job_dir: Path, keep: set[int]) -> None:
    """Delete the job's generation directories not in `keep` (the current generation and
    the one it restores from)."""
    for g in job_dir.glob("g*") if job_dir.is_dir() else []:
        if g.name[1:].isdigit() and int(g.name[1:]) not in keep:
            shutil.rmtree(g, ignore_errors=True)


def remove_tree(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)
