"""How a snapshot slot travels between ranks over gloo: a header [manifest length, image
bytes], the manifest as JSON bytes, then the image. An image length of -1 says "no snapshot
this time" (the sender's copy failed), so the receiver skips it and sends and receives stay
paired. Used for buddy copies (worker/trainer/snapshot.py) and for restoring a moved rank
(worker/trainer/snapshot_restore.py)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def isend_slot(manifest: dict | None, image: torch.Tensor | None, dst: int, group=None) -> list:
    """Start sending one slot (None: an empty header); the caller waits on the works."""
    if manifest is None or image is None:
        return [dist.isend(torch.tensor([0, -1], dtype=torch.int64), dst, group=group)]
    meta = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8)
    n = manifest["nbytes"]
    hdr = torch.tensor([meta.numel(), n], dtype=torch.int64)
    return [dist.isend(t, dst, group=group) for t in (hdr, meta, image[:n])]


def recv_manifest(src: int, group=None) -> tuple[dict, int] | None:
    """The next slot's manifest and image size from `src`; None when it sent none. The image
    follows: receive it with `dist.recv` into a buffer of that size."""
    hdr = torch.empty(2, dtype=torch.int64)
    dist.recv(hdr, src, group=group)
    meta_len, nbytes = hdr.tolist()
    if nbytes < 0:
        return None
    meta = torch.empty(meta_len, dtype=torch.uint8)
    dist.recv(meta, src, group=group)
    return json.loads(bytes(meta.numpy())), nbytes
