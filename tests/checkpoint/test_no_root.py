"""A standalone trainer given no checkpoint root saves nothing; it says so at start, naming
both ways to give one, instead of training for hours on a spec whose `checkpoint:` section
does nothing."""

from __future__ import annotations

from tests.launch import run_trainer
from tests.stack import tiny_spec


def test_a_run_without_a_checkpoint_root_says_it_saves_nothing(tmp_path):
    spec = tiny_spec("no-root", parallel={"dp": 1}, train={"steps": 2, "global_batch": 4})
    spec["checkpoint"] = {"every_steps": 1}
    out = run_trainer(spec, tmp_path)
    assert "no checkpoints: neither --checkpoint-root nor checkpoint.root is set" in out.stdout
    assert "checkpoint.every_steps (1) is unused" in out.stdout
    assert not list(tmp_path.rglob("*.distcp"))
