"""Per-shard initial weights (worker/trainer/init_rng.py): at four layouts on four real gloo
ranks (dp4 at zero 3: FSDP's Shard(0); tp4: TP's column and row shards and the vocabulary
shards; dp2 x tp2 at zero 3: FSDP's _StridedShard over TP; a mixture of experts at dp4 ep2:
the experts' 3-d weights split over ep) and one on eight (dp4 x tp2 at zero 3), every rank's
shard of every parameter equals, bit for bit, that shard of the whole model one process
initialises. And the values are a standard normal: their moments over a large tensor, and no
two parameters alike.

The rank side is this module's `__main__`: the ranks under tests/rankrun.py print one JSON
line each per layout of their world size.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.launch import rank_scenarios

LAYOUTS = {  # world: {name: (parallel, model)}
    4: {
        "dp4-zero3": ({"dp": 4, "zero": 3}, {}),
        "tp4": ({"dp": 1, "tp": 4}, {}),
        "dp2-tp2-zero3": ({"dp": 2, "tp": 2, "zero": 3}, {}),
        "moe-dp4-ep2": ({"dp": 4, "ep": 2, "zero": 3}, {"experts": 4, "top_k": 2}),
    },
    # FSDP's _StridedShard over four replicas of a TP shard: torch 2.13 does not count it as
    # a shard (`is_shard()`), and an init that trusted that crashed at this layout
    8: {"dp4-tp2-zero3": ({"dp": 4, "tp": 2, "zero": 3}, {})},
}
CASES = [(world, name) for world, layouts in LAYOUTS.items() for name in sorted(layouts)]


@pytest.fixture(scope="module")
def results() -> Callable[[int], dict[str, list[dict]]]:
    """Each world size's scenario lines, run once, when a test first asks (a failure at one
    size fails that size's tests only)."""
    runs: dict[int, dict[str, list[dict]]] = {}

    def of(world: int) -> dict[str, list[dict]]:
        if world not in runs:
            names = list(LAYOUTS[world])
            runs[world] = rank_scenarios(world, "tests.unit.test_shard_init", names, timeout=240)
        return runs[world]

    return of


@pytest.mark.parametrize("world, layout", CASES, ids=[name for _, name in CASES])
def test_every_shard_equals_the_single_process_init(results, world, layout):
    rows = results(world)[layout]
    assert len(rows) == world
    for r in rows:
        assert r["sharded"], r  # the layout did shard something on this rank
        assert r["differing"] == [], r


def test_the_values_are_a_standard_normal_and_each_parameter_its_own():
    import torch

    from worker.trainer.init_rng import fill_normal
    from worker.trainer.model import param_seed

    big = torch.empty(1024, 1024)
    fill_normal(big, param_seed(0, "layers.0.mlp.up.weight"), 1.0)
    x = big.double().flatten()
    assert abs(float(x.mean())) < 5e-3 and abs(float(x.std()) - 1) < 5e-3
    assert abs(float((x**4).mean()) - 3) < 0.05  # a normal's kurtosis, not a uniform's 1.8
    other = torch.empty(1024, 1024)
    fill_normal(other, param_seed(0, "layers.0.mlp.down.weight"), 1.0)
    assert abs(float(torch.corrcoef(torch.stack([big.flatten(), other.flatten()]))[0, 1])) < 5e-3


# -- the rank side -----------------------------------------------------------------------
def _main() -> None:
    import torch

    from services.spec import parse_spec
    from tests.stack import tiny_spec
    from worker.trainer.distributed import init_distributed, shutdown_distributed
    from worker.trainer.model import build_model
    from worker.trainer.parallel import ParallelDims, RankContext
    from worker.trainer.shards import local_shard
    from worker.trainer.step import Trainer

    torch.set_num_threads(1)
    rank, world, device = init_distributed(timeout_s=60)
    try:
        for name, (parallel, model) in LAYOUTS[world].items():
            spec = parse_spec(tiny_spec(name, parallel=parallel, model=model))
            whole = dict(build_model(spec.model, spec.train.seed, "cpu").named_parameters())
            dims = ParallelDims(spec.parallel, device.type)
            trainer = Trainer(spec, RankContext(dims, dims.build_mesh(), rank, device))
            differing, sharded = [], False
            for pname, p in trainer.parts[0].named_parameters():
                local = p.to_local()
                sharded = sharded or local.shape != p.shape
                if not torch.equal(local, local_shard(whole[pname].detach(), p)):
                    differing.append(pname)
            line = {"scenario": name, "rank": rank, "differing": differing, "sharded": sharded}
            print(json.dumps(line), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    _main()
