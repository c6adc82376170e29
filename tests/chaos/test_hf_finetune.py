"""A job under the controller fine-tunes from a Hugging Face checkpoint (`model.hf`, under
the stack's data root) at dp2 x tp2; a rank is SIGKILLed mid-run, and the job ends with the
loss curve of the uninterrupted run, bit for bit: a recovery restores the trained state, never
the imported weights again."""

from __future__ import annotations

import pytest

from services.hf_config import with_hf_architecture
from tests.chaos.chaos import DP_TP, mesh_spec, survives_one_kill
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
