"""Fixtures of the security suite."""

from __future__ import annotations

import pytest

from tests.stack import ApiStack


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> ApiStack:
    """A redis-server (auth on) and one controller with an auth file, no agents; fresh for
    each test module, so what one module's attacks leave behind never helps another's."""
    s = ApiStack(tmp_path_factory.mktemp("api"))
    yield s
    s.close()
