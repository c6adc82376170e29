"""A committed checkpoint exported with `meshkeeper export-hf` is a model `transformers` loads
with no missing or unexpected keys, and it computes meshkeeper's next step: its loss on the
next step's batch equals the trainer's within rtol 1e-5 (fp32), from a checkpoint saved in
one process and one saved at a parallel layout (dp2 x pp2 x tp2, a tied head's included;
Mixtral's at dp2 x ep2 x pp2 x tp2 and dp4 x ep2). Importing and exporting with no update gives
the source's tensors bit for bit, and `--dtype bf16` their bf16 casts (a Mixtral imported from
transformers 5's fused form exports in the hub's per-expert form: the same model saved that
way, bit for bit). A mixture of experts meshkeeper initialised itself exports as a Mixtral
that computes its next step too."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cli.main import main as meshkeeper
from services.hf_config import with_hf_architecture
from services.spec import parse_spec
from tests.launch import train
from tests.models.hf_fixtures import (
    ARCHITECTURES,
    FUSED,
    LAYOUTS,
    SEQ,
    cases,
    hf_loss,
    save_checkpoint,
)
from worker.trainer.data import Batches

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 8
# the fused form is an import form only: its export is the hub form's (checked bit for bit)
CASES = [(arch, layout) for arch, layout in cases() if arch not in FUSED or layout == "one"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    return {name: save_checkpoint(name, root / name) for name in ARCHITECTURES}


def fine_tune(source, parallel: dict, steps: int, every: int, root, **train_fields) -> list:
    model = source if isinstance(source, dict) else {"hf": str(source), "seq_len": SEQ}
    spec = {
        "name": "hf-export",
        "model": model,
        "data": {"source": "synthetic", "seed": 7},
        "parallel": parallel,
        "train": {"steps": steps, "global_batch": GLOBAL_BATCH, "lr": 1e-3, **train_fields},
        "checkpoint": {"every_steps": every},
    }
    records = train(spec, root / "run", extra=["--checkpoint-root", str(root / "ckpt")])
    return spec, records


def step_dir(root, step: int):
    (found,) = (root / "ckpt").glob(f"*/g*/step-{step:08d}")
    return found


def exported(root, step: int, *dtype: str):
    out = root / f"export-{step}{''.join(dtype)}"
    flags = ["--dtype", *dtype] if dtype else []
    assert meshkeeper(["export-hf", str(step_dir(root, step)), str(out), *flags]) == 0
    return out


def loads_and_computes_the_next_step(spec: dict, records: list, out) -> None:
    """`out` loads in transformers with no missing or unexpected keys, and its loss on step
    4's batch is the trainer's step 4."""
    import transformers

    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    s = parse_spec(with_hf_architecture(spec))
    x, y = Batches(s.data, s.model, GLOBAL_BATCH, 1).local(3, 0)  # step 4's batch
    assert hf_loss(out, x, y) == pytest.approx(records[3]["loss"], rel=1e-5)


@pytest.mark.parametrize("arch, layout", CASES)
def test_an_export_loads_in_transformers_and_computes_the_next_step(
    checkpoints, tmp_path, arch, layout
):
    spec, records = fine_tune(checkpoints[arch], LAYOUTS[layout], 4, 3, tmp_path, warmup_steps=1)
    out = exported(tmp_path, 3)
    loads_and_computes_the_next_step(spec, records, out)
    config = json.loads((out / "config.json").read_text())
    assert (
        config["architectures"]
        == json.loads((checkpoints[arch] / "config.json").read_text())["architectures"]
    )


def test_meshkeepers_own_mixture_of_experts_exports_as_a_mixtral(tmp_path):
    # no model.hf: the config.json is made from the spec (worker/hf/export.py, hf_config)
    model = {"preset": "tiny", "experts": 4, "top_k": 2}
    spec, records = fine_tune(model, {"dp": 2, "ep": 2}, 4, 3, tmp_path, warmup_steps=1)
    out = exported(tmp_path, 3)
    loads_and_computes_the_next_step(spec, records, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_import_then_export_without_an_update_is_bit_for_bit(checkpoints, tmp_path, arch):
    # an update of 1e-30 moves no fp32 weight by half an ulp: the state is the source's
    fine_tune(checkpoints[arch], {"dp": 1}, 1, 1, tmp_path, lr=1e-30, weight_decay=0.0)
    # the fused form's model saved in the hub's form (same config and seed) is what it exports
    same_model = "mixtral" if arch in FUSED else arch
    source = load_file(checkpoints[same_model] / "model.safetensors")
    same = load_file(exported(tmp_path, 1) / "model.safetensors")
    assert sorted(same) == sorted(source)
    assert all(torch.equal(same[k], source[k]) for k in source), [
        k for k in source if not torch.equal(same[k], source[k])
    ]
    half = load_file(exported(tmp_path, 1, "bf16") / "model.safetensors")
    assert all(torch.equal(half[k], source[k].to(torch.bfloat16)) for k in source)
