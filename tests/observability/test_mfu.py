"""The agent's torch-free FLOP count (worker/mfu.py) equals the model's own, which counts the
parameters of a real (meta-device) model, for every preset and an explicit shape."""

from __future__ import annotations

import pytest

from services.spec import PRESETS, ModelSpec
from worker import mfu
from worker.trainer import model

SHAPES = [{"preset": p} for p in PRESETS] + [
    {"layers": 3, "d_model": 96, "heads": 6, "vocab": 500, "seq_len": 40, "ffn_hidden": 200}
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.get("preset", "explicit"))
def test_flops_per_token_matches_the_model(shape):
    m = ModelSpec(**shape)
    assert mfu.param_count(m) == model.param_count(m)
    assert mfu.flops_per_token(m) == model.flops_per_token(m)


def test_mfu_is_each_ranks_share_of_the_global_throughput_over_its_peak():
    # 1e6 FLOPs/token at 1000 tokens/s over 4 ranks = 2.5e8 FLOP/s per rank, of a 1e9 peak
    assert mfu.mfu(1e6, 1000.0, 4, 1e9) == pytest.approx(0.25)
