"""A job under the controller fine-tunes from a Hugging Face checkpoint (`model.hf`, under
the stack's data root) at dp2 x tp2; a rank is SIGKILLed mid-run, and the job ends with the
loss curve of the uninterrupted run, bit for bit: a recovery restores the trained state, never
the imported weights again. A job that asks for `checkpoint.export_hf` ends with its final
checkpoint there as a directory `transformers` loads with no missing or unexpected keys, the
same tensors `meshkeeper export-hf` writes from that checkpoint, named in its status."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from cli.main import main as meshkeeper
from services.hf_config import with_hf_architecture
from tests.chaos.chaos import DP_TP, mesh_spec, start, succeeded, survives_one_kill
from tests.models.hf_fixtures import SEQ, save_checkpoint

pytestmark = pytest.mark.slow

KILL_AT = 8  # of 15 steps: past the first checkpoint, before the second


def test_a_fine_tune_from_model_hf_survives_a_killed_rank_to_the_exact_loss(stack, uninterrupted):
    source = save_checkpoint("llama3", stack.data / "llama3-tiny")
    spec = mesh_spec("chaos-hf", parallel=DP_TP)
    spec["model"] = {"hf": str(source), "seq_len": SEQ}
    spec = with_hf_architecture(spec)  # what `meshkeeper submit` sends: the fields filled in
    want = uninterrupted(spec)
    survives_one_kill(stack, spec, KILL_AT, want)


def test_a_job_exports_its_final_checkpoint_for_transformers_and_names_it(stack, tmp_path):
    import torch
    import transformers

    source = save_checkpoint("llama3", stack.data / "llama3-export")
    out = stack.work / "checkpoints" / "exports" / "llama3-tuned"
    spec = mesh_spec("chaos-hf-export", parallel={"dp": 2})
    spec["model"] = {"hf": str(source), "seq_len": SEQ}
    spec["checkpoint"]["export_hf"] = str(out)
    w, j = start(stack, with_hf_architecture(spec))
    j = w.finish()
    succeeded(stack, j)  # with no recovery: rank 0 exports alone, its peer gone
    e = j.export
    assert (e.path, e.step, e.error) == (str(out), j.steps, None), e
    assert e.bytes == sum(f.stat().st_size for f in out.glob("*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in out.glob("*.safetensors")
    )  # the weights' bytes: each file less its header
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # the same tensors the CLI writes from the job's last checkpoint
    again = tmp_path / "again"
    assert meshkeeper(["export-hf", j.last_checkpoint.path, str(again)]) == 0
    mine, cli = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert mine.keys() == cli.keys() and all(torch.equal(mine[k], cli[k]) for k in mine)
    assert not list(out.parent.glob(".llama3-tuned.*")), "no partial or old export is left"
