"""Re-execution spot checks (worker/trainer/spot_check.py) on real gloo ranks: a clean check
passes and leaves the training state bit for bit as it was (the next step too, MoE routing
counts included); a compute fault injected on one rank is found on every rank and blamed on
that rank (dp2 zero3), or on its TP group (dp1 tp2: the flipped activation reaches the peer
through TP's collectives).

The rank side is this module's `__main__`: two ranks under tests/rankrun.py run every
scenario and print one JSON line each per scenario.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import rank_scenarios

SCENARIOS = ("moe-dp2-zero3-clean", "dp2-zero3-fault", "tp2-fault")


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    return rank_scenarios(2, "tests.unit.test_spot_check", SCENARIOS)


def test_a_clean_check_passes_and_touches_no_state(results):
    for r in results["moe-dp2-zero3-clean"]:
        assert r["raised"] is None, r
        assert r["state_unchanged"] and r["grads_none"], r
        # the step after the check equals the same step of a trainer that never checked:
        # loss, every state tensor, and the step's MoE routing counts (rank 0 records them)
        assert r["next_step_same"], r


def test_a_compute_fault_on_one_rank_is_found_everywhere_and_blamed_on_it(results):
    rows = results["dp2-zero3-fault"]
    assert [r["raised"] is not None for r in rows] == [True, True], rows
    ev = rows[0]["raised"]
    assert all(r["raised"] == ev for r in rows), "every rank reports the same evidence"
    assert (ev["step"], ev["clean_step"]) == (2, 2), ev
    assert (ev["ranks"], ev["suspects"]) == ([1], [1]), ev
    assert ev["tensor"] == "loss", ev  # the first compared value, and every one differs
    assert "rank 1: loss, logits, input gradient" in ev["detail"], ev["detail"]
    assert "spot check" in ev["detail"], ev["detail"]
    # the flip is reported like the state flips, by the faulty rank only, once
    assert [r["chaos"] for r in rows] == [[], [{"step": 2, "bit": 30}]], rows
    assert all(r["state_unchanged"] and r["grads_none"] for r in rows), rows


def test_under_tp_the_fault_reaches_the_peer_and_the_group_is_blamed(results):
    rows = results["tp2-fault"]
    ev = rows[0]["raised"]
    assert ev is not None and all(r["raised"] == ev for r in rows), rows
    assert ev["suspects"] == [0, 1], ev  # documented: TP peers share the pass's collectives
    assert all(r["state_unchanged"] and r["grads_none"] for r in rows), rows


# -- the rank side -----------------------------------------------------------------------
def _spec(name: str, parallel: dict, model: dict | None = None, flip: dict | None = None):
    from services.spec import parse_spec

    spec = {
        "name": name,
        "model": {"preset": "tiny", **(model or {})},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": parallel,
        "train": {"steps": 6, "global_batch": 4, "lr": 3e-3, "warmup_steps": 1},
        "sdc": {"spot_every_steps": 2},
    }
    if flip:
        spec["chaos"] = {"bitflip": [{"step": 2, "tensor": "compute", **flip}]}
    return parse_spec(spec)


def _state(trainer) -> list:
    """Every state tensor's local shard, copied."""
    from worker.trainer.sdc import state_tensors

    return [t.clone() for _, t in state_tensors(trainer.parts, trainer.optimizers)]


def _same(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _scenario(name: str, spec, ctx, reference: bool) -> dict:
    """Two steps, a spot check at step 2 (the flip, if the spec has one, fires there), then
    with `reference` a third step compared with a trainer that never checked."""
    from services.spec import spot_checked
    from worker.trainer.chaos import BitFlips
    from worker.trainer.sdc import SilentCorruption
    from worker.trainer.spot_check import SpotCheck
    from worker.trainer.step import Trainer

    assert spot_checked(spec)
    trainer = Trainer(spec, ctx)
    chaos: list[dict] = []
    flips = BitFlips(
        spec.chaos.bitflip if spec.chaos else [],
        ctx.rank,
        1,
        trainer.parts,
        trainer.optimizers,
        lambda e: chaos.append({"step": e["step"], "bit": e["bit"]}),
    )
    for i in range(2):
        trainer.train_step(i)
    before = _state(trainer)
    raised = None
    try:
        SpotCheck(spec, trainer, flips).verify(2)
    except SilentCorruption as e:
        raised = e.evidence
    out = {
        "scenario": name,
        "rank": ctx.rank,
        "raised": raised,
        "chaos": chaos,
        "state_unchanged": _same(before, _state(trainer)),
        "grads_none": all(p.grad is None for p in trainer.params),
    }
    if reference:
        other = Trainer(spec, ctx)
        for i in range(2):
            other.train_step(i)
        mine, theirs = trainer.train_step(2), other.train_step(2)
        out["next_step_same"] = (
            mine.loss == theirs.loss
            and mine.experts == theirs.experts
            and (ctx.rank != 0 or mine.experts is not None)
            and _same(_state(trainer), _state(other))
        )
    return out


def _main() -> None:
    import torch

    from worker.trainer.distributed import init_distributed, shutdown_distributed
    from worker.trainer.parallel import ParallelDims, RankContext

    torch.set_num_threads(1)
    rank, _, device = init_distributed(timeout_s=60)
    cases = [
        ("moe-dp2-zero3-clean", {"dp": 2, "zero": 3}, {"experts": 4, "top_k": 2}, None, True),
        ("dp2-zero3-fault", {"dp": 2, "zero": 3}, None, {"rank": 1}, False),
        ("tp2-fault", {"tp": 2}, None, {"rank": 1}, False),
    ]
    try:
        for name, parallel, model, flip, reference in cases:
            spec = _spec(name, parallel, model, flip)
            dims = ParallelDims(spec.parallel, device.type)
            ctx = RankContext(dims, dims.build_mesh(), rank, device)
            print(json.dumps(_scenario(name, spec, ctx, reference)), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    _main()
