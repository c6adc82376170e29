"""A Mixtral directory saved by `transformers` read as the spec's model section
(services/hf_config.py) and checked against meshkeeper's mixture of experts before any step
(worker/hf/weights.py `verify`, worker/hf/mixtral.py): its experts, top-k and dropless routing
map onto meshkeeper's fields; what transformers would compute differently is refused naming
the config's field and the fix; a missing or misshapen expert tensor is named, in either of
the two forms a checkpoint holds its experts in."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.spec import SpecError, load_spec
from services.spec_types import Problem
from tests.models.hf_fixtures import SEQ, save_checkpoint
from worker.hf.weights import SafetensorsDir, WeightsError, verify


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    return {name: save_checkpoint(name, root / name) for name in ("mixtral", "mixtral-fused")}


def spec_for(tmp_path, source, config_change: dict | None = None, **model) -> str:
    """A job spec on a copy of `source` whose config.json has `config_change` applied."""
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **(config_change or {})}))
    spec = {
        "name": "mixtral",
        "model": {"hf": str(directory), "seq_len": SEQ, **model},
        "train": {"steps": 1, "global_batch": 8},
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    return str(path)


def refusals(path: str) -> list[Problem]:
    with pytest.raises(SpecError) as e:
        load_spec(path)
    return e.value.problems


def test_the_experts_and_router_map_onto_meshkeepers_fields(tmp_path, saved):
    m = load_spec(spec_for(tmp_path, saved["mixtral"])).model
    assert (m.experts, m.top_k, m.capacity_factor, m.ffn_hidden) == (4, 2, 0.0, 96)
    # transformers adds no balance loss with output_router_logits false: neither does meshkeeper
    assert m.aux_loss_coef == 0.0
    assert (m.kv_heads, m.rope_theta, m.tie_embeddings) == (2, 1e6, False)


def test_the_spec_may_choose_meshkeepers_balance_loss(tmp_path, saved):
    path = spec_for(tmp_path, saved["mixtral"], {"output_router_logits": True}, aux_loss_coef=0.01)
    assert load_spec(path).model.aux_loss_coef == 0.01


@pytest.mark.parametrize(
    "change, model, words",
    [
        (
            {"router_jitter_noise": 0.1},
            {},
            "router_jitter_noise 0.1: transformers multiplies each MoE layer's input by uniform "
            "noise while training",
        ),
        (
            {"output_router_logits": True},
            {},
            "output_router_logits true adds transformers' load-balancing loss",
        ),
        ({"sliding_window": 16}, {}, "sliding_window 16 is shorter than model.seq_len (32)"),
        ({"attention_dropout": 0.1}, {}, "attention_dropout 0.1: dropout is not implemented"),
    ],
)
def test_what_transformers_computes_otherwise_is_refused_naming_the_field(
    tmp_path, saved, change, model, words
):
    (problem,) = refusals(spec_for(tmp_path, saved["mixtral"], change, **model))
    assert problem.field == "model.hf" and words in problem.message, problem
    assert "config.json" in problem.message, problem


def test_a_routing_field_that_contradicts_the_config_names_both(tmp_path, saved):
    # a capacity factor would drop choices transformers computes
    problems = refusals(spec_for(tmp_path, saved["mixtral"], capacity_factor=1.25, top_k=1))
    got = {p.field: p.message for p in problems}
    assert "1.25 contradicts" in got["model.capacity_factor"], got
    assert "which gives 0.0" in got["model.capacity_factor"], got
    assert "which gives 2" in got["model.top_k"], got


@pytest.mark.parametrize(
    "form, drop, wrong",
    [
        (
            "mixtral",
            "model.layers.1.block_sparse_moe.experts.3.w2.weight",
            "model.layers.0.block_sparse_moe.experts.2.w1.weight",
        ),
        ("mixtral-fused", "model.layers.1.mlp.experts.down_proj", "model.layers.0.mlp.gate.weight"),
    ],
)
def test_a_missing_or_misshapen_expert_tensor_is_named(tmp_path, saved, form, drop, wrong):
    spec = load_spec(spec_for(tmp_path, saved[form]))
    directory = tmp_path / "model"
    verify(SafetensorsDir(directory), spec.model)  # complete: passes
    tensors = load_file(directory / "model.safetensors")
    del tensors[drop]
    tensors[wrong] = torch.zeros(3, 64)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(WeightsError) as e:
        verify(SafetensorsDir(directory), spec.model)
    assert f"{drop} is missing" in str(e.value), e.value
    assert f"{wrong} has shape [3, 64], the config implies" in str(e.value), e.value
