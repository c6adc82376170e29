"""deploy/k8s: the kustomize base matches the chart, and every file and every build passes
kubernetes-validate --strict."""

from __future__ import annotations

import deploytools as dt
import yaml

KUSTOMIZATIONS = sorted(p.parent for p in dt.K8S.rglob("kustomization.yaml"))


def test_base_is_the_chart_rendered():
    want = dt.k8s_base()
    have = {p.name: p.read_text() for p in (dt.K8S / "base").glob("*.yaml")}
    stale = sorted(set(want) ^ set(have) | {n for n in want if want[n] != have.get(n)})
    assert not stale, (
        f"deploy/k8s/base is stale ({stale}): run python tests/deploy/deploytools.py --write"
    )


def test_every_manifest_file_passes_kubernetes_validate_strict():
    files = [p for p in sorted(dt.K8S.rglob("*.yaml")) if p.name != "kustomization.yaml"]
    assert len(files) > 5
    assert not dt.kubernetes_validate(files)


def test_every_kustomization_builds_and_validates(tmp_path):
    kubectl = dt.tool("kubectl")
    assert {p.name for p in KUSTOMIZATIONS} >= {"base", "example"}
    for k in KUSTOMIZATIONS:
        out = dt.run(kubectl, "kustomize", str(k))
        assert out.returncode == 0, out.stderr
        built = tmp_path / f"{k.name}.yaml"
        built.write_text(out.stdout)
        assert not dt.kubernetes_validate([built]), k


def test_example_overlay_moves_everything_into_its_namespace():
    out = dt.run(dt.tool("kubectl"), "kustomize", str(dt.K8S / "overlays" / "example"))
    assert out.returncode == 0, out.stderr
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    cluster_scoped = {"Namespace", "CustomResourceDefinition"}
    for o in objs:
        if o["kind"] not in cluster_scoped:
            assert o["metadata"].get("namespace") == "ml-training", o["metadata"]["name"]
        for s in o.get("subjects", []):
            assert s["namespace"] == "ml-training", "RoleBinding subject left in another namespace"
    worker = next(
        o
        for o in objs
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "meshkeeper-worker"
    )
    c = worker["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"].endswith("-cuda")


def test_the_validator_reports_typos_and_unknown_kinds(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {portz: []}\n---\n"
        "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: y}\n"
    )
    problems = dt.kubernetes_validate([bad])
    assert any("portz" in p for p in problems) and any("Widget" in p for p in problems), problems


def test_the_base_carries_no_secret_and_names_the_one_to_create():
    """Plain manifests in git hold no credentials: every pod reads the Secret
    meshkeeper-auth that docs/deploy.md says how to create."""
    objs = [
        d
        for p in sorted((dt.K8S / "base").glob("*.yaml"))
        for d in yaml.safe_load_all(p.read_text())
        if d
    ]
    assert not [o for o in objs if o["kind"] == "Secret"]
    refs = {
        (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"].get("initContainers", [])
        + o["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert {name for name, _ in refs} == {dt.BASE_VALUES["auth"]["existingSecret"]}
    assert {key for _, key in refs} == {
        "api-token",
        "scrape-token",
        "join-token",
        "redis-admin-password",
        "redis-controller-password",
        "redis-provisioner-password",
    }
    docs = (dt.REPO / "docs" / "deploy.md").read_text()
    assert f"create secret generic {dt.BASE_VALUES['auth']['existingSecret']}" in docs
    command = docs[docs.index("create secret generic") :].split("```")[0]
    assert all(key in command for _, key in refs), "the command must create every key"
    policies = {o["metadata"]["name"] for o in objs if o["kind"] == "NetworkPolicy"}
    assert policies == {f"meshkeeper-{c}" for c in ("controller", "worker", "redis", "operator")}
