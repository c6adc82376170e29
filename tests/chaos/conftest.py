"""Fixtures of the chaos suite beyond the session's shared stack (tests/conftest.py)."""

from __future__ import annotations

import pytest

from services.procs import free_port
from tests.chaos.upstack import UpStack

UP_WORKERS = 3  # a dp2 job and its spare


@pytest.fixture(scope="package")
def up(tmp_path_factory) -> UpStack:
    """One `meshkeeper up --workers 3` for every chaos test of `up` itself (each start costs
    three agents' torch imports). Tests leave it whole: a killed Redis is back, a killed
    agent's place is taken by a fresh one, so it always has UP_WORKERS live agents."""
    s = UpStack(tmp_path_factory.mktemp("up") / "run", free_port(), UP_WORKERS)
    try:
        s.wait_ready(UP_WORKERS)
        yield s
    finally:
        s.close()
