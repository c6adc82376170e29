"""What the `gpu` tests measure, for `make gpu-check`'s summary (scripts/gpu_check.py): a test
records a figure with `measured(name, value)`, and each figure is appended as one JSON line to
the file MESHKEEPER_GPU_MEASURES names (nowhere when unset, as in the ordinary suite)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest

MEASURES_ENV = "MESHKEEPER_GPU_MEASURES"


@pytest.fixture
def measured(request) -> Callable[[str, object], None]:
    path = os.environ.get(MEASURES_ENV)

    def record(name: str, value: object) -> None:
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.nodeid, name: value}) + "\n")

    return record
