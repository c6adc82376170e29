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
3. If the bytes are needed, the sender sends the image.

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

from worker.snapshots import holds


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
