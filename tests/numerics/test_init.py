"""Weight init is a function of (train.seed, parameter name) alone: a pipeline stage built on
the meta device, wrapped for activation checkpointing and then materialized holds exactly the
whole model's values under the same names (the multi-rank layouts: test_parity.py)."""

import torch

from services.spec import ModelSpec, ParallelSpec
from worker.trainer.activation_checkpoint import apply_ac
from worker.trainer.model import build_model
from worker.trainer.pipeline import split_stages

CFG = ModelSpec(preset="tiny")


def test_meta_built_stage_matches_whole_model():
    whole = dict(build_model(CFG, seed=7).named_parameters())
    p = ParallelSpec(pp=2, microbatches=2)
    [(_, stage)] = split_stages(build_model(CFG, seed=7, device="meta"), 1, p)
    apply_ac(stage, True)
    stage.to_empty(device="cpu")
    stage.init_weights(7)
    got = {n.replace("_checkpoint_wrapped_module.", ""): t for n, t in stage.named_parameters()}
    assert set(got) == {
        n for n in whole if n.startswith(("layers.2.", "layers.3.", "norm", "head"))
    }
    for name, value in got.items():
        assert torch.equal(value, whole[name]), name
    assert torch.equal(stage.rope_cos, build_model(CFG, seed=7).rope_cos)


def test_each_parameter_has_its_own_stream():
    a = dict(build_model(CFG, seed=7).named_parameters())
    b = dict(build_model(CFG, seed=8).named_parameters())
    # same shape, different names: different values (no shared generator position)
    assert not torch.equal(a["layers.0.attn.q.weight"], a["layers.0.attn.k.weight"])
    assert not torch.equal(a["layers.0.attn.q.weight"], b["layers.0.attn.q.weight"])
