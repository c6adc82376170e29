"""A Hugging Face checkpoint imported with `model.hf` computes what `transformers` computes:
meshkeeper's step-1 loss equals `transformers`' loss on the same tokens within rtol 1e-5
(fp32), in one process and at dp2 x pp2 x tp2 (dp2 alone for a tied head, which needs tp 1
and pp 1), for Llama 3 with rope scaling, Mistral, Qwen2 with biases and a tied head, and
Qwen3 with q/k norms, all with grouped-query attention."""

from __future__ import annotations

import pytest

from services.hf_config import with_hf_architecture
from services.spec import parse_spec
from tests.launch import train
from tests.models.hf_fixtures import ARCHITECTURES, SEQ, hf_loss, save_checkpoint
from worker.trainer.data import Batches

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    return {name: save_checkpoint(name, root / name) for name in ARCHITECTURES}


def job(directory, parallel: dict) -> dict:
    return {
        "name": "hf-import",
        "model": {"hf": str(directory), "seq_len": SEQ},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": parallel,
        "train": {"steps": 1, "global_batch": GLOBAL_BATCH, "lr": 1e-3, "warmup_steps": 1},
    }


def oracle(spec: dict, directory) -> float:
    s = parse_spec(with_hf_architecture(spec))
    x, y = Batches(s.data, s.model, GLOBAL_BATCH, 1).local(0, 0)
    return hf_loss(directory, x, y)


LAYOUTS = {"one": {"dp": 1}, "dp2-pp2-tp2": {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_step_one_loss_equals_transformers(checkpoints, tmp_path, arch, layout):
    parallel = LAYOUTS[layout]
    if arch == "qwen2-tied" and layout != "one":
        parallel = {"dp": 2}
    spec = job(checkpoints[arch], parallel)
    (first,) = train(spec, tmp_path, timeout=300)
    assert first["loss"] == pytest.approx(oracle(spec, checkpoints[arch]), rel=1e-5)
