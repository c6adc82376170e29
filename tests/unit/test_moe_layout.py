"""Expert parallelism outside the trainer: the spec's checks name the field and the fix, the
mesh knows each rank's expert shard, a shrink or grow moves whole expert groups, and FLOPs
count the experts a token runs through (issue 17)."""

from __future__ import annotations

import pytest

from controller.recovery import grow, shrink
from services.mesh import MeshShape
from services.spec import ModelSpec, SpecError, parse_spec
from tests.unit.test_recovery import free, mesh, placed
from worker import mfu


def spec(model: dict | None = None, **parallel) -> dict:
    return {
        "name": "moe",
        "model": {"preset": "tiny", "experts": 4, **(model or {})},
        "parallel": parallel,
        "train": {"steps": 10, "global_batch": 8},
    }


def problems(s: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        parse_spec(s)
    return {p.field: p.message for p in e.value.problems}


def test_an_expert_parallel_spec_parses_with_dropless_defaults():
    s = parse_spec(spec(dp=4, ep=2))
    assert (s.parallel.ep, s.model.experts, s.model.top_k, s.model.capacity_factor) == (2, 4, 2, 0)


@pytest.mark.parametrize(
    "model, parallel, field, fix",
    [
        ({"experts": 0}, {"dp": 2, "ep": 2}, "parallel.ep", "set model.experts or ep: 1"),
        ({"experts": 3}, {"dp": 2, "ep": 2}, "parallel.ep", "choose ep in {1, 3}"),
        ({}, {"dp": 3, "ep": 2}, "parallel.ep", "choose ep in {1, 3} or raise dp"),
        ({"top_k": 5}, {}, "model.top_k", "choose top_k from 1 to 4"),
        ({}, {"auto": True}, "parallel.auto", "remove parallel.auto"),
    ],
)
def test_a_bad_expert_layout_names_its_field_and_the_fix(model, parallel, field, fix):
    got = problems(spec(model, **parallel))
    assert field in got and fix in got[field], got


def test_the_mesh_names_each_ranks_expert_shard():
    shape = MeshShape(4, 2, 1, ep=2)  # dp coordinate d holds shard d % 2
    assert [shape.expert_shard(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert "dp=3 ep=1" in shape.render()
    with pytest.raises(ValueError, match="ep"):
        MeshShape(3, 1, 1, ep=2)


def test_a_shrink_drops_the_whole_expert_group_that_lost_a_rank():
    shape = MeshShape(4, 1, 1, ep=2)  # groups {dp0, dp1} and {dp2, dp3}
    ranks, host_of = mesh(shape, ["a"] * 4)
    layout = shrink(shape, ranks, {"w3"}, 1, 8, 1, False, host_of)
    assert layout.shape == MeshShape(2, 1, 1, ep=2)
    assert placed(layout) == [(0, "w0", (0, 0, 0)), (1, "w1", (1, 0, 0))]
    assert layout.spares == ["w2"]  # the dropped group's healthy member
    assert shrink(MeshShape(2, 1, 1, ep=2), ranks[:2], {"w0"}, 1, 8, 1, False, host_of) is None


def test_a_grow_adds_a_whole_expert_group():
    shape = MeshShape(2, 1, 1, ep=2)
    ranks, host_of = mesh(shape, ["a", "a"])
    assert grow(shape, ranks, 4, 8, 1, False, free("s1@b"), host_of) is None  # half a group
    layout = grow(shape, ranks, 4, 8, 1, False, free("s1@b", "s2@b"), host_of)
    assert layout.shape == MeshShape(4, 1, 1, ep=2)
    assert [wid for _, wid, _ in placed(layout)] == ["w0", "w1", "s1", "s2"]


def test_flops_count_the_experts_a_token_runs_through():
    dense = ModelSpec(preset="tiny")
    moe = ModelSpec(preset="tiny", experts=8, top_k=2)
    expert = 3 * dense.d_model * dense.ffn
    assert moe.params == dense.params + dense.layers * (7 * expert + 8 * dense.d_model)
    assert moe.active_params == dense.params + dense.layers * (expert + 8 * dense.d_model)
    assert mfu.flops_per_token(moe) - mfu.flops_per_token(dense) == pytest.approx(
        6 * dense.layers * (expert + 8 * dense.d_model)
    )
