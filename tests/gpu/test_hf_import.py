"""A Hugging Face checkpoint imported on a GPU (worker/hf/weights.py: the tensors read on the
host and each rank's shard copied to its device): the step-1 loss of a 1-rank fp32 trainer
equals `transformers`' loss on the same GPU and tokens, for each supported architecture. The
tolerance is looser than on CPU (1e-4): the two models' attention and GEMM kernels may differ
on a GPU, where they are the same code on CPU (tests/models holds the 1e-5 parity)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.hf_config import with_hf_architecture
from services.spec import parse_spec
from tests.launch import train
from tests.models.hf_fixtures import ARCHITECTURES, SEQ, save_checkpoint
from worker.trainer.data import Batches

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_an_imported_checkpoint_computes_what_transformers_computes_on_the_gpu(tmp_path, arch):
    import transformers

    source = save_checkpoint(arch, tmp_path / "hf")
    spec = {
        "name": "gpu-hf",
        "model": {"hf": str(source), "seq_len": SEQ},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 1, "tf32": False},  # transformers' oracle runs strict fp32
        "train": {"steps": 1, "global_batch": 8},
    }
    (first,) = train(spec, tmp_path / "run", timeout=300)
    s = parse_spec(with_hf_architecture(spec))
    x, y = Batches(s.data, s.model, 8, 1).local(0, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        logits = model.to("cuda")(x.to("cuda")).logits
    want = F.cross_entropy(logits.flatten(0, 1), y.to("cuda").flatten()).item()
    assert first["loss"] == pytest.approx(want, rel=1e-4)
