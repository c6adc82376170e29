"""API authentication against a real controller process (auth file of sha256 hashes, real
redis-server, real HTTP): every route refuses a missing or wrong token (401) and the wrong
role (403); submitters cancel only their own jobs; the controller refuses to start without an
admin token; the CLI reads MESHKEEPER_TOKEN(_FILE); HTTPS with a self-signed certificate."""

from __future__ import annotations

import json
import ssl
import stat
import subprocess
import sys

import httpx
import pytest

from services.client import ApiError, Client
from services.procs import free_port, stop_all
from services.tokens import new_token, write_auth_file
from tests.stack import (
    ENV,
    ROOT,
    ApiStack,
    Proc,
    TestSecrets,
    controller_argv,
    self_signed_cert,
    tiny_spec,
    wait_until,
)

ROLES = ("viewer", "submitter", "admin", "scrape")
READ, SUBMIT, ADMIN = {"viewer", "submitter", "admin"}, {"submitter", "admin"}, {"admin"}
METRICS = READ | {"scrape"}
JOIN: set[str] = set()  # the agents' join token only, no API role
# every operation of the API and who may call it; a new route must be added here (see below)
ALLOWED = {
    ("GET", "/v1/jobs"): READ,
    ("POST", "/v1/jobs"): SUBMIT,
    ("GET", "/v1/jobs/{job_id}"): READ,
    ("DELETE", "/v1/jobs/{job_id}"): SUBMIT,
    ("POST", "/v1/jobs/{job_id}/suspend"): SUBMIT,
    ("POST", "/v1/jobs/{job_id}/resume"): SUBMIT,
    ("GET", "/v1/jobs/{job_id}/events"): READ,
    ("GET", "/v1/jobs/{job_id}/logs"): READ,
    ("GET", "/v1/jobs/{job_id}/history"): READ,
    ("GET", "/v1/workers"): READ,
    ("GET", "/v1/agent/bootstrap"): ADMIN,
    ("GET", "/metrics"): METRICS,
    ("GET", "/v1/sd/workers"): METRICS,
    ("POST", "/v1/agents/join"): JOIN,
    ("POST", "/v1/plan"): READ,
}
OPEN = {("GET", "/healthz"), ("GET", "/readyz")}
JOIN_BODY = {
    "id": "w-auth-test",
    "host": "h",
    "address": "127.0.0.1",
    "devices": 1,
    "memory_bytes": 1 << 30,
    "device_kind": "cpu",
    "pid": 1,
}


@pytest.fixture(scope="module")
def job(api) -> str:
    """A job of the admin's (nothing runs it: no agents), cancelled at the end."""
    with api.controller.client() as c:
        jid = c.submit(tiny_spec("auth-target")).id
        yield jid
        if c.job(jid).phase not in ("Cancelled", "Failed", "Succeeded"):
            c.cancel(jid)


def token_of(secrets: TestSecrets, role: str) -> str:
    return getattr(secrets, f"{role}_token")


def call(api: ApiStack, method: str, path: str, job: str, token: str | None) -> httpx.Response:
    body = {
        "POST /v1/jobs": tiny_spec("auth-probe"),
        "POST /v1/agents/join": JOIN_BODY,
        "POST /v1/plan": {"spec": tiny_spec("auth-plan"), "workers": 2, "device": "cpu"},
    }.get(f"{method} {path}")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(
        method, api.url + path.replace("{job_id}", job), json=body, headers=headers, timeout=10
    )


def test_every_route_is_classified(api):
    """Each operation the controller serves is in ALLOWED or OPEN, so none escapes the tests
    below."""
    doc = httpx.get(api.url + "/openapi.json").json()
    served = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert served - ALLOWED.keys() - OPEN == set()
    for method, path in served - OPEN:
        assert doc["paths"][path][method.lower()].get("security"), (
            f"{method} {path} declares no bearer auth"
        )


@pytest.mark.parametrize(
    "method,path", sorted(ALLOWED), ids=[f"{m} {p}" for m, p in sorted(ALLOWED)]
)
def test_no_token_wrong_token_and_wrong_role_are_refused(api, job, method, path):
    missing = call(api, method, path, job, None)
    assert missing.status_code == 401, missing.text
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    assert "bearer token" in missing.json()["detail"]
    wrong = call(api, method, path, job, api.secrets.admin_token + "x")
    assert wrong.status_code == 401, wrong.text
    assert 'error="invalid_token"' in wrong.headers["WWW-Authenticate"]
    for role in set(ROLES) - ALLOWED[(method, path)]:
        r = call(api, method, path, job, token_of(api.secrets, role))
        # an API token is no join token: 401 there; elsewhere a valid token of the wrong role
        assert r.status_code == (403 if ALLOWED[(method, path)] else 401), (role, r.text)
        assert set(r.json()) == {"detail", "problems"}
        if r.status_code == 403:
            assert f"role {role}" in r.json()["detail"]


@pytest.mark.parametrize(
    "method,path",
    sorted(k for k in ALLOWED if k[0] == "GET"),
    ids=[f"{m} {p}" for m, p in sorted(ALLOWED) if m == "GET"],
)
def test_every_allowed_role_reads(api, job, method, path):
    for role in ALLOWED[(method, path)]:
        r = call(api, method, path, job, token_of(api.secrets, role))
        assert r.status_code == 200, (role, r.text)


def test_health_and_the_page_shell_are_open(api):
    for path in ("/healthz", "/readyz", "/ui/", "/ui/mesh.js"):
        assert httpx.get(api.url + path).status_code == 200, path


def test_submitters_own_their_jobs_and_cancel_only_those(api, job):
    with (
        api.controller.client(api.secrets.submitter_token) as mine,
        api.controller.client(api.secrets.viewer_token) as viewer,
    ):
        own = mine.submit(tiny_spec("owned")).id
        assert mine.job(own).owner == "submitter"
        assert [j.owner for j in viewer.jobs() if j.id == own] == ["submitter"]
        with pytest.raises(ApiError) as e:
            mine.cancel(job)  # the admin's job
        assert e.value.status == 403 and "belongs to admin" in str(e.value)
        with pytest.raises(ApiError) as e:
            viewer.cancel(own)
        assert e.value.status == 403
        assert mine.cancel(own).cancel_requested
    with api.controller.client() as admin:
        other = admin.submit(tiny_spec("admins")).id
        assert admin.job(other).owner == "admin"
        assert admin.cancel(other).cancel_requested


def test_submitters_suspend_and_resume_only_their_own_jobs(api, job):
    """A pending job (no agents here) is suspended in place and queues again on resume;
    another owner's job cannot be, and an ended one answers 409."""
    with api.controller.client(api.secrets.submitter_token) as mine:
        own = mine.submit(tiny_spec("suspended-own")).id
        for act in (mine.suspend, mine.resume):
            with pytest.raises(ApiError) as e:
                act(job)  # the admin's job
            assert e.value.status == 403 and "belongs to admin" in str(e.value)
        assert mine.suspend(own).suspend_requested
        wait_until(lambda: mine.job(own).phase == "Suspended", 10, "the pending job suspended")
        assert mine.job(own).condition("Suspended").reason == "Suspended"
        assert not mine.resume(own).suspend_requested
        wait_until(lambda: mine.job(own).phase == "Pending", 10, "the job queued again")
        with pytest.raises(ApiError, match="not suspended; nothing to resume") as e:
            mine.resume(own)
        assert e.value.status == 409
        mine.cancel(own)
        wait_until(lambda: mine.job(own).phase == "Cancelled", 10, "the job cancelled")
        with pytest.raises(ApiError, match="already Cancelled") as e:
            mine.suspend(own)
        assert e.value.status == 409


def test_a_submitter_may_not_take_a_class_that_preempts_other_jobs(api):
    """`high` stops other people's running jobs: with the built-in classes it is the admins'.
    A submitter asking for it gets 403 naming priority.class, and nothing is stored; `low`
    and `default` are open to it."""
    with api.controller.client(api.secrets.submitter_token) as mine:
        before = {j.id for j in mine.jobs()}
        with pytest.raises(ApiError) as e:
            mine.submit(tiny_spec("jump-the-queue", priority={"class": "high"}))
        assert e.value.status == 403, e.value
        (problem,) = e.value.problems
        assert problem.field == "priority.class" and "open to admins" in problem.message
        assert {j.id for j in mine.jobs()} == before
        low = mine.submit(tiny_spec("humble", priority={"class": "low"})).id
        mine.cancel(low)
    with api.controller.client() as admin:
        admin.cancel(admin.submit(tiny_spec("urgent", priority={"class": "high"})).id)


def test_the_auth_file_holds_only_hashes_and_is_private(api):
    text = api.secrets.auth_file.read_text()
    assert stat.S_IMODE(api.secrets.auth_file.stat().st_mode) == 0o600
    for role in ROLES:
        assert token_of(api.secrets, role) not in text
    assert {t["role"] for t in json.loads(text)["tokens"]} == set(ROLES)


def start_controller(*args: str) -> subprocess.CompletedProcess:
    """A controller that is expected to refuse to start (it never reaches Redis)."""
    argv = [
        sys.executable,
        "-m",
        "controller",
        "--port",
        str(free_port()),
        "--redis-url",
        "redis://127.0.0.1:9/0",
        *args,
    ]
    env = {k: v for k, v in ENV.items() if not k.startswith("MESHKEEPER_")}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_a_controller_without_an_admin_token_refuses_to_start(tmp_path):
    r = start_controller()
    assert r.returncode == 2 and "Traceback" not in r.stderr
    for hint in ("--auth-file", "MESHKEEPER_API_TOKEN", "meshkeeper up", "--insecure-no-auth"):
        assert hint in r.stderr, r.stderr
    viewer_only = tmp_path / "viewer.json"
    write_auth_file(viewer_only, [("v", "viewer", new_token())])
    r = start_controller("--auth-file", str(viewer_only))
    assert r.returncode == 2 and "no admin token" in r.stderr
    broken = tmp_path / "broken.json"
    broken.write_text('{"tokens": [{"name": "a", "role": "root", "sha256": "00"}]}')
    r = start_controller("--auth-file", str(broken))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"auth file {broken}: tokens[0]" in r.stderr and "'root'" in r.stderr, r.stderr


def test_insecure_no_auth_is_loud_and_open(api):
    port = free_port()
    env = {k: v for k, v in ENV.items() if not k.startswith("MESHKEEPER_")}
    proc = subprocess.Popen(
        # a standby replica
        controller_argv(port, api.redis, api.secrets.auth_file.parent, "--insecure-no-auth"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # stop_all signals its process group
    try:
        url = f"http://127.0.0.1:{port}"
        with Client(url, timeout=2) as c:
            wait_until(c.ready, 30, "the insecure controller")
            assert c.workers() == []  # no token, and yet an answer
    finally:
        stop_all([proc], 5)
    assert "--insecure-no-auth: EVERY request is admin" in proc.stdout.read()


def cli(*args: str, url: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in ENV.items() if not k.startswith("MESHKEEPER_")}
    return subprocess.run(
        [sys.executable, "-m", "cli", "--url", url, *args],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cli_reads_its_token_from_env_or_a_file(api, tmp_path):
    none = cli("workers", url=api.url)
    assert none.returncode == 1 and none.stderr.count("\n") == 1, none.stderr
    assert "needs a bearer token" in none.stderr and "MESHKEEPER_TOKEN" in none.stderr
    assert cli("workers", url=api.url, MESHKEEPER_TOKEN=api.secrets.viewer_token).returncode == 0
    f = tmp_path / "token"
    f.write_text(api.secrets.viewer_token + "\n")
    assert cli("workers", url=api.url, MESHKEEPER_TOKEN_FILE=str(f)).returncode == 0
    gone = cli("workers", url=api.url, MESHKEEPER_TOKEN_FILE=str(tmp_path / "nope"))
    assert (
        gone.returncode == 1
        and "MESHKEEPER_TOKEN_FILE=" in gone.stderr
        and "Traceback" not in gone.stderr
    )
    wrong = cli(
        "submit",
        str(ROOT / "examples" / "tiny-1d.yaml"),
        url=api.url,
        MESHKEEPER_TOKEN=api.secrets.viewer_token,
    )
    assert wrong.returncode == 1 and "needs submitter or admin" in wrong.stderr, wrong.stderr


def test_https_with_a_self_signed_certificate(api, tmp_path):
    """--tls-cert/--tls-key serve HTTPS (uvicorn); a client that trusts the cert gets in with
    its token, and the plain-HTTP port answers nothing useful."""
    cert, key = self_signed_cert(tmp_path)
    port = free_port()
    proc = Proc(
        "tls-controller",
        controller_argv(
            port,
            api.redis,
            api.secrets.auth_file.parent,
            *("--auth-file", str(api.secrets.auth_file), "--tls-cert", str(cert)),
            *("--tls-key", str(key)),
        ),
        tmp_path,
    )
    try:
        url = f"https://127.0.0.1:{port}"
        trusting = ssl.create_default_context(cafile=str(cert))
        with Client(url, api.secrets.viewer_token, timeout=2, verify=trusting) as c:
            wait_until(lambda: c.ready() or not proc.alive(), 30, "the HTTPS controller")
            assert proc.alive(), proc.tail()
            assert c.workers() == []
        with Client(url, api.secrets.viewer_token, timeout=2) as untrusting:
            with pytest.raises(ApiError):
                untrusting.workers()  # the system CAs do not vouch for a self-signed cert
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        cli_env = {"SSL_CERT_FILE": str(cert), "MESHKEEPER_TOKEN": api.secrets.viewer_token}
        assert cli("workers", url=url, **cli_env).returncode == 0  # the CLI trusts SSL_CERT_FILE
    finally:
        proc.stop(5)


def test_tls_needs_both_files(tmp_path):
    r = start_controller("--tls-cert", str(tmp_path / "c.pem"))
    assert r.returncode == 2 and "--tls-cert and --tls-key go together" in r.stderr


def test_env_tokens_are_hashed_at_load():
    from controller.auth import Auth

    auth = Auth.load(
        None,
        {
            "MESHKEEPER_API_TOKEN": "a" * 43,
            "MESHKEEPER_SCRAPE_TOKEN": "s" * 43,
            "MESHKEEPER_JOIN_TOKEN": "j" * 43,
        },
    )
    assert all("a" * 43 not in t.sha256 for t in auth.tokens)
    assert [(p.name, p.role) for p in map(auth.identify, ("a" * 43, "s" * 43))] == [
        ("admin", "admin"),
        ("prometheus", "scrape"),
    ]
    assert auth.identify("j" * 43) is None and auth.join_ok("j" * 43) and not auth.join_ok("a" * 43)
    assert auth.identify("") is None and auth.identify(None) is None


def test_every_change_is_audited_with_who_made_it(api):
    """A cancel names the token's owner and role (never the token), a refused one too, and
    an unauthenticated attempt says so; reads are not logged."""
    with api.controller.client(api.secrets.submitter_token) as mine:
        own = mine.submit(tiny_spec("audited")).id
        with api.controller.client(api.secrets.viewer_token) as viewer, pytest.raises(ApiError):
            viewer.cancel(own)
        mine.cancel(own)
        mine.job(own)
    httpx.delete(f"{api.url}/v1/jobs/{own}", timeout=10)
    want = [
        "POST /v1/jobs by submitter (submitter) from 127.0.0.1: 201",
        f"DELETE /v1/jobs/{own} by viewer (viewer) from 127.0.0.1: 403",
        f"DELETE /v1/jobs/{own} by submitter (submitter) from 127.0.0.1: 202",
        f"DELETE /v1/jobs/{own} by an unauthenticated caller from 127.0.0.1: 401",
    ]
    log = wait_until(
        lambda: all(w in (t := api.controller.proc.tail(10**8)) for w in want) and t,
        10,
        "the audit lines",
    )
    assert f"GET /v1/jobs/{own} by" not in log
    for secret in (api.secrets.submitter_token, api.secrets.viewer_token):
        assert secret not in log
