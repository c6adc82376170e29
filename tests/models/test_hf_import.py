"""A Hugging Face checkpoint imported with `model.hf` computes what `transformers` computes:
meshkeeper's step-1 loss equals `transformers`' loss on the same tokens within rtol 1e-5
(fp32), in one process and at a parallel layout, for Llama 3 with rope scaling, Mistral,
Qwen2 with biases and a tied head (its last pipeline stage holds a copy), and Qwen3 with q/k
norms at dp2 x pp2 x tp2, and Mixtral (in the hub's per-expert form and transformers 5's fused
one) at dp2 x ep2 x pp2 x tp2 and at dp4 x ep2 (FSDP over each expert shard's replicas), all
with grouped-query attention. The Mixtral oracle is sensitive to what a wrong mapping would
change: experts in another order than the router's rows, or the router's weights not
renormalised over the chosen experts, move transformers' own loss far beyond the tolerance."""

from __future__ import annotations

import pytest
import torch

from services.hf_config import with_hf_architecture
from services.spec import parse_spec
from tests.launch import train
from tests.models.hf_fixtures import ARCHITECTURES, LAYOUTS, SEQ, cases, hf_loss, save_checkpoint
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


def batch(spec: dict):
    s = parse_spec(with_hf_architecture(spec))
    return Batches(s.data, s.model, GLOBAL_BATCH, 1).local(0, 0)


def oracle(spec: dict, directory) -> float:
    return hf_loss(directory, *batch(spec))


@pytest.mark.parametrize("arch, layout", cases())
def test_step_one_loss_equals_transformers(checkpoints, tmp_path, arch, layout):
    spec = job(checkpoints[arch], LAYOUTS[layout])
    (first,) = train(spec, tmp_path, timeout=300)
    assert first["loss"] == pytest.approx(oracle(spec, checkpoints[arch]), rel=1e-5)


def test_a_wrong_expert_order_or_router_would_fail_the_mixtral_comparison(checkpoints):
    import torch.nn.functional as F
    import transformers
    from transformers.models.mixtral import modeling_mixtral

    directory = checkpoints["mixtral"]
    x, y = batch(job(directory, {"dp": 1}))
    right = hf_loss(directory, x, y)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)

    def loss() -> float:
        with torch.no_grad():
            return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()

    with torch.no_grad():  # experts 0 and 1 swapped, the router's rows left as they were
        for layer in model.model.layers:
            for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                w.copy_(w[[1, 0, 2, 3]])
    swapped = loss()
    with torch.no_grad():
        for layer in model.model.layers:
            for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                w.copy_(w[[1, 0, 2, 3]])
    assert loss() == pytest.approx(right, rel=1e-6)  # restored

    route = modeling_mixtral.MixtralTopKRouter.forward

    def unnormalised(self, hidden):  # the softmax over all experts, not over the chosen
        logits = F.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        top, chosen = logits.float().softmax(-1).topk(self.top_k, dim=-1)
        return logits, top, chosen

    modeling_mixtral.MixtralTopKRouter.forward = unnormalised
    try:
        unrenormalised = loss()
    finally:
        modeling_mixtral.MixtralTopKRouter.forward = route
    for wrong in (swapped, unrenormalised):
        assert abs(wrong - right) > 100 * 1e-5 * right, (wrong, right)
