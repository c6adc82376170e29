"""A rank's training state as one flat byte image plus a JSON manifest, and back.

The in-memory snapshot (docs/architecture.md, "Hot recovery") holds exactly what a rank owns
on its mesh: the local shard of every parameter and buffer (a DTensor's `to_local()`), its
optimizer's state tensors, the optimizer's hyperparameters as the LR schedule left them,
the LR scheduler and the data stream's train state. It restores onto the same mesh only
(shards are not resharded), which is what lets it skip DCP's planning and run as plain
memory copies. The manifest is JSON, never pickle: a copy arrives from another host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from worker.snapshots import HEADER_BYTES, STAMP_BYTES, stamp

ALIGN = 64  # every tensor starts on a cache line, so a byte slice views as any dtype


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own piece of `t`, for copying under no_grad: the DTensor's local tensor
    itself, not `to_local()`, whose autograd-aware dispatch costs ~10 us a tensor, and a
    snapshot captures hundreds of them on the training thread at every step."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _encode(v):
    """JSON for optimizer hyperparameters: tuples (betas) survive as tuples."""
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    return v


def _decode(v):
    if isinstance(v, dict):
        if "__tuple__" in v:
            return tuple(_decode(x) for x in v["__tuple__"])
        return {k: _decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


@dataclass
class Captured:
    """The tensors to copy (references, not copies: valid until the next optimizer step)
    and everything else, already in JSON form."""

    tensors: list[tuple[str, torch.Tensor]]
    state: dict


def capture(
    parts: list[nn.Module],
    optimizers: list[Optimizer],
    schedulers: list[LRScheduler],
    train_state: dict,
) -> Captured:
    tensors: list[tuple[str, torch.Tensor]] = []
    optim = []
    for i, (part, opt) in enumerate(zip(parts, optimizers, strict=True)):
        tensors += [(f"p{i}/{n}", _local(p)) for n, p in part.named_parameters()]
        tensors += [(f"b{i}/{n}", _local(b)) for n, b in part.named_buffers()]
        sd = opt.state_dict()
        state: dict[str, dict] = {}
        for idx, entry in sd["state"].items():
            out = {}
            for k, v in entry.items():
                if torch.is_tensor(v):
                    key = f"o{i}/{idx}/{k}"
                    tensors.append((key, _local(v)))
                    out[k] = {"tensor": key, "dtensor": isinstance(v, DTensor)}
                else:
                    out[k] = _encode(v)
            state[str(idx)] = out
        optim.append({"state": state, "param_groups": _encode(sd["param_groups"])})
    return Captured(
        tensors,
        {"optim": optim, "scheduler": schedulers[0].state_dict(), "train_state": train_state},
    )


def optimized(opt: Optimizer) -> list[torch.Tensor]:
    """The parameters `opt` updates, in the order its state is indexed by."""
    return [p for g in opt.param_groups for p in g["params"]]


def grad_refs(optimizers: list[Optimizer]) -> list[tuple[str, torch.Tensor]]:
    """The gradients the coming optimizer steps consume, clipped already: exactly those of
    the parameters each optimizer holds, keyed by their place there, from the optimizer's own
    lists (walking the modules' names instead cost ~0.4 ms of the training thread at every
    step). References: the step after it sets fresh ones, `zero_grad(set_to_none=True)`, and
    never writes these."""
    return [
        (f"g{i}/{j}", _local(p.grad))
        for i, opt in enumerate(optimizers)
        for j, p in enumerate(optimized(opt))
        if p.grad is not None
    ]


def capture_step(
    parts: list[nn.Module],
    optimizers: list[Optimizer],
    schedulers: list[LRScheduler],
    train_state: dict,
    grads: list[tuple[str, torch.Tensor]],
) -> Captured:
    """A logged step (worker/snapshots.py): the step's gradients (`grad_refs`, taken before
    it) and the buffers, and the hyperparameters the LR schedule left for the next step."""
    tensors = list(grads)
    for i, part in enumerate(parts):
        tensors += [(f"b{i}/{n}", _local(b)) for n, b in part.named_buffers()]
    groups = [
        _encode([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
        for opt in optimizers
    ]
    return Captured(
        tensors,
        {"groups": groups, "scheduler": schedulers[0].state_dict(), "train_state": train_state},
    )


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to whole cache lines."""
    return -(-nbytes // ALIGN) * ALIGN


def _entry(key: str, t: torch.Tensor, off: int) -> list:
    return [key, str(t.dtype).removeprefix("torch."), list(t.shape), off, t.nbytes]


def layout(
    tensors: list[tuple[str, torch.Tensor]], start: int = HEADER_BYTES
) -> tuple[list[list], int]:
    """[[key, dtype, shape, offset, nbytes], ...] and the image's total size; the tensors
    start at `start`: after the header that holds the image's stamp (worker/snapshots.py), or
    after what is in the image already (`in_slot`)."""
    out, off = [], start
    for key, t in tensors:
        out.append(_entry(key, t, off))
        off += aligned(t.nbytes)
    return out, off


def copyable_bytes(parts: list[nn.Module]) -> int:
    """Room for everything a logged step may copy: every gradient (shaped like its parameter's
    local piece) and every buffer, each aligned."""
    tensors = [_local(t) for part in parts for t in (*part.parameters(), *part.buffers())]
    return sum(aligned(t.nbytes) for t in tensors)


def in_slot(
    tensors: list[tuple[str, torch.Tensor]], image: torch.Tensor, end: int
) -> tuple[list[list], list[tuple[str, torch.Tensor]]]:
    """The layout entries of the tensors that already lie in `image` between its header and
    `end` (gradients reduced into it, worker/trainer/snapshot_grads.py), and the others,
    which the snapshot copies."""
    base, there, rest = image.data_ptr(), [], []
    for key, t in tensors:
        off = t.data_ptr() - base
        if t.device == image.device and t.is_contiguous() and HEADER_BYTES <= off <= end - t.nbytes:
            there.append(_entry(key, t, off))
        else:
            rest.append((key, t))
    return there, rest


def destinations(image: torch.Tensor, lay: list) -> list[torch.Tensor]:
    """Each tensor's place in `image` (a uint8 tensor, e.g. a mapped file), in layout order."""
    return [
        image[off : off + nbytes].view(getattr(torch, dtype)).view(shape)
        for _, dtype, shape, off, nbytes in lay
    ]


@torch.no_grad()  # the parameters require grad; the snapshot thread's grad mode is its own
def copy_into(dst: list[torch.Tensor], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copy every tensor to its destination (`destinations`): one call, not one per tensor,
    whose Python overhead alone was as much as the copy of a small model's bytes."""
    torch._foreach_copy_(dst, [t for _, t in tensors])


def write_stamp(image: torch.Tensor, manifest: dict | None) -> None:
    """Mark `image` as holding what `manifest` describes; None: as holding nothing yet."""
    mark = bytes(STAMP_BYTES) if manifest is None else stamp(manifest)
    image[:STAMP_BYTES].copy_(torch.frombuffer(bytearray(mark), dtype=torch.uint8))


def views(image: torch.Tensor, lay: list) -> dict[str, torch.Tensor]:
    return {entry[0]: v for entry, v in zip(lay, destinations(image, lay), strict=True)}


def _check_stamp(manifest: dict, image: torch.Tensor) -> None:
    if bytes(image[:STAMP_BYTES].numpy()) != stamp(manifest):
        raise RuntimeError(
            f"snapshot of rank {manifest.get('rank')} step {manifest.get('step')}: its image "
            "was rewritten after its manifest was read"
        )


def _like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Local tensor `t` shaped and placed like parameter `p` (a DTensor's piece -> DTensor)."""
    if not isinstance(p, DTensor):
        return t.to(p.device)
    return DTensor.from_local(
        t.to(_local(p).device),
        p.device_mesh,
        p.placements,
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )


def load_chain(
    parts: list[nn.Module],
    optimizers: list[Optimizer],
    schedulers: list[LRScheduler],
    chain: list[tuple[dict, torch.Tensor]],
) -> dict:
    """Load a whole snapshot, then replay the logged steps after it (worker/snapshots.py
    `chains`); returns the train state of the last."""
    (manifest, image), *logged = chain
    saved = load(parts, optimizers, schedulers, manifest, image)
    for manifest, image in logged:
        saved = replay(parts, optimizers, schedulers, manifest, image)
    return saved


@torch.no_grad()
def replay(
    parts: list[nn.Module],
    optimizers: list[Optimizer],
    schedulers: list[LRScheduler],
    manifest: dict,
    image: torch.Tensor,
) -> dict:
    """Redo a logged step's optimizer step on the state before it: the same fused kernel on
    the same parameters, state, gradients and hyperparameters gives the same bits as the
    step that logged it. Then the hyperparameters, buffers and schedule it left."""
    _check_stamp(manifest, image)
    v = views(image, manifest["tensors"])
    state = manifest["state"]
    for i, (part, opt) in enumerate(zip(parts, optimizers, strict=True)):
        for j, p in enumerate(optimized(opt)):
            g = v.get(f"g{i}/{j}")  # none: the step left this parameter alone, as here
            p.grad = None if g is None else _like(g, p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for n, b in part.named_buffers():
            _local(b).copy_(v[f"b{i}/{n}"])
        for group, saved in zip(opt.param_groups, _decode(state["groups"][i]), strict=True):
            group.update(saved)
    for sched in schedulers:
        sched.load_state_dict(state["scheduler"])
    return state["train_state"]


@torch.no_grad()
def load(
    parts: list[nn.Module],
    optimizers: list[Optimizer],
    schedulers: list[LRScheduler],
    manifest: dict,
    image: torch.Tensor,
) -> dict:
    """Put the image back into this rank's live state; returns the train state it held.
    Raises KeyError or RuntimeError when the image was taken on another layout, and
    RuntimeError when it no longer holds what the manifest describes (its stamp differs)."""
    _check_stamp(manifest, image)
    v = views(image, manifest["tensors"])
    state = manifest["state"]
    for i, (part, opt) in enumerate(zip(parts, optimizers, strict=True)):
        for n, p in part.named_parameters():
            _local(p).copy_(v[f"p{i}/{n}"])
        for n, b in part.named_buffers():
            _local(b).copy_(v[f"b{i}/{n}"])
        params = optimized(opt)
        saved = state["optim"][i]
        opt_state = {}
        for idx, entry in saved["state"].items():
            p, out = params[int(idx)], {}
            for k, x in entry.items():
                if isinstance(x, dict) and "tensor" in x:
                    t = v[x["tensor"]].clone()
                    # optimizer state is shaped and placed like its parameter
                    out[k] = _like(t, p) if x["dtensor"] else t
                else:
                    out[k] = _decode(x)
            opt_state[int(idx)] = out
        opt.load_state_dict({"state": opt_state, "param_groups": _decode(saved["param_groups"])})
    for sched in schedulers:
        sched.load_state_dict(state["scheduler"])
    return state["train_state"]
