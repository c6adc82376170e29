"""Logged steps (worker/snapshots.py, worker/trainer/snapshot_state.py): a whole snapshot
plus the gradients of the steps after it restores the very bits of the state those steps
left, and a step restores only through an unbroken chain of slots."""

from __future__ import annotations

import secrets
from pathlib import Path

import torch
from torch import nn

from services.spec import TrainSpec
from worker.snapshots import Slot, chains
from worker.trainer.optim import build_optimizer, build_scheduler
from worker.trainer.snapshot_state import (
    capture,
    capture_step,
    copy_into,
    destinations,
    grad_refs,
    layout,
    load_chain,
    write_stamp,
)

SPEC = TrainSpec(steps=20, global_batch=4, lr=1e-2, warmup_steps=3)


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)
        self.side = nn.Linear(16, 4)  # trained at even steps only: odd steps leave it alone
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        self.seen += 1  # a buffer that changes every step, as running statistics do
        out = self.b(torch.tanh(self.a(x)))
        return out + self.side(x) if step % 2 == 0 else out


def trained(seed: int):
    net = Net(seed)
    opt = build_optimizer(list(net.parameters()), SPEC)
    return net, opt, build_scheduler(opt, SPEC)


def image_of(captured, step: int, prev: dict | None) -> tuple[dict, torch.Tensor]:
    """What the snapshot thread writes: the tensors at their layout, stamped, and a manifest."""
    lay, nbytes = layout(captured.tensors)
    image = torch.zeros(nbytes, dtype=torch.uint8)
    copy_into(destinations(image, lay), captured.tensors)
    manifest = {
        "id": secrets.token_hex(8),
        "step": step,
        "rank": 0,
        "nbytes": nbytes,
        "tensors": lay,
        "state": captured.state,
        "kind": "whole" if prev is None else "grads",
    }
    if prev is not None:
        manifest["prev"] = prev["id"]
    write_stamp(image, manifest)
    return manifest, image


def optimizer_state(net: Net, opt) -> list[torch.Tensor]:
    return [v.clone() for p in net.parameters() for v in opt.state[p].values()]


def test_a_whole_snapshot_and_logged_gradients_restore_the_very_bits():
    net, opt, sched = trained(seed=1)
    chain = []
    for step in range(1, 8):
        x = torch.randn(8, 16)
        net(x, step).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        grads = grad_refs([opt])  # before the step, as the trainer's before_update
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step == 3:
            chain = [image_of(capture([net], [opt], [sched], {"step": step}), step, None)]
        elif step > 3:
            captured = capture_step([net], [opt], [sched], {"step": step}, grads)
            chain.append(image_of(captured, step, chain[-1][0]))
    want_params = {n: p.detach().clone() for n, p in net.named_parameters()}
    want_opt, want_lr = optimizer_state(net, opt), opt.param_groups[0]["lr"]

    back, back_opt, back_sched = trained(seed=2)  # other weights, fresh optimizer state
    saved = load_chain([back], [back_opt], [back_sched], chain)

    assert saved == {"step": 7}
    for n, p in back.named_parameters():
        assert torch.equal(p, want_params[n]), n
    assert back.seen.item() == net.seen.item() == 7
    got_opt = optimizer_state(back, back_opt)
    assert len(got_opt) == len(want_opt)
    assert all(torch.equal(g, w) for g, w in zip(got_opt, want_opt, strict=True))
    assert back_opt.param_groups[0]["lr"] == want_lr
    assert back_sched.state_dict() == sched.state_dict()


def test_replaying_without_the_logged_steps_gives_other_bits():
    """The comparison above can fail: the whole snapshot alone is an older state."""
    net, opt, sched = trained(seed=1)
    whole = None
    for step in range(1, 5):
        net(torch.randn(8, 16), step).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step == 2:
            whole = image_of(capture([net], [opt], [sched], {"step": step}), step, None)
    back, back_opt, back_sched = trained(seed=2)
    load_chain([back], [back_opt], [back_sched], [whole])
    assert not torch.equal(back.a.weight, net.a.weight)


def slot(step: int, kind: str = "grads", prev: Slot | None = None, id_: str = "") -> Slot:
    m = {"id": id_ or f"{step:016x}", "step": step, "kind": kind}
    if prev is not None:
        m["prev"] = prev.manifest["id"]
    return Slot(Path(f"s{step}.bin"), m)


def test_a_step_restores_through_an_unbroken_chain_only():
    w4 = slot(4, "whole")
    s5 = slot(5, prev=w4)
    s6 = slot(6, prev=s5)
    got = chains({4: w4, 5: s5, 6: s6})
    assert [s.step for s in got[6]] == [4, 5, 6]
    assert [s.step for s in got[4]] == [4]


def test_a_logged_step_whose_predecessor_was_rewritten_is_not_restorable():
    w4 = slot(4, "whole")
    s5 = slot(5, prev=w4)
    s6 = slot(6, prev=s5)
    other5 = slot(5, prev=w4, id_="ffffffffffffffff")  # step 5 written again: another slot
    assert sorted(chains({4: w4, 5: other5, 6: s6})) == [4, 5]
    assert sorted(chains({5: s5, 6: s6})) == []  # its whole snapshot is gone
