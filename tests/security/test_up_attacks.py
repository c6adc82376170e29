"""Issue 49's attacks on a real `meshkeeper up` (docs/security.md, "Threats"), each with the
credential its attacker would hold, read from the stack's own run dir: never the admin's.

- A local user without the stack's secrets: no secret on any process's command line (`ps`
  shows every user's), no secret file, users file or run directory open to others, even
  after Redis rewrote its users file (ACL SAVE at every agent's join).
- The controller's Redis password (what a leaked `REDIS_URL` gives): no user made, no server
  reconfigured, nobody cut off.
- The join token: no live worker taken over.
- One agent's own Redis password: no shared key, no other job's pointer or stream; its own
  registration made malformed takes out that worker alone.
- A viewer's token: no write.
- A submitter's token: no week-long quarantine of shared workers, no name or path that
  breaks the API, no body read before its token is checked, no connection held open.

The same attacks, each in depth, have modules of their own on a bare controller
(test_controller_redis, test_agents_redis, test_pointer_grants, test_poisoned_state,
test_tenant_limits, test_http_input, test_slow_clients)."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
import redis

from controller.app import MAX_BODY
from services.procs import free_port
from services.redis_url import with_credentials
from services.store import Keys, agent_user
from tests.chaos.upstack import UpStack
from tests.security.test_agents_redis import join, raw
from tests.security.test_controller_redis import ESCALATIONS
from tests.security.test_http_input import headers_only
from tests.security.test_slow_clients import DEADLINE_S, MARGIN_S, closed_after
from tests.stack import ENV, ROOT, tiny_spec, wait_phase, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> UpStack:
    s = UpStack(tmp_path_factory.mktemp("up-attacks") / "run", free_port(), 2)
    try:
        s.wait_ready(2)
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


def redis_as(up: UpStack, user: str, password: str) -> redis.Redis:
    """A connection to the stack's redis-server as `user`, on the port it listens on."""
    (port,) = {
        c.laddr.port
        for c in psutil.Process(up.redis_pid()).net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }
    base = f"redis://127.0.0.1:{port}/0"
    return raw(with_credentials(base, user, password))


def test_the_controllers_redis_password_cannot_escalate(up):
    password = secrets_of(up.work)["redis-controller-password"]
    with redis_as(up, "controller", password) as r:
        assert r.ping()  # logged in: what follows is refused by its rights alone
        allowed = []
        for command in ESCALATIONS:
            try:
                r.execute_command(*command)
                allowed.append(command)
            except redis.exceptions.NoPermissionError:
                pass
        assert not allowed, allowed
    admin = redis_as(up, "admin", secrets_of(up.work)["redis-admin-password"])
    with admin:
        assert "attacker" not in admin.acl_users() and admin.ping()


def test_the_join_token_cannot_take_over_a_live_worker(up):
    """w0's registration and Redis password stay its own, and it goes on beating."""
    with redis_as(up, "admin", secrets_of(up.work)["redis-admin-password"]) as admin:
        joined = admin.hget(Keys().worker("w0"), "joined_at")
        passwords = admin.acl_getuser(agent_user("w0"))["passwords"]
        r = join(SimpleNamespace(url=up.url), "w0", secrets_of(up.work)["join-token"])
        assert r.status_code == 409, r.text
        assert "held by a live agent" in r.json()["detail"], r.text
        assert admin.hget(Keys().worker("w0"), "joined_at") == joined
        assert admin.acl_getuser(agent_user("w0"))["passwords"] == passwords
    assert {w.id: w.alive for w in up.client.workers()}["w0"]


def submitter(up: UpStack) -> httpx.Client:
    token = secrets_of(up.work)["submitter-token"]
    return httpx.Client(base_url=up.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        (
            {"fault_tolerance": {"quarantine_s": 604800}},  # a shared worker out for a week
            "fault_tolerance.quarantine_s",
        ),
        ({"name": "nl\n"}, "name"),  # no call, not even admin's, could reach it after
        ({"data": {"source": "text:/data/a\x00b"}}, "data.source"),
    ],
)
def test_a_submitter_cannot_hurt_the_pool_or_the_api(up, section, field):
    with submitter(up) as c:
        r = c.post("/v1/jobs", json={**tiny_spec("tenant"), **section})
    assert r.status_code == 422, r.text
    assert field in [p["field"] for p in r.json()["problems"]], r.text
    assert not [j for j in up.client.jobs() if j.name == "tenant"]  # nothing stored


def test_the_viewer_token_writes_nothing(up):
    token = secrets_of(up.work)["viewer-token"]
    job = up.client.submit(tiny_spec("viewed", parallel={"dp": 1}, train={"steps": 400})).id
    try:
        with httpx.Client(
            base_url=up.url, headers={"Authorization": f"Bearer {token}"}, timeout=10
        ) as viewer:
            assert viewer.get(f"/v1/jobs/{job}").status_code == 200  # it reads
            for r in (
                viewer.post("/v1/jobs", json=tiny_spec("by-viewer")),
                viewer.delete(f"/v1/jobs/{job}"),
                viewer.post(f"/v1/jobs/{job}/suspend"),
            ):
                assert r.status_code == 403, (r.request.url, r.status_code, r.text)
        assert up.client.job(job).phase in ("Pending", "Running")
        assert not [j for j in up.client.jobs() if j.name == "by-viewer"]
    finally:
        up.client.cancel(job)


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/agents/join", "/v1/plan"])
def test_no_body_is_read_before_its_token_is_checked(up, path):
    """Headers alone, no token: 50 MB promised is refused by size, half the limit by the
    missing token; neither waits for the bytes."""
    stack = SimpleNamespace(url=up.url)
    assert headers_only(stack, path, 50 * MAX_BODY).startswith(b"HTTP/1.1 413")
    assert headers_only(stack, path, MAX_BODY // 2).startswith(b"HTTP/1.1 401")


def test_a_slow_client_is_cut_off(up):
    header = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # and never the blank line
    assert closed_after(up.url, header) <= DEADLINE_S + MARGIN_S


def test_one_agents_own_password_cannot_stop_scheduling_or_reach_another_job(up):
    """Last in the module: the attacker's worker stays out of placement afterwards. A job
    trains on one worker; the other worker's agent, with its own Redis password, is refused
    every shared key and the job's pointer and streams, and the registration it makes
    malformed takes only itself out: the next job is placed on the victim's worker."""
    victim = up.client.submit(tiny_spec("victim", parallel={"dp": 1}, train={"steps": 400})).id
    ranks = wait_until(lambda: up.client.job(victim).mesh.ranks, 120, "the victim placed")
    attacker = "w1" if ranks[0].worker == "w0" else "w0"
    keys = Keys()  # `up`'s prefix
    password = (up.work / "workers" / attacker / "credential").read_text().strip()
    with redis_as(up, agent_user(attacker), password) as r:
        attacks = {
            "SET workers:seen": lambda: r.set(keys.workers_seen(), "x"),
            "SET the job's events": lambda: r.set(keys.job_events(victim), "x"),
            "XADD the job's events": lambda: r.xadd(keys.job_events(victim), {"reason": "x"}),
            "HSET the job's pointer": lambda: r.hset(
                keys.job_checkpoint(victim), mapping={"generation": 999999, "step": 1}
            ),
        }
        allowed = []
        for what, attack in attacks.items():
            try:
                attack()
                allowed.append(what)
            except redis.exceptions.NoPermissionError:
                pass
        assert not allowed, allowed
        r.hset(keys.worker(attacker), mapping={"devices": "abc", "labels": '"x"'})
    up.client.cancel(victim)
    wait_phase(up.client, victim, ("Cancelled",), 60)
    after = up.client.submit(tiny_spec("after-poison", parallel={"dp": 1})).id
    placed = wait_until(lambda: up.client.job(after).mesh.ranks, 60, "the next job placed")
    assert [rank.worker for rank in placed] == [ranks[0].worker], placed
    assert {w.id for w in up.client.workers()} >= {"w0", "w1"}  # 200, the poisoned one too
    assert httpx.get(up.url + "/readyz", timeout=5).status_code == 200
    up.client.cancel(after)
