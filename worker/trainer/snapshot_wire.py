"""How a snapshot slot travels between two ranks over gloo (docs/architecture.md, "Hot
recovery"): used for buddy copies (worker/trainer/snapshot.py) and for restoring a moved rank
(worker/trainer/snapshot_restore.py).

1. The sender offers the slot: a header [path length, manifest length, image bytes], then
   the path of the slot's file and the manifest's JSON. An image length of -1 says "no
   snapshot this time" (the sender's copy failed); the receiver skips it, and sends and
   receives stay paired.
2. The receiver answers whether it needs the bytes. It does not when it can read the
   sender's file itself (`visible`): both ranks share host memory, so a local copy (or, for a
   restore, no copy at all) replaces a trip through the network stack, which on one host
   costs several times a memory copy's CPU time.
3. If the bytes are needed, the sender sends the image. A buddy copy streams it
   (`ImageStream`): the offer goes out before the sender's own copy starts, since the
   manifest is known from the layout, and each chunk of `SEND_CHUNK_BYTES` leaves as soon
   as the copy has written it, so the network carries one chunk while the copy writes the
   next (on a GPU, the device-to-host copy). The header, whose stamp the copy writes last,
   travels last, then one flag: whether the copy completed. A copy that failed after its
   offer leaves the holder's slot uncommitted.

Each step is posted by every rank before anyone waits on the next (sends are asynchronous), so
a ring of ranks that are each other's buddies never deadlocks.

Two ranks that find, once, that they share host memory (worker/trainer/snapshot.py `_meet`)
skip all three: the ward links its slot into the holder's `held/` ring itself and sends only
the step it linked (`isend_held`). Every message through gloo costs both processes many
wakeups of their threads, and on one host those were the largest single part of what a
snapshot cost (docs/fault-tolerance.md, "Cost").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import orjson
import torch
import torch.distributed as dist

from worker.snapshots import HEADER_BYTES, holds

# A buddy copy's unit: large enough that a message's fixed costs vanish, small enough that
# the copy and the network overlap on a slot of a few hundred MB.
SEND_CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class Offer:
    raw: bytes  # the slot's manifest, as JSON: a held copy is committed as it came
    nbytes: int
    path: Path  # the sender's slot file, as the sender sees it

    @cached_property
    def manifest(self) -> dict:
        return orjson.loads(self.raw)

    def visible(self) -> bool:
        """Whether this process sees the sender's very file: a file of that name here that
        holds the offered slot, stamped with its random `id` (a same-named file in another
        host's memory holds another)."""
        return holds(self.path, self.manifest)


def isend_offer(raw: bytes | None, nbytes: int, path: Path | None, dst: int, group=None) -> list:
    """Offer one slot: its manifest's JSON, image size and file (None: an empty header); the
    caller waits on the works."""
    if raw is None or path is None:
        return [dist.isend(torch.tensor([0, 0, -1], dtype=torch.int64), dst, group=group)]
    where, what = str(path).encode(), raw
    body = torch.frombuffer(bytearray(where + what), dtype=torch.uint8)
    hdr = torch.tensor([len(where), len(what), nbytes], dtype=torch.int64)
    return [dist.isend(t, dst, group=group) for t in (hdr, body)]


def recv_offer(src: int, group=None) -> Offer | None:
    """The next offer from `src`; None when it offered none."""
    hdr = torch.empty(3, dtype=torch.int64)
    dist.recv(hdr, src, group=group)
    path_len, text_len, nbytes = hdr.tolist()
    if nbytes < 0:
        return None
    body = torch.empty(path_len + text_len, dtype=torch.uint8)
    dist.recv(body, src, group=group)
    raw = bytes(body.numpy())
    return Offer(raw[path_len:], nbytes, Path(raw[:path_len].decode()))


def isend_answer(need_bytes: bool, dst: int, group=None) -> list:
    return [dist.isend(torch.tensor([int(need_bytes)], dtype=torch.int64), dst, group=group)]


def recv_answer(src: int, group=None) -> bool:
    """Whether `src` needs the image sent."""
    t = torch.empty(1, dtype=torch.int64)
    dist.recv(t, src, group=group)
    return bool(t.item())


def isend_image(image: torch.Tensor, nbytes: int, dst: int, group=None) -> list:
    return [dist.isend(image[:nbytes], dst, group=group)]


def chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """The byte ranges an image of `nbytes` streams in, in order: the tensors' bytes in pieces
    of `chunk`, then the header with the stamp (a holder's bytes are a complete image only
    once the last range arrived)."""
    return [(a, min(a + chunk, nbytes)) for a in range(HEADER_BYTES, nbytes, chunk)] + [
        (0, HEADER_BYTES)
    ]


class ImageStream:
    """One image sent to its holder while it is being written: a chunk once every byte below
    its end is final (`upto`), what is left and the header at `end`, then whether the image
    is complete."""

    def __init__(self, image: torch.Tensor, nbytes: int, dst: int, group, chunk: int):
        self.image, self.dst, self.group = image, dst, group
        self.pending = chunks(nbytes, chunk)
        self.works: list = []

    def upto(self, end: int) -> None:
        """Bytes below `end` are written: send the chunks that lie there (never the header)."""
        while len(self.pending) > 1 and self.pending[0][1] <= end:
            self._send(*self.pending.pop(0))

    def end(self, complete: bool) -> list:
        """The rest, the header and the flag; the works to wait on."""
        for a, b in self.pending:
            self._send(a, b)
        self.pending = []
        flag = torch.tensor([int(complete)], dtype=torch.int64)
        self.works.append(dist.isend(flag, self.dst, group=self.group))
        return self.works

    def _send(self, a: int, b: int) -> None:
        self.works.append(dist.isend(self.image[a:b], self.dst, group=self.group))


class ImageReceipt:
    """An `ImageStream`'s receives, posted before this rank's own copy starts, so the bytes
    flow while both ranks copy (gloo moves a message only once its receive is posted)."""

    def __init__(self, image: torch.Tensor, nbytes: int, src: int, group, chunk: int):
        self.flag = torch.empty(1, dtype=torch.int64)
        self.works = [dist.irecv(image[a:b], src, group=group) for a, b in chunks(nbytes, chunk)]
        self.works.append(dist.irecv(self.flag, src, group=group))

    def complete(self) -> bool:
        """Wait for every byte; whether the sender's copy completed."""
        for w in self.works:
            w.wait()
        return bool(self.flag.item())


def isend_held(step: int | None, dst: int, group=None) -> list:
    """Tell a holder on this host which step the sender linked into the holder's `held/`
    ring itself (None: none this time): all that crosses the group per snapshot between two
    ranks in the same host memory."""
    got = -1 if step is None else step
    return [dist.isend(torch.tensor([got], dtype=torch.int64), dst, group=group)]


def recv_held(src: int, group=None) -> int | None:
    """The step a ward on this host linked into this rank's `held/` ring, or None."""
    t = torch.empty(1, dtype=torch.int64)
    dist.recv(t, src, group=group)
    got = int(t.item())
    return None if got < 0 else got
