"""Per-step snapshots in host shared memory, and a copy on the buddy's host
(docs/architecture.md, "Hot recovery").

After step N (every `plan.every` steps) `take(N)` captures references to the rank's state
and hands them to one background thread, which
1. copies them into the next slot of the rank's ring in /dev/shm (a mapped file, so the
   snapshot outlives this process) and commits the slot by writing its manifest last. With
   `plan.full_every` above 1 (and a snapshot every step) most snapshots are *logged steps*
   (worker/snapshots.py): the gradients step N's optimizer step consumed, kept by
   `before_update` just before it, and the buffers, a third of the bytes of the whole state,
   written to a ring of their own, in the slot `before_update` sealed for step N. Under FSDP
   the gradients were reduced into that slot already (worker/trainer/snapshot_grads.py), and
   only what lies elsewhere is copied. The whole state is written every `full_every` snapshots,
   and whenever the chain before N has a gap (the first snapshot, a failed copy, a checked
   snapshot: a rollback loads that one alone);
2. offers the slot to the rank's holder over a gloo group of the two alone (`buddy_links`),
   and takes its wards' slots into its `held/` ring (every rank does both at every
   snapshot, so the messages always pair up; worker/trainer/snapshot_wire.py). A ward in
   the same host memory is held by a hard link to its file, which the ward makes itself
   (`_meet` finds such pairs once): no bytes move, only the step linked, and the copy still
   outlives the ward's directory. Only a ward on another host sends its bytes over the
   network, and it streams them: the offer goes out when the slot is claimed, before step 1
   copies a byte, and each chunk leaves as soon as step 1 has written it, so the copy and
   the network overlap instead of adding up.
The training thread waits for both steps, and only just before the next optimizer step would
change the tensors being copied (`wait_held`, called as the step's `before_update`): a rank
never updates past a step whose copy its holder lacks.
One thread, first in first out: the copy of step N+1 starts after the exchange of step N,
which ends only once the holder has its copy (its answer comes after its link), so a slot is
never rewritten while it is being read. A rewrite zeroes the slot's stamp first
(worker/snapshots.py): the holder's linked copy of the old step stops counting as complete.

A failed copy (say /dev/shm is full) is reported and training goes on: the rank offers
nothing, so its holder skips that copy and the exchange stays paired. A failed exchange (a
buddy died) ends snapshots for this trainer: the ring then keeps the step whose copies the
recovery restores.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.cuda._pin_memory_utils import pin_memory, unpin_memory
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from worker.shm_headroom import check_room, headroom_for
from worker.snapshots import (
    HEADER_BYTES,
    SnapshotPlan,
    discard_after,
    encode_manifest,
    holds,
    is_whole,
    slot_paths,
    stamp,
    write_manifest,
)
from worker.trainer.snapshot_grads import GradSlot, GradSlots, reduce_into
from worker.trainer.snapshot_state import (
    Captured,
    capture,
    capture_step,
    copy_into,
    copyable_bytes,
    destinations,
    grad_refs,
    in_slot,
    layout,
    write_stamp,
)
from worker.trainer.snapshot_wire import (
    SEND_CHUNK_BYTES,
    ImageReceipt,
    ImageStream,
    isend_answer,
    isend_held,
    isend_offer,
    recv_answer,
    recv_held,
    recv_offer,
)


def _yield_to_training() -> None:
    """Run the calling thread on CPU time the training thread leaves over (Linux SCHED_IDLE):
    a rank's idle moments, waiting in a collective or on its GPU. Where every core is busy,
    the copy would otherwise preempt the step, and the other ranks wait for that one in their
    next collective. A copy still running at the next optimizer step holds that step up
    (`wait_held`), which leaves it the CPU: snapshots never fall behind."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed here: the thread keeps the default policy


def map_file(path: Path, nbytes: int) -> torch.Tensor:
    """A uint8 tensor backed by `path` (created and sized as needed), shared with the file.
    Sized, not filled: the file is sparse until `allocate`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)


def host_locked(image: torch.Tensor) -> bool:
    """Page-lock a mapped slot for CUDA (cudaHostRegister, as torch's own DCP stager does for
    its shared memory); False where the driver refuses (a memlock limit, say): the copy then
    goes through pageable memory, slower but the same bytes."""
    try:
        pin_memory(image.data_ptr(), image.numel())
    except RuntimeError:
        return False
    return True


def host_unlocked(image: torch.Tensor) -> None:
    unpin_memory(image.data_ptr())


def allocate(path: Path, start: int, end: int, headroom: int = 0) -> None:
    """Give bytes [start, end) of `path` their memory now. A write to a sparse page of a
    mapped file that /dev/shm has no room for is a SIGBUS, which kills the trainer; this is
    an OSError (ENOSPC) instead, which fails one snapshot and training goes on. `headroom`:
    bytes that must stay free after it (NCCL's, worker/shm_headroom.py)."""
    check_room(path, end - start, headroom)
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, start, end - start)
    finally:
        os.close(fd)


@dataclass
class Copied:
    step: int
    bin: Path | None  # None: the copy failed (error says why)
    manifest: dict | None
    raw: bytes | None = None  # the manifest's JSON
    image: torch.Tensor | None = None  # the slot's mapped file
    error: str = ""
    copied: int = 0  # bytes the copy moved; the rest of the slot was reduced into it


@dataclass
class Claimed:
    """A slot claimed for one snapshot: its manifest known (the offer can go out), its bytes
    not yet copied."""

    ring: Ring
    index: int
    bin: Path
    manifest_path: Path
    image: torch.Tensor
    manifest: dict
    rest: list[tuple[str, torch.Tensor]]  # what the copy writes (the rest is in the slot)
    dst: list[torch.Tensor]  # where each goes
    ends: list[int]  # where each ends in the image
    base: int  # the step of the whole snapshot its chain starts from


def batches(ends: list[int], chunk: int | None) -> list[tuple[int, int, int]]:
    """(first, past the last, the byte it ends at) of each run of tensors copied in one call:
    all of them for `chunk` None; otherwise a run ends at the first tensor that reaches the
    end of a streamed chunk (snapshot_wire.chunks), so that chunk can leave before the next
    run's copy."""
    if chunk is None:
        return [(0, len(ends), ends[-1])] if ends else []
    out, first, bound = [], 0, HEADER_BYTES + chunk
    for i, end in enumerate(ends):
        if end >= bound or i == len(ends) - 1:
            out.append((first, i + 1, end))
            first = i + 1
            while bound <= end:
                bound += chunk
    return out


class Ring:
    """`keep` slots in one directory, named `prefix-<i>` (whole snapshots: `slot`, logged
    steps: `grads`), written in turn; mapped once and reused. With `pin`, one slot more: the
    newest snapshot taken right after a passed corruption check stays out of the turn until a
    newer checked one lands, so a rollback always finds a clean state (worker/trainer/sdc.py)."""

    def __init__(
        self,
        d: Path,
        keep: int,
        pin: bool = False,
        prefix: str = "slot",
        page_lock: bool = False,
        headroom: int = 0,
    ):
        self.d, self.size, self.next, self.prefix = d, keep + int(pin), 0, prefix
        self.headroom = headroom  # bytes its file system keeps free (shm_headroom.py)
        self.maps: dict[Path, torch.Tensor] = {}
        # `page_lock` (a GPU rank's own whole snapshots): each slot's mapping is registered
        # with CUDA once it has all its memory (`host_locked`), so the copy engines write it
        # directly instead of through the driver's small pinned staging buffers
        self.page_lock = page_lock
        self.locked: set[Path] = set()
        self.views: dict[Path, tuple[list, torch.Tensor, list[torch.Tensor]]] = {}
        self.reserved: dict[Path, int] = {}  # bytes from each file's start given memory
        self.pin, self.pinned = pin, None  # pinned: (slot index, manifest)
        self.linked: set[int] = set()  # slots whose file is a ward's own, linked here

    def _turn(self) -> tuple[int, Path, Path]:
        """The next slot's index and paths, its manifest removed: incomplete until rewritten."""
        if self.pinned is not None and self.next == self.pinned[0]:
            self.next = (self.next + 1) % self.size
        i = self.next
        bin_path, man_path = slot_paths(self.d, i, self.prefix)
        self.next = (i + 1) % self.size
        man_path.unlink(missing_ok=True)
        return i, bin_path, man_path

    def _forget(self, bin_path: Path) -> None:
        if bin_path in self.locked:  # before the mapping goes: CUDA must not keep its pages
            self.locked.discard(bin_path)
            host_unlocked(self.maps[bin_path])
        self.maps.pop(bin_path, None)
        self.views.pop(bin_path, None)
        self.reserved.pop(bin_path, None)

    def claim(self, nbytes: int, used: int | None = None) -> tuple[int, Path, Path, torch.Tensor]:
        """The next slot to write, of `nbytes`, its stamp zeroed before any byte changes, and
        its first `used` bytes (all of them for None) given memory (`reserve`; raises OSError
        where /dev/shm has no room): where a writer knows only later how far it writes, it
        reserves the rest as it goes (`reserve`). A slot that held a link to a ward's file
        gets a file of its own first: a ring writes only its own."""
        i, bin_path, man_path = self._turn()
        if i in self.linked:
            self.linked.discard(i)
            bin_path.unlink(missing_ok=True)
            self._forget(bin_path)
        image = self.maps.get(bin_path)
        if image is None or image.numel() < nbytes:
            self._forget(bin_path)
            image = self.maps[bin_path] = map_file(bin_path, nbytes)
        self.reserve(bin_path, nbytes if used is None else used)
        # only a slot whose every page has memory: locking touches them all, and an unreserved
        # page of a full /dev/shm would be a SIGBUS
        if self.page_lock and used is None and bin_path not in self.locked:
            if host_locked(image):
                self.locked.add(bin_path)
        write_stamp(image, None)
        return i, bin_path, man_path, image

    def reserve(self, bin_path: Path, end: int) -> None:
        """Give the slot file's first `end` bytes memory, where they have none yet."""
        done = self.reserved.get(bin_path, 0)
        if end > done:
            allocate(bin_path, done, end, self.headroom)
            self.reserved[bin_path] = end

    def link(self, src: Path, manifest: dict, raw: bytes) -> None:
        """Commit a ward's complete slot file `src`, on this host, as the next slot: a second
        name for the same bytes, which outlives the ward's own name. Raises OSError where no
        link can be made (another file system): the caller copies instead."""
        tmp = self.d / f"{self.prefix}-link.tmp"
        self.d.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        os.link(src, tmp)  # first, so a failure leaves the ring as it was
        i, bin_path, man_path = self._turn()
        if bin_path.exists() and os.path.samefile(bin_path, tmp):
            tmp.unlink()
        else:
            os.replace(tmp, bin_path)
            self._forget(bin_path)  # a file this ring wrote before is freed once unmapped
        self.linked.add(i)
        self.commit(i, man_path, manifest, raw)

    def destinations(self, bin_path: Path, lay: list) -> list[torch.Tensor]:
        """The slot's tensor views for layout `lay`, made once per slot, mapping and layout."""
        image = self.maps[bin_path]
        got = self.views.get(bin_path)
        if got is None or got[0] is not lay or got[1] is not image:
            got = self.views[bin_path] = (lay, image, destinations(image, lay))
        return got[2]

    def commit(self, i: int, man_path: Path, manifest: dict, raw: bytes | None = None) -> bytes:
        """Complete slot `i`; `raw`: the manifest's JSON when already encoded. Returns it."""
        raw = write_manifest(man_path, manifest if raw is None else raw)
        if self.pin and manifest.get("checked"):
            self.pinned = (i, manifest)
        return raw

    def checked(self) -> tuple[dict, torch.Tensor] | None:
        """The pinned slot's manifest and image."""
        if self.pinned is None:
            return None
        i, manifest = self.pinned
        return manifest, self.maps[slot_paths(self.d, i, self.prefix)[0]]


class Rings:
    """One rank's slots in one directory: a ring of whole snapshots and, with
    `plan.full_every` above 1, a ring of logged steps (worker/snapshots.py) of `grads_slots`."""

    def __init__(
        self,
        d: Path,
        plan: SnapshotPlan,
        pin: bool,
        grads_slots: int,
        page_lock: bool = False,
        headroom: int = 0,
    ):
        self.whole = Ring(d, plan.keep, pin, page_lock=page_lock, headroom=headroom)
        self.grads = (
            Ring(d, grads_slots, prefix="grads", headroom=headroom) if plan.full_every > 1 else None
        )

    def of(self, manifest: dict) -> Ring:
        """The ring a slot with `manifest` goes into."""
        if is_whole(manifest):
            return self.whole
        if self.grads is None:
            raise ValueError("a logged step offered to a holder whose plan logs none")
        return self.grads


@dataclass(frozen=True)
class Tail:
    """This rank's newest committed slot: the next snapshot may log only its step on it."""

    step: int
    id: str
    base: int  # the step of the whole snapshot its chain starts from


def buddy_links(
    holders: dict[int, int], rank: int, timeout_s: float
) -> dict[int, dist.ProcessGroup]:
    """One gloo group per pair of a rank and its holder, for the pairs this rank is in, by the
    peer's rank: the snapshots' connections grow with the world, not with its square as one
    world-sized group's full mesh does (issue 48). Every rank makes every pair's group, in one
    order (a collective call: torch names a group by how many came before it, so
    `use_local_synchronization`, whose hashed names count this process's groups, would name a
    pair differently on its two ranks); only its two members connect, so no two ranks wait
    on each other's next pair and a cycle of waits cannot form."""
    pairs = sorted({(min(r, h), max(r, h)) for r, h in holders.items() if r != h})
    links = {}
    for a, b in pairs:
        group = dist.new_group([a, b], backend="gloo", timeout=timedelta(seconds=timeout_s))
        if rank in (a, b):
            links[b if rank == a else a] = group
    return links


class Snapshotter:
    def __init__(
        self,
        plan: SnapshotPlan,
        rank: int,
        device: torch.device,
        report: Callable[[dict], None],
        parts: list[nn.Module],
        pin_checked: bool = False,
        timeout_s: float = 1800.0,
        chunk_bytes: int = SEND_CHUNK_BYTES,
    ):
        """`parts`: the model parts whose state `take` will be handed (with logged steps,
        their FSDP groups reduce gradients into the logged-step slots); `pin_checked`: keep
        the newest snapshot taken after a passed corruption check; `timeout_s`: the buddy
        groups' collective timeout; `chunk_bytes`: the unit a buddy copy streams in (the
        same on every rank)."""
        self.plan, self.rank, self.device, self.report = plan, rank, device, report
        self.holder = plan.holders.get(rank)
        self.wards = plan.wards(rank)
        self.links = buddy_links(plan.holders, rank, timeout_s)
        headroom = headroom_for(plan.own_dir(rank), device.type == "cuda")
        self.own = Rings(
            plan.own_dir(rank),
            plan,
            pin_checked,
            plan.own_grads_slots(),
            page_lock=device.type == "cuda",
            headroom=headroom,
        )
        # A ring of held/ has one writer: this rank for the wards on other hosts, and for its
        # own copy where its holder shares its host memory (`_pair_up`).
        holders_dir, self.wards_here = self._meet()
        self.holder_here = holders_dir is not None
        grads_slots = plan.grads_slots()
        self.held = {
            w: Rings(plan.held_dir(w), plan, pin_checked, grads_slots, headroom=headroom)
            for w in self.wards
            if w not in self.wards_here
        }
        if holders_dir is not None:
            self.held[rank] = Rings(holders_dir, plan, pin_checked, grads_slots, headroom=headroom)
        self.thread = ThreadPoolExecutor(
            1, thread_name_prefix="snapshot", initializer=_yield_to_training
        )
        self.copying: tuple[Future, Future] | None = None  # (its copy, its exchange)
        self.chunk = chunk_bytes
        self.exchanges: list[Future] = []
        # Seconds the training thread spent on each snapshot (by step: taking it, then waiting
        # for its exchange), until its line reports them as `blocking_s` (the goodput ledger's
        # snapshot cost). Its wait comes before its line: the line is reported once the
        # exchange is done, and a done exchange is never waited on.
        self.blocked: dict[int, float] = {}
        self.newest: int | None = None  # the step of the newest snapshot taken
        self.peer_maps: dict[Path, torch.Tensor] = {}
        self._layouts: dict[bool, tuple[tuple, list, int]] = {}  # whole or not -> `_layout`
        self.tail: Tail | None = None  # set by the copy thread, read once its copy is awaited
        # (step, `grad_refs`, the step's logged-step slot or why it has none)
        self.grads: tuple[int, list, GradSlot | str] | None = None
        self.logs = plan.full_every > 1 and plan.every == 1
        self.slots: GradSlots | None = None
        if self.logs:
            self.slots = GradSlots(self.own.grads, copyable_bytes(parts))
            reduce_into(parts, self.slots)
        self.broken = ""  # why an exchange failed: its holder or a ward is gone
        # The works of the exchange in progress, and of every one that failed midway: gloo may
        # still read or write their tensors (a receive posted into a flag), so they live as
        # long as this snapshotter, never freed under a pending operation.
        self.in_flight: list[list] = []
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _to(self, peer: int) -> dist.ProcessGroup:
        """The gloo group this rank shares with `peer` alone (its holder or a ward)."""
        return self.links[peer]

    def _meet(self) -> tuple[Path | None, set[int]]:
        """Where this rank's holder keeps its copies, if the holder shares its host memory,
        and which of its wards do: each rank offers its holder a file stamped with a random
        id, which only a process in the same memory can read back, and such a holder answers
        with its `held/` directory for that ward (a collective call, once). Such a pair sends
        no offers, answers or images at its snapshots (`_pair_up`)."""
        probe = {"id": secrets.token_hex(8), "nbytes": 8}
        path = self.plan.own_dir(self.rank) / "host.probe"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(stamp(probe))
        sends = []
        if self.holder is not None:
            sends = isend_offer(encode_manifest(probe), 0, path, self.holder, self._to(self.holder))
        here = set()
        for w in self.wards:
            offer = recv_offer(w, self._to(w))
            if offer is not None and holds(offer.path, offer.manifest):
                here.add(w)
                d = self.plan.held_dir(w)
                sends += isend_offer(encode_manifest({}), 0, d, w, self._to(w))
            else:
                sends += isend_offer(None, 0, None, w, self._to(w))
        held_dir = None
        if self.holder is not None and (answer := recv_offer(self.holder, self._to(self.holder))):
            held_dir = answer.path
        for s in sends:
            s.wait()
        mine = self.plan.held_dir(self.rank)
        if held_dir is not None and held_dir.parts[-3:] != mine.parts[-3:]:
            # what a ring writes there is this rank's own state, but only under such a name
            raise ValueError(
                f"rank {self.holder} named {held_dir} for rank {self.rank}'s copies: a held "
                f"directory ends in {'/'.join(mine.parts[-3:])}"
            )
        return held_dir, here

    def due(self, step: int) -> bool:
        return step % self.plan.every == 0

    def before_update(self, step: int, optimizers: list[Optimizer]) -> None:
        """Just before the optimizer step that completes `step`: wait for the newest
        snapshot's exchange (`wait_held`), and keep the gradients that step consumes, and the
        logged-step slot they may have been reduced into (sealed: the next step's go into the
        next), for a logged step. Kept only until that snapshot's copy: on a GPU they cost
        device memory of their size during the next step's forward."""
        self.wait_held()
        if self.slots is not None:
            self.grads = (step, grad_refs(optimizers), self.slots.seal())

    def take(
        self,
        step: int,
        parts: list[nn.Module],
        optimizers: list[Optimizer],
        schedulers: list[LRScheduler],
        train_state: dict,
        checked: bool = False,
    ) -> None:
        """Snapshot the state after `step` completed steps; `checked`: the corruption check
        at this step passed. A logged step where the chain allows one, else the whole state."""
        started = time.perf_counter()
        self.wait_copied()
        grads, self.grads = self.grads, None
        tail = self.tail  # the copy just awaited set it
        logged = (
            not checked  # a rollback restores the checked state alone, from its pinned slot
            and grads is not None
            and grads[0] == step
            and tail is not None
            and tail.step == step - 1
            and step - tail.base < self.plan.full_every
        )
        if logged:
            captured = capture_step(parts, optimizers, schedulers, train_state, grads[1])
        else:
            captured = capture(parts, optimizers, schedulers, train_state)
        ready = None
        if self.side is not None:  # the copy must see the optimizer step's results
            ready = torch.cuda.Event()
            ready.record()
        prev = tail if logged else None
        slot = grads[2] if logged else None
        copying: Future = Future()  # resolved by the exchange once its copy is done
        snapshot = (step, captured, ready, checked, prev, slot)
        self.exchanges.append(self.thread.submit(self._exchange, copying, *snapshot))
        self.copying = (copying, self.exchanges[-1])
        self.newest = step
        self.blocked[step] = self.blocked.get(step, 0.0) + time.perf_counter() - started

    def wait_copied(self) -> None:
        """Block until the in-flight copy no longer reads the live tensors (or its exchange
        ended without it: cancelled by `abandon`)."""
        if self.copying is not None:
            wait(self.copying, return_when=FIRST_COMPLETED)

    def wait_held(self) -> None:
        """Block until the newest snapshot's exchange ended: its holder has its copy, or a peer
        is gone. Called before each optimizer step, so no rank updates past a step whose copy
        its holder lacks, and a kill redoes at most one step (the exchange otherwise lags the
        training at SCHED_IDLE, and a kill then found only older held copies)."""
        newest = self.exchanges[-1:]
        if newest and not newest[0].done():  # not reported yet: its line will carry the wait
            started = time.perf_counter()
            wait(newest)
            self.blocked[self.newest] += time.perf_counter() - started

    def poll(self) -> None:
        """Report the snapshots whose exchange finished (on the training thread: the metrics
        file has one writer)."""
        while self.exchanges and self.exchanges[0].done():
            line = self.exchanges.pop(0).result()
            self.report({**line, "blocking_s": self.blocked.pop(line["step"], 0.0)})

    def close(self) -> None:
        self.thread.shutdown(wait=True)
        self.poll()

    def abandon(self) -> None:
        """A failed generation's end in a process that goes on (handoff.py): the copy or
        exchange in flight ends (its collectives fail once the connections are shut), none
        queued starts, and nothing is reported."""
        self.thread.shutdown(wait=True, cancel_futures=True)

    def checked_slot(self) -> tuple[dict, torch.Tensor] | None:
        """This rank's newest checked snapshot (manifest, image), once no copy is running."""
        self.wait_copied()
        return self.own.whole.checked()

    def discard_after(self, step: int | None) -> None:
        """After `close`: drop this generation's own and held snapshots newer than `step` (all
        of them for None), so a recovery's restore agreement finds only checked state."""
        for d in [self.plan.own_dir(self.rank), *(self.plan.held_dir(w) for w in self.wards)]:
            discard_after(d, self.plan.generation, step)

    # -- the background thread --------------------------------------------------------------
    def _claim(
        self,
        step: int,
        captured: Captured,
        checked: bool,
        prev: Tail | None,
        slot: GradSlot | str | None,
    ) -> Claimed | Copied:
        """The slot this snapshot goes into, with its manifest, before any byte is copied: a
        logged step on `prev` into the step's `slot` (claimed by `GradSlots`; a string: why
        there is none), or (None) the whole state into the next slot of the whole ring. A
        Copied with its error where there is none."""
        self.tail = None  # until this slot is committed, nothing may log on it
        if self.broken:
            # A buddy is gone, so the job is about to recover, from the newest step whose
            # copies all arrived: writing this one would turn the ring past that step's slot.
            return Copied(step, None, None, error=f"not taken: an exchange failed ({self.broken})")
        if isinstance(slot, str):
            return Copied(step, None, None, error=f"no slot for the logged step: {slot}")
        try:
            whole = prev is None
            if whole:
                ring, rest = self.own.whole, captured.tensors
                lay, nbytes = self._layout(whole, rest, HEADER_BYTES)
                i, bin_path, man_path, image = ring.claim(nbytes)
                rest_lay = lay
            else:
                ring, i, bin_path = self.own.grads, slot.index, slot.bin
                man_path, image = slot.manifest_path, slot.image
                there, rest = in_slot(captured.tensors, image, slot.used)
                rest_lay, nbytes = self._layout(whole, rest, slot.used)
                if nbytes > image.numel():
                    raise RuntimeError(f"a logged step of {nbytes} bytes outgrew its slot")
                ring.reserve(bin_path, nbytes)
                lay = there + rest_lay
        except (OSError, RuntimeError) as e:
            return Copied(step, None, None, error=f"{type(e).__name__}: {e}")
        manifest = {
            "id": secrets.token_hex(8),  # tells this slot from any other (snapshot_wire)
            "step": step,
            "generation": self.plan.generation,
            "rank": self.rank,
            "nbytes": nbytes,
            "tensors": lay,
            "state": captured.state,
            "checked": checked,
            "kind": "whole" if whole else "grads",
        }
        if not whole:
            manifest["prev"] = prev.id  # worker/snapshots.py `chains`
        dst = ring.destinations(bin_path, rest_lay)
        ends = [off + n for *_, off, n in rest_lay]
        base = step if whole else prev.base
        return Claimed(ring, i, bin_path, man_path, image, manifest, rest, dst, ends, base)

    def _fill(self, c: Claimed, ready, stream: ImageStream | None) -> Copied:
        """Copy the claimed slot's tensors and commit it; with `stream`, each chunk leaves
        for the holder as soon as it is written (worker/trainer/snapshot_wire.py)."""
        step = c.manifest["step"]
        try:
            for lo, hi, end in batches(c.ends, self.chunk if stream else None):
                if self.side is not None:
                    with torch.cuda.stream(self.side):
                        self.side.wait_event(ready)
                        copy_into(c.dst[lo:hi], c.rest[lo:hi])
                    self.side.synchronize()
                else:
                    copy_into(c.dst[lo:hi], c.rest[lo:hi])
                if stream:
                    stream.upto(end)
            write_stamp(c.image, c.manifest)  # the bytes are the manifest's from here on
            raw = c.ring.commit(c.index, c.manifest_path, c.manifest)
        except (OSError, RuntimeError) as e:
            return Copied(step, None, None, error=f"{type(e).__name__}: {e}")
        self.tail = Tail(step, c.manifest["id"], c.base)
        copied = sum(t.nbytes for _, t in c.rest)
        return Copied(step, c.bin, c.manifest, raw, c.image, copied=copied)

    def _layout(self, whole: bool, tensors: list, start: int) -> tuple[list, int]:
        """`layout` of the tensors a whole snapshot or a logged step copies, made again only
        when their shapes or start change: its Python costs about as much as copying a small
        model's bytes."""
        key = (start, tuple((k, t.dtype, tuple(t.shape)) for k, t in tensors))
        known = self._layouts.get(whole)
        if known is None or known[0] != key:
            known = self._layouts[whole] = (key, *layout(tensors, start))
        return known[1], known[2]

    def _exchange(self, copying: Future, *snapshot) -> dict:
        """Take one snapshot (`_pair_up`), resolving `copying` once its copy is done. A
        failure of a buddy group (a peer died) stops all further snapshots (`_claim`)."""
        try:
            return self._pair_up(copying, *snapshot)
        except RuntimeError as e:  # gloo's errors (DistBackendError is one)
            self.broken = f"{type(e).__name__}: {e}"[:300]
            raise
        finally:
            if not copying.done():
                failed = self.broken or "the exchange failed before the copy"
                copying.set_result(Copied(snapshot[0], None, None, error=failed))

    def _pair_up(
        self,
        copying: Future,
        step: int,
        captured: Captured,
        ready,
        checked: bool,
        prev: Tail | None,
        slot: GradSlot | str | None,
    ) -> dict:
        """Copy this rank's slot, hand it to its holder, and take each ward's into held/, in
        phases every rank runs alike (worker/trainer/snapshot_wire.py): the offers and answers
        first, which wait on no copy, so no cycle of buddies can deadlock; then this rank's
        copy, streamed to a holder on another host as it is written; then what the wards
        send."""
        got = self._claim(step, captured, checked, prev, slot)
        claimed = got if isinstance(got, Claimed) else None
        remote = self.holder is not None and not self.holder_here
        sends: list = []
        self.in_flight.append(sends)
        if remote:
            group = self._to(self.holder)
            if claimed is None:
                sends += isend_offer(None, 0, None, self.holder, group)
            else:
                raw, nbytes = encode_manifest(claimed.manifest), claimed.manifest["nbytes"]
                sends += isend_offer(raw, nbytes, claimed.bin, self.holder, group)
        held, via, errors = {}, {}, []
        incoming = []  # (ward, offer, held slot): bytes that come over the network
        for w in self.wards:
            if w in self.wards_here:  # linked by the ward itself, after its copy
                continue
            offer = recv_offer(w, self._to(w))
            if offer is None:
                continue
            need = False
            try:
                m = offer.manifest
                if m.get("generation") != self.plan.generation or m.get("rank") != w:
                    raise ValueError(f"rank {w} offered a snapshot of another world: {m}"[:300])
                ring = self.held[w].of(m)
                i, _, man_path, image = ring.claim(offer.nbytes)
                need = True
            except (OSError, RuntimeError, ValueError) as e:
                errors.append(f"copy of rank {w}: {type(e).__name__}: {e}")
            sends += isend_answer(need, w, self._to(w))
            if need:
                incoming.append((w, ring, offer, i, man_path, image))
        stream = None
        if claimed is not None and remote and recv_answer(self.holder, self._to(self.holder)):
            nbytes = claimed.manifest["nbytes"]
            group = self._to(self.holder)
            stream = ImageStream(claimed.image, nbytes, self.holder, group, self.chunk)
        # after the holder's answer: a pair's messages match their receives in order
        receipts = [
            ImageReceipt(image, offer.nbytes, w, self._to(w), self.chunk)
            for w, _, offer, _, _, image in incoming
        ]
        self.in_flight.append(receipts)
        copied = self._fill(claimed, ready, stream) if claimed is not None else got
        copying.set_result(copied)
        errors += [copied.error] if copied.error else []
        if stream is not None:
            sends += stream.end(copied.bin is not None)
        if self.holder_here:  # link it into the holder's ring here, and say which step
            linked = None
            if copied.bin is not None:
                try:
                    self._hold_local(self.rank, copied.bin, copied.manifest, copied.raw)
                    linked = copied.step
                except (OSError, RuntimeError) as e:
                    errors.append(f"copy for rank {self.holder}: {type(e).__name__}: {e}")
            sends += isend_held(linked, self.holder, self._to(self.holder))
        for w in sorted(self.wards_here):
            if (linked := recv_held(w, self._to(w))) is not None:
                held[str(w)], via[str(w)] = linked, "link"
        for (w, ring, offer, i, man_path, _), receipt in zip(incoming, receipts, strict=True):
            if receipt.complete():
                ring.commit(i, man_path, offer.manifest, offer.raw)
                held[str(w)], via[str(w)] = offer.manifest["step"], "network"
            else:
                errors.append(f"copy of rank {w}: its own copy failed after its offer")
        for s in sends:
            s.wait()
        self.in_flight = [w for w in self.in_flight if w is not sends and w is not receipts]
        line = {"event": "snapshot", "step": copied.step, "ok": copied.bin is not None}
        if copied.manifest is not None:
            line["kind"] = copied.manifest["kind"]
            line["copied_bytes"] = copied.copied
        if self.wards:
            line["held"], line["held_via"] = held, via
        if errors:
            line["error"] = "; ".join(errors)[:500]
        return line

    def _hold_local(self, ward: int, path: Path, manifest: dict, raw: bytes) -> str:
        """Put `ward`'s slot file `path`, on this host, into its held ring: by a link to the
        file, or, where none can be made (the held directory on another file system), by a
        memory copy."""
        ring = self.held[ward].of(manifest)
        try:
            ring.link(path, manifest, raw)
            return "link"
        except OSError:
            nbytes = manifest["nbytes"]
            i, _, man_path, image = ring.claim(nbytes)
            image[:nbytes].copy_(self._peer_image(path, nbytes))
            ring.commit(i, man_path, manifest, raw)
            return "memory"

    def _peer_image(self, path: Path, nbytes: int) -> torch.Tensor:
        """A slot file on this host, mapped once and reused: its ring rewrites the same files,
        and mapping anew would fault every page in again at every snapshot."""
        image = self.peer_maps.get(path)
        if image is None or image.numel() < nbytes:
            image = self.peer_maps[path] = map_file(path, nbytes)
        return image[:nbytes]
