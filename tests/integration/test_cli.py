"""The `meshkeeper` command line as a user runs it: one clear line per error, never a traceback;
`up` starts the local stack and leaves nothing behind when stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
import yaml

from services.procs import free_port
from tests.integration.conftest import ENV, ROOT, wait_until


def meshkeeper(
    *args: str,
    url: str | None = None,
    timeout: float = 120,
    env: dict | None = None,
    token: str | None = None,
):
    """The CLI as a user runs it; `token` goes in MESHKEEPER_TOKEN, as a user exports it."""
    argv = [sys.executable, "-m", "cli", *(["--url", url] if url else []), *args]
    env = {**(env or ENV), **({"MESHKEEPER_TOKEN": token} if token else {})}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_submit_bad_spec_prints_every_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "name": "x",
                "model": {"preset": "tiny", "heads": 3},
                "parallel": {"dp": 2, "tp": 2},
                "train": {"steps": 5, "global_batch": 15},
            }
        )
    )
    r = meshkeeper("submit", str(bad), url="http://127.0.0.1:9")  # never reached
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    for field in ("model.heads", "parallel.tp", "train.global_batch"):
        assert f"- {field}:" in r.stderr, r.stderr
    missing = meshkeeper("submit", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_unreachable_controller_is_one_line():
    r = meshkeeper("workers", url=f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "cannot reach the controller" in r.stderr, r.stderr


def test_unknown_job_is_one_line(stack):
    r = meshkeeper(
        "status", "no-such-job", url=stack.controller.url, token=stack.secrets.viewer_token
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "not found" in r.stderr


@pytest.mark.slow
def test_submit_watch_status_workers(stack):
    token = stack.secrets.submitter_token
    r = meshkeeper(
        "submit",
        str(ROOT / "examples" / "tiny-1d.yaml"),
        "--watch",
        "--interval",
        "0.3",
        url=stack.controller.url,
        token=token,
    )
    assert r.returncode == 0, r.stderr + stack.logs()
    job = r.stdout.splitlines()[0]
    assert job.startswith("tiny-1d-")
    assert "step 30/30" in r.stdout and "Succeeded" in r.stdout
    assert "tok/s" in r.stdout and "ETA" in r.stdout
    assert "\x1b" not in r.stdout and "\r" not in r.stdout  # a pipe: plain lines, no redraws
    status = meshkeeper("status", job, url=stack.controller.url, token=token)
    assert status.returncode == 0
    lines = [line.split() for line in status.stdout.splitlines()]
    assert ["Succeeded", "True"] in [cells[:2] for cells in lines], status.stdout
    # the mesh: one row per (dp, pp), one column per tp rank; dp=2 puts r0 and r1 in pp 0
    assert re.search(r"^ +0 +0 +r0@w\d+:succeeded *$", status.stdout, re.M), status.stdout
    assert re.search(r"^ +1 +0 +r1@w\d+:succeeded *$", status.stdout, re.M), status.stdout
    table = meshkeeper("status", url=stack.controller.url, token=token).stdout
    assert job in table
    workers = meshkeeper("workers", url=stack.controller.url, token=token).stdout
    assert all(f"w{i} " in workers for i in range(8))


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The ones still running (a zombie has exited: only its parent has not reaped it yet)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("own_redis", [True, False], ids=["starts-redis", "uses-REDIS_URL"])
def test_up_starts_the_stack_and_stops_it_completely(tmp_path, redis_server, own_redis):
    port = free_port()
    env = {**ENV, **({} if own_redis else {"REDIS_URL": redis_server.url})}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "up",
            "--workers",
            "2",
            "--warm",
            "0",
            "--port",
            str(port),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        token = tmp_path / "run" / "secrets" / "api-token"  # up writes it before starting anything
        wait_until(token.exists, 30, f"{token}")
        r = meshkeeper(
            "ready",
            "--workers",
            "2",
            "--timeout",
            "60",
            url=f"http://127.0.0.1:{port}",
            env={**env, "MESHKEEPER_TOKEN_FILE": str(token)},
        )
        assert r.returncode == 0, r.stderr
        kids = psutil.Process(up.pid).children(recursive=True)
        # the controller and two agents, plus redis-server unless REDIS_URL names one
        assert len(kids) == (4 if own_redis else 3), kids
        logs = {p.name for p in (tmp_path / "run" / "logs").iterdir()}
        assert {"controller.log", "worker-w0.log", "worker-w1.log"} <= logs
        assert ("redis.log" in logs) == own_redis
        # `ready` can answer before `up` has printed its summary: read up to it before stopping
        printed = []
        while not any("export MESHKEEPER_URL" in line for line in printed):
            line = up.stdout.readline()
            assert line, f"up ended before printing its exports: {''.join(printed)}"
            printed.append(line)
        up.send_signal(signal.SIGTERM)
        rest, _ = up.communicate(timeout=30)
        out = "".join(printed) + rest
        assert up.returncode == 0, out
        assert "Traceback" not in out
        assert f"export MESHKEEPER_URL=http://127.0.0.1:{port} MESHKEEPER_TOKEN_FILE={token}" in out
        secrets = [p.read_text().strip() for p in token.parent.iterdir() if p.name != "auth.json"]
        assert not [s for s in secrets if s in out]  # it says where the secrets are, never what
        wait_until(lambda: not alive(kids), 10, f"every process of the stack ({kids}) to exit")
    finally:
        if up.poll() is None:
            os.kill(up.pid, signal.SIGKILL)
            up.wait()
