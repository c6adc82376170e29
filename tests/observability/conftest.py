"""Fixtures of the observability suite: the session's shared stack (tests/stack.py; its
agents serve their Prometheus endpoints on free ports) and the tools that judge it.

promtool and Chromium are real binaries; a missing one fails the test with the command that
installs it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.stack import Stack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def obs_stack(shared_stack: Stack) -> Stack:
    """The session's stack, as it is (module fixtures make it idle themselves)."""
    return shared_stack


@pytest.fixture
def obs(stack: Stack) -> Stack:
    """The session's stack, idle: no open job, every agent alive and idle."""
    return stack


def _binary(name: str, candidates: list, install: str) -> str:
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return str(c)
    pytest.fail(f"{name} not found; install it with: {install}", pytrace=False)


@pytest.fixture(scope="session")
def promtool() -> str:
    return _binary(
        "promtool",
        [ROOT / ".tools" / "bin" / "promtool", shutil.which("promtool")],
        "scripts/install-promtool.sh  (extracts Debian's prometheus package into .tools/)",
    )


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """(browser, driver) paths."""
    install = "apt-get install -y chromium chromium-driver"
    return (
        _binary("chromium", [shutil.which("chromium"), shutil.which("chromium-browser")], install),
        _binary("chromedriver", [shutil.which("chromedriver")], install),
    )


@pytest.fixture
def browser(chromium, tmp_path):
    """Headless Chromium driven by selenium, its console log kept (the mesh page's tests)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = chromium
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--window-size=1400,1000",
    ):
        opts.add_argument(arg)
    b = webdriver.Chrome(service=Service(driver), options=opts)
    yield b
    b.quit()
