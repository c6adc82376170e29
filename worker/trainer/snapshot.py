"""Per-step snapshots in host shared memory, and a copy on the buddy's host
(docs/architecture.md, "Hot recovery").

After step N (every `plan.every` steps) `take(N)` captures references to the rank's state
and hands them to one background thread, which
1. copies them into the next slot of the rank's ring in /dev/shm (a mapped file, so the
   snapshot outlives this process) and commits the slot by writing its manifest last;
2. sends the slot to the rank's holder over a gloo group of its own, and receives the
   copies of its wards into its `held/` slots (every rank does both at every snapshot, so
   the sends and receives always pair up).
The training thread waits only for step 1, and only just before the next optimizer step
would change the tensors being copied (`wait_copied`, called as the step's `before_update`).
One thread, first in first out: the copy of step N+1 starts after the send of step N, so a
slot is never rewritten while it is being sent.

A failed copy (say /dev/shm is full) is reported and training goes on: the rank sends an
empty header (worker/trainer/snapshot_wire.py), so its holder skips that copy and the
exchange stays paired.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from worker.snapshots import SnapshotPlan, slot_paths, write_manifest
from worker.trainer.snapshot_state import Captured, copy_into, layout
from worker.trainer.snapshot_wire import isend_slot, recv_manifest


def map_file(path: Path, nbytes: int) -> torch.Tensor:
    """A uint8 tensor backed by `path` (created and sized as needed), shared with the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)


@dataclass
class Copied:
    step: int
    bin: Path | None  # None: the copy failed (error says why)
    manifest: dict | None
    error: str = ""


class Ring:
    """`keep` slots in one directory, written in turn; mapped once and reused."""

    def __init__(self, d: Path, keep: int):
        self.d, self.keep, self.next = d, keep, 0
        self.maps: dict[Path, torch.Tensor] = {}

    def claim(self, nbytes: int) -> tuple[Path, Path, torch.Tensor]:
        """The next slot, its manifest removed first: it is incomplete until rewritten."""
        bin_path, man_path = slot_paths(self.d, self.next)
        self.next = (self.next + 1) % self.keep
        man_path.unlink(missing_ok=True)
        image = self.maps.get(bin_path)
        if image is None or image.numel() < nbytes:
            image = self.maps[bin_path] = map_file(bin_path, nbytes)
        return bin_path, man_path, image


class Snapshotter:
    def __init__(
        self,
        plan: SnapshotPlan,
        rank: int,
        device: torch.device,
        report: Callable[[dict], None],
    ):
        self.plan, self.rank, self.device, self.report = plan, rank, device, report
        self.holder = plan.holders.get(rank)
        self.wards = plan.wards(rank)
        # Created on every rank, in the same order as every other group (a collective call).
        self.group = dist.new_group(backend="gloo")
        self.own = Ring(plan.own_dir(rank), plan.keep)
        self.held = {w: Ring(plan.held_dir(w), plan.keep) for w in self.wards}
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self.copying: Future | None = None
        self.exchanges: list[Future] = []
        self.blocking_s = 0.0
        self._layout: tuple[tuple, list, int] | None = None
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def due(self, step: int) -> bool:
        return step % self.plan.every == 0

    def take(self, step: int, captured: Captured) -> None:
        """Snapshot the state after `step` completed steps (tensors captured just now)."""
        self.wait_copied()
        ready = None
        if self.side is not None:  # the copy must see the optimizer step's results
            ready = torch.cuda.Event()
            ready.record()
        self.copying = self.thread.submit(self._copy, step, captured, ready)
        self.exchanges.append(self.thread.submit(self._exchange, self.copying))

    def wait_copied(self) -> None:
        """Block until the in-flight copy no longer reads the live tensors."""
        if self.copying is not None and not self.copying.done():
            t0 = time.perf_counter()
            self.copying.result()
            self.blocking_s += time.perf_counter() - t0

    def poll(self) -> None:
        """Report the snapshots whose exchange finished (on the training thread: the metrics
        file has one writer)."""
        while self.exchanges and self.exchanges[0].done():
            self.report(self.exchanges.pop(0).result())

    def close(self) -> None:
        self.thread.shutdown(wait=True)
        self.poll()

    # -- the background thread --------------------------------------------------------------
    def _copy(self, step: int, captured: Captured, ready) -> Copied:
        try:
            key = tuple((k, t.dtype, tuple(t.shape)) for k, t in captured.tensors)
            if self._layout is None or self._layout[0] != key:
                self._layout = (key, *layout(captured.tensors))
            _, lay, nbytes = self._layout
            bin_path, man_path, image = self.own.claim(nbytes)
            if self.side is not None:
                with torch.cuda.stream(self.side):
                    self.side.wait_event(ready)
                    copy_into(image, captured.tensors, lay)
                self.side.synchronize()
            else:
                copy_into(image, captured.tensors, lay)
            manifest = {
                "step": step,
                "generation": self.plan.generation,
                "rank": self.rank,
                "nbytes": nbytes,
                "tensors": lay,
                "state": captured.state,
            }
            write_manifest(man_path, manifest)
            return Copied(step, bin_path, manifest)
        except (OSError, RuntimeError) as e:
            return Copied(step, None, None, f"{type(e).__name__}: {e}")

    def _exchange(self, copying: Future) -> dict:
        """Send this rank's slot to its holder; receive each ward's into held/."""
        copied: Copied = copying.result()
        sends = (
            isend_slot(copied.manifest, self.own.maps.get(copied.bin), self.holder, self.group)
            if self.holder is not None
            else []
        )
        held, errors = {}, [copied.error] if copied.error else []
        for w in self.wards:
            try:
                got = self._receive(w)
                if got is not None:
                    held[str(w)] = got
            except (OSError, ValueError) as e:
                errors.append(f"copy of rank {w}: {type(e).__name__}: {e}")
        for s in sends:
            s.wait()
        line = {"event": "snapshot", "step": copied.step, "ok": copied.bin is not None}
        if self.wards:
            line["held"] = held
        if errors:
            line["error"] = "; ".join(errors)[:500]
        return line

    def _recv(self, t: torch.Tensor, src: int) -> None:
        dist.recv(t, src, group=self.group)

    def _receive(self, ward: int) -> int | None:
        """One ward's copy into its next held slot; its step, or None when it sent none."""
        got = recv_manifest(ward, self.group)
        if got is None:
            return None
        manifest, nbytes = got
        try:
            _, man_path, image = self.held[ward].claim(nbytes)
        except (OSError, RuntimeError):
            self._recv(torch.empty(nbytes, dtype=torch.uint8), ward)  # keep the stream paired
            raise
        self._recv(image[:nbytes], ward)
        if manifest.get("generation") != self.plan.generation or manifest.get("rank") != ward:
            raise ValueError(f"rank {ward} sent a snapshot of another world: {manifest}"[:300])
        write_manifest(man_path, manifest)
        return int(manifest["step"])
