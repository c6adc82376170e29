"""The state-at-rest check (worker/trainer/at_rest.py) on real gloo ranks at dp2 zero3, where
no replica holds a rank's shards: clean steps pass and train what an unchecked trainer trains;
a parameter bit flipped after the update is found before the step's snapshot, on every rank,
blamed on the flipping rank, with the step before as the clean one; an optimizer-state flip
made after that verification is found by that rank alone when the next step begins, with the
sealed step clean (its peers then fail in the step's collectives, which this test stops short
of).

The rank side is this module's `__main__`: two ranks under tests/rankrun.py run every
scenario and print one JSON line each per scenario.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import rank_scenarios

SCENARIOS = ("clean", "param-before-copy", "optim-before-next-step")


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    return rank_scenarios(2, "tests.unit.test_at_rest", SCENARIOS)


def test_clean_steps_pass_and_train_what_an_unchecked_trainer_trains(results):
    for r in results["clean"]:
        assert r["raised"] is None, r
        assert r["losses"] == r["unchecked_losses"], r


def test_a_flip_after_the_update_is_found_before_the_copy_and_blamed_on_its_rank(results):
    rows = results["param-before-copy"]
    ev = rows[0]["raised"]
    assert ev is not None and all(r["raised"] == ev for r in rows), rows  # same everywhere
    assert (ev["check"], ev["step"], ev["clean_step"]) == ("at_rest", 2, 1), ev
    assert (ev["ranks"], ev["suspects"]) == ([1], [1]), ev
    assert ev["tensor"] == rows[1]["flipped"], (ev, rows[1])  # the flipped tensor, named
    assert rows[0]["flipped"] is None  # rank 0 flipped nothing


def test_a_flip_after_the_snapshot_is_found_by_its_rank_when_the_next_step_begins(results):
    rows = results["optim-before-next-step"]
    ev = rows[0]["raised"]
    assert ev is not None and rows[1]["raised"] is None, rows  # rank 0's check, alone
    assert (ev["step"], ev["clean_step"]) == (2, 2), ev  # the copies of step 2 were verified
    assert ev["suspects"] == [0] and ev["tensor"].endswith("(exp_avg)"), ev


# -- the rank side -----------------------------------------------------------------------
def _spec(flip: dict | None):
    from services.spec import parse_spec

    spec = {
        "name": "at-rest",
        "model": {"preset": "tiny"},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 2, "zero": 3},
        "train": {"steps": 4, "global_batch": 4, "lr": 3e-3, "warmup_steps": 1},
    }
    if flip:
        spec["chaos"] = {"bitflip": [{"step": 2, "bit": 22, **flip}]}
    return parse_spec(spec)


def _scenario(name: str, flip: dict | None, where: str, ctx) -> dict:
    """Four steps as the trainer's loop runs them: seal after each update, verify before the
    copies (`settle`) and when the next step begins; the flip, if any, at step 2 `where`."""
    from worker.trainer.at_rest import AtRestCheck
    from worker.trainer.chaos import BitFlips
    from worker.trainer.sdc import SilentCorruption
    from worker.trainer.step import Trainer

    spec = _spec(flip)
    trainer = Trainer(spec, ctx)
    flipped: list[str] = []
    flips = BitFlips(
        spec.chaos.bitflip if spec.chaos else [],
        ctx.rank,
        1,
        trainer.parts,
        trainer.optimizers,
        lambda e: flipped.append(e["tensor"]),
    )
    check = AtRestCheck(trainer)
    check.seal(0)
    losses, raised = [], None
    try:
        for index in range(spec.train.steps):
            if index:
                check.verify_here(checked_step=None)
                if where == "before-next-step" and index == 2:
                    break  # a rank that raised above is gone: its peer's step would wait
            r = trainer.train_step(index)
            losses.append(r.loss)
            check.seal(r.step)
            if where == "before-copy":
                flips.after_step(r.step)
            check.verify(checked_step=None)
            if where == "before-next-step":
                flips.after_step(r.step)
    except SilentCorruption as e:
        raised = e.evidence
    out = {"scenario": name, "rank": ctx.rank, "raised": raised, "losses": losses}
    out["flipped"] = flipped[0] if flipped else None
    if flip is None:
        other = Trainer(spec, ctx)
        out["unchecked_losses"] = [other.train_step(i).loss for i in range(spec.train.steps)]
    return out


def _main() -> None:
    import torch

    from worker.trainer.distributed import init_distributed, shutdown_distributed
    from worker.trainer.parallel import ParallelDims, RankContext

    torch.set_num_threads(1)
    rank, _, device = init_distributed(timeout_s=60)
    cases = [
        ("clean", None, ""),
        ("param-before-copy", {"rank": 1, "tensor": "param"}, "before-copy"),
        ("optim-before-next-step", {"rank": 0, "tensor": "optim"}, "before-next-step"),
    ]
    try:
        dims = ParallelDims(_spec(None).parallel, device.type)
        ctx = RankContext(dims, dims.build_mesh(), rank, device)
        for name, flip, where in cases:
            print(json.dumps(_scenario(name, flip, where, ctx)), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    _main()
