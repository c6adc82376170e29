"""Chaos fixtures. The stack is the session's shared one (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.chaos.chaos import TRAINING, training_key
from tests.launch import train


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """spec -> rank 0's step records of the same training run under plain torchrun
    (standalone, no controller, nothing killed), checkpointing as the spec says.
    Run once per distinct training spec in the session."""
    cache: dict[str, list[dict]] = {}

    def run(spec: dict) -> list[dict]:
        key = training_key(spec)
        if key not in cache:
            d = tmp_path_factory.mktemp("uninterrupted")
            plain = {"name": spec["name"], **{k: spec[k] for k in TRAINING if k in spec}}
            cache[key] = train(plain, d, extra=["--checkpoint-root", str(d / "checkpoints")], timeout=400)
            assert [r["step"] for r in cache[key]] == list(range(spec["train"]["steps"]))
        return cache[key]

    return run
