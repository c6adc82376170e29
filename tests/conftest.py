"""Session-wide fixtures. The local stack (tests/stack.py) is started once per session, at
the first test that asks for it, and shared by tests/integration, tests/chaos and
tests/observability: its 8 agents each import torch, so a second stack would double that
cost. Reference runs (`uninterrupted`) are trained once per distinct training spec and shared
by every suite that compares against them. Also: the wall time of each suite, printed at the
end of the run."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import pytest

from tests.launch import TRAINING, train, training_key
from tests.stack import RedisServer, Stack


@pytest.fixture
def redis_server(tmp_path) -> RedisServer:
    """A private redis-server for tests that need no controller or agents."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    if server.proc.alive():
        server.proc.stop(5)


@pytest.fixture(scope="session")
def shared_stack(tmp_path_factory) -> Stack:
    s = Stack(tmp_path_factory.mktemp("stack"))
    yield s
    s.close()


@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    """The shared stack, every part up, no open job and every worker idle."""
    shared_stack.idle()
    return shared_stack


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> Callable[[dict], list[dict]]:
    """spec -> rank 0's step records of the same training run as plain local ranks
    (tests/rankrun.py: no controller, nothing killed, nothing saved). Trained once per distinct
    training spec (tests/launch.py `training_key`) in the session."""
    cache: dict[str, list[dict]] = {}

    def run(spec: dict) -> list[dict]:
        key = training_key(spec)
        if key not in cache:
            d = tmp_path_factory.mktemp("uninterrupted")
            plain = {"name": spec["name"], **{k: spec[k] for k in TRAINING if k in spec}}
            cache[key] = train(plain, d, timeout=400)
            assert [r["step"] for r in cache[key]] == list(range(1, spec["train"]["steps"] + 1))
        return cache[key]

    return run


# -- time per suite ---------------------------------------------------------------------
# Wall time per top-level suite directory (tests/<suite>/...): the sum of every phase of its
# tests (setup, call, teardown, so a stack started by a suite's first test counts there).
# Tests run one suite after another, so the sums add up to the session's wall time.
_suite_seconds: dict[str, float] = defaultdict(float)
_suite_tests: dict[str, set[str]] = defaultdict(set)
_started = pytest.StashKey[float]()


def _suite(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "root"  # tests/test_*.py


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    suite = _suite(report.nodeid)
    _suite_seconds[suite] += report.duration
    _suite_tests[suite].add(report.nodeid)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_started] = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """One line per suite, e.g. `suite time: chaos 312.4s (41 tests)`, then the session's."""
    if not _suite_seconds:
        return
    terminalreporter.section("time per suite")
    for suite in sorted(_suite_seconds):
        terminalreporter.write_line(
            f"suite time: {suite} {_suite_seconds[suite]:.1f}s ({len(_suite_tests[suite])} tests)"
        )
    wall = time.monotonic() - config.stash.get(_started, time.monotonic())
    terminalreporter.write_line(
        f"suite time: total {wall:.1f}s ({sum(map(len, _suite_tests.values()))} tests)"
    )


# -- GPU-only tests -----------------------------------------------------------------------
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` exercise the NCCL/CUDA path: they skip, saying why, where torch sees
    no CUDA device (CI and the build machines); the device tool runs them on a lent GPU."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch  # only when GPU tests were collected: torch costs seconds to import

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu:
        item.add_marker(skip)
