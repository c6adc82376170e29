"""What a local user without the stack's secrets can read of a running `meshkeeper up`
(docs/security.md, "Threats"): no secret on any process's command line (`ps` shows every
user's), and no secret file, users file or run directory open to others, even after Redis
rewrote its users file (ACL SAVE at every agent's join)."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.procs import free_port
from tests.chaos.upstack import UpStack
from tests.stack import ENV, ROOT, tiny_spec, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> UpStack:
    s = UpStack(tmp_path_factory.mktemp("up-secrets") / "run", free_port(), 1)
    try:
        s.wait_ready(1)
        yield s
    finally:
        s.close()


def secrets_of(run: Path) -> dict[str, str]:
    """Every secret `up` generated: file name -> its text (tokens, Redis passwords)."""
    out = {}
    for f in (run / "secrets").iterdir():
        if f.is_file() and f.suffix != ".json":  # auth.json holds only hashes
            out[f.name] = f.read_text().strip()
    assert {"api-token", "join-token", "redis-admin-password"} <= set(out), sorted(out)
    return out


def command_lines() -> dict[int, str]:
    """Every process's command line, as any local user reads it."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:  # exited meanwhile
                pass
    return out


def test_no_secret_is_on_any_command_line_while_a_job_trains(up):
    job = up.client.submit(tiny_spec("argv-scan", parallel={"dp": 1}, train={"steps": 400}))
    try:
        wait_until(lambda: any(r.pid for r in up.client.job(job.id).mesh.ranks), 120, "a trainer")
        trainer = up.client.job(job.id).mesh.ranks[0].pid
        lines = command_lines()
        # what the scan must cover: redis-server, the controller, the agent, the trainer
        for what in ("redis-server", "-m controller", "-m worker"):
            assert any(what in line for line in lines.values()), f"no {what} process"
        assert trainer in lines, (trainer, "the trainer is not running")
        leaks = {
            (name, pid)
            for name, value in secrets_of(up.work).items()
            for pid, line in lines.items()
            if value in line
        }
        assert not leaks, f"secrets on command lines: {leaks}"
    finally:
        up.client.cancel(job.id)


def test_secrets_the_users_file_and_the_run_dir_are_the_owners_alone(up):
    run = up.work
    users = run / "redis" / "users.acl"
    # the agent's join rewrote the users file (ACL SAVE): its agent user is in it
    assert "user agent-w0 " in users.read_text()
    for path in [run, run / "secrets", users, *(run / "secrets").iterdir()]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}: others may read it"


def test_a_password_on_the_controllers_command_line_is_refused(tmp_path):
    """The controller will not start with a password where `ps` shows it, and says where the
    URL goes instead."""
    for flag in ("--redis-url", "--agent-redis-url"):
        r = subprocess.run(
            [sys.executable, "-m", "controller", flag, "redis://controller:s3cret@127.0.0.1:9/0"],
            cwd=ROOT,
            env={k: v for k, v in ENV.items() if k != "REDIS_URL"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, (flag, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and "s3cret" not in r.stderr, r.stderr
        assert f"{flag} holds a password" in r.stderr and "--redis-url-file" in r.stderr, r.stderr


def test_the_api_answers_only_its_own_host_names(up):
    """A web page on another name that resolves to 127.0.0.1 (DNS rebinding) reaches the
    port but is refused by name, token or not; the names `up` binds answer."""
    port = up.url.rsplit(":", 1)[1]
    auth = {"Authorization": f"Bearer {up.token}"}
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        r = httpx.get(up.url + "/v1/jobs", headers={**auth, "Host": host})
        assert r.status_code == 400, (host, r.status_code)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        assert httpx.get(up.url + "/v1/jobs", headers={**auth, "Host": host}).status_code == 200
