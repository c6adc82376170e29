"""The Helm chart: lint, render, schema, kubernetes-validate --strict, and the promises of
DESIGN.md section 9 and issue 7 read off the rendered objects."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
import yaml

import deploytools as dt

CASES = dt.ci_values()
STANDARD_LABELS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                   "app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by"}


def objects(values=None, **kw) -> list[dict]:
    return [d for text in dt.render(values, **kw).values() for d in dt.docs(text)]


def one(objs, kind, suffix):
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"expected one {kind} *{suffix}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(deployment) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("case", CASES)
def test_chart_lints(case):
    report = dt.helm().lint(str(dt.CHART), CASES[case], strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("case", CASES)
def test_rendered_manifests_pass_kubernetes_validate_strict(case, tmp_path):
    rendered = dt.render(CASES[case])
    paths = []
    for template, text in rendered.items():
        path = tmp_path / template.replace("/", "_")
        path.write_text(text)
        paths.append(path)
    paths += sorted((dt.CHART / "crds").glob("*.yaml"))
    assert not dt.kubernetes_validate(paths)


@pytest.mark.parametrize("values, where", [
    ({"worker": {"replicaz": 3}}, "replicaz"),
    ({"controler": {"replicas": 2}}, "controler"),
    ({"metrics": {"serviceMonitor": {"enable": True}}}, "enable"),
    ({"worker": {"image": {"variant": "rocm"}}}, "variant"),
])
def test_schema_rejects_misspelt_or_invalid_values(values, where):
    helm = dt.helm()
    with helm.Chart.load(str(dt.CHART)) as chart, pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(values)
    with pytest.raises(helm.HelmValuesError, match=where):
        dt.render(values)


def test_every_object_carries_the_standard_labels():
    for case, values in CASES.items():
        for o in objects(values):
            missing = STANDARD_LABELS - set(o["metadata"].get("labels", {}))
            assert not missing, f"{case}: {o['kind']}/{o['metadata']['name']} lacks {missing}"


def test_controller_probes_and_pdb_only_with_replicas():
    objs = objects()
    c = container(one(objs, "Deployment", "-controller"))
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert not [o for o in objs if o["kind"] == "PodDisruptionBudget" and "controller" in o["metadata"]["name"]]
    pdb = one(objects({"controller": {"replicas": 2}}), "PodDisruptionBudget", "-controller")
    assert pdb["spec"]["minAvailable"] == 1


@pytest.mark.parametrize("case", CASES)
def test_workers_have_a_startup_probe_and_never_a_liveness_probe(case):
    c = container(one(objects(CASES[case]), "Deployment", "-worker"))
    assert "livenessProbe" not in c, "a liveness probe would kill a training pod stuck in a collective"
    assert c["startupProbe"]["httpGet"]["port"] == "metrics"
    env = {e["name"]: e.get("value") for e in c["env"]}
    # the agent binds 127.0.0.1 by default: the kubelet and Prometheus could not reach it
    assert env["MESHKEEPER_METRICS_HOST"] == "0.0.0.0"
    assert env["MESHKEEPER_ADDRESS"] == "$(MESHKEEPER_POD_IP)"


def test_gpu_values_reach_the_worker_pod():
    objs = objects(CASES["gpu-values.yaml"])
    worker = one(objs, "Deployment", "-worker")
    pod, c = worker["spec"]["template"]["spec"], container(worker)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["image"].endswith("-cuda")
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "nvidia.com/gpu" not in str(container(one(objects(), "Deployment", "-worker"))["resources"])


def test_rbac_is_namespaced_and_minimal():
    objs = objects()
    assert not [o for o in objs if o["kind"].startswith("Cluster")]
    rules = {o["metadata"]["name"]: o["rules"] for o in objs if o["kind"] == "Role"}
    assert set(rules) == {"mk-meshkeeper-controller", "mk-meshkeeper-operator"}
    for rule in sum(rules.values(), []):
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
    pods = [r for r in rules["mk-meshkeeper-controller"] if "pods" in r["resources"]]
    assert pods == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "delete"]}]
    assert not [r for r in rules["mk-meshkeeper-operator"] if "pods" in r["resources"]]
    worker_pod = one(objs, "Deployment", "-worker")["spec"]["template"]["spec"]
    assert worker_pod["automountServiceAccountToken"] is False
    none = objects(CASES["external-redis-values.yaml"])
    assert not [o for o in none if o["kind"] in ("Role", "RoleBinding")]


def test_external_redis_url_lives_in_a_secret():
    objs = objects(CASES["external-redis-values.yaml"])
    assert not [o for o in objs if o["kind"] == "StatefulSet"]
    secret = one(objs, "Secret", "-redis-url")
    assert secret["stringData"]["redis-url"].startswith("rediss://")
    env = {e["name"]: e for e in container(one(objs, "Deployment", "-controller"))["env"]}
    assert "secretKeyRef" in env["MESHKEEPER_REDIS_URL"]["valueFrom"]
    assert "s3cret" not in json.dumps([o for o in objs if o["kind"] != "Secret"])


def test_contradictory_redis_settings_fail_with_the_fix():
    helm = dt.helm()
    with pytest.raises(helm.HelmRenderError, match="set externalRedis.url"):
        dt.render({"redis": {"enabled": False}})
    with pytest.raises(helm.HelmRenderError, match="redis.enabled=false"):
        dt.render({"externalRedis": {"url": "redis://elsewhere:6379/0"}})


def test_redis_runs_with_aof_and_a_volume():
    sts = one(objects(), "StatefulSet", "-redis")
    args = container(sts)["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_checkpoint_claim_is_shared_and_kept():
    objs = objects()
    pvc = one(objs, "PersistentVolumeClaim", "-checkpoints")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    vols = one(objs, "Deployment", "-worker")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}} in vols
    existing = objects(CASES["external-redis-values.yaml"])
    assert not [o for o in existing if o["kind"] == "PersistentVolumeClaim"]


def test_service_monitors_select_a_service_port():
    objs = objects(CASES["ha-monitoring-values.yaml"])
    monitors = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    services = [o for o in objs if o["kind"] == "Service"]
    for m in monitors:
        wanted = m["spec"]["selector"]["matchLabels"]
        hits = [s for s in services if wanted.items() <= s["metadata"]["labels"].items()]
        assert len(hits) == 1, f"{m['metadata']['name']} selects {len(hits)} services"
        assert m["spec"]["endpoints"][0]["port"] in {p["name"] for p in hits[0]["spec"]["ports"]}
        assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_prometheus_rule_carries_the_deploy_rule_groups(tmp_path):
    helm = dt.helm()
    bare = dt.copy_chart(tmp_path / "a")
    shutil.rmtree(bare / "files" / "prometheus" / "rules")  # the shipped alert rules
    with pytest.raises(helm.HelmRenderError, match="no rule groups"):
        dt.render({"metrics": {"prometheusRule": {"enabled": True}}}, chart=bare)
    chart = dt.copy_chart(tmp_path / "b")
    group = {"name": "extra", "rules": [{"alert": "RankDead", "expr": "meshkeeper_ranks{state=\"dead\"} > 0"}]}
    (chart / "files" / "prometheus" / "rules").mkdir(exist_ok=True)
    (chart / "files" / "prometheus" / "rules" / "test.yml").write_text(yaml.safe_dump({"groups": [group]}))
    rule = one(objects({"metrics": {"prometheusRule": {"enabled": True}}}, chart=chart), "PrometheusRule", "")
    shipped = yaml.safe_load((dt.REPO / "deploy" / "prometheus" / "rules" / "meshkeeper.yml").read_text())
    assert all(g in rule["spec"]["groups"] for g in [group, *shipped["groups"]])


def test_dashboards_become_a_sidecar_configmap(tmp_path):
    chart = dt.copy_chart(tmp_path)
    dashboard = json.dumps({"uid": "meshkeeper-test", "title": "t {{ not a template }}"})
    (chart / "files" / "grafana" / "dashboards" / "zz-test.json").write_text(dashboard)
    cm = one(objects(chart=chart), "ConfigMap", "-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["zz-test.json"] == dashboard
    shipped = {p.name for p in (dt.REPO / "deploy" / "grafana" / "dashboards").glob("*.json")}
    assert shipped <= set(cm["data"])


def test_example_training_job_fits_the_crd_and_the_job_spec():
    from services.spec import parse_spec

    crd = yaml.safe_load((dt.CHART / "crds" / "trainingjobs.meshkeeper.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    job = yaml.safe_load((dt.REPO / "deploy" / "k8s" / "examples" / "trainingjob.yaml").read_text())
    assert job["apiVersion"] == f"{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}"
    jsonschema.validate(job, schema)
    parse_spec({"name": job["metadata"]["name"], **job["spec"]})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**job, "spec": {"model": {}}}, schema)  # train is required


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values."""
    for name, v in env.items():
        value = value.replace(f"$({name})", v)
    return value


@pytest.mark.parametrize("case", CASES)
def test_every_container_command_line_parses_in_the_real_cli(case, monkeypatch):
    """The chart's args against the argparse of the programs they start, so a renamed flag
    fails here rather than in a crash-looping pod."""
    from controller.__main__ import parse_args as controller_args
    from controller.operator import parse_args as operator_args
    from worker.__main__ import parse_args as worker_args

    sample = {"MESHKEEPER_REDIS_URL": "redis://r:6379/0", "MESHKEEPER_POD_NAME": "p-1",
              "MESHKEEPER_NODE_NAME": "n-1", "MESHKEEPER_NAMESPACE": "ml", "MESHKEEPER_POD_IP": "10.0.0.9"}
    parsers = {"controller": controller_args, "operator": operator_args, "worker": worker_args}
    seen = set()
    for o in objects(CASES[case]):
        if o["kind"] != "Deployment":
            continue
        c = container(o)
        env = {e["name"]: _expand(e["value"], sample) for e in c.get("env", []) if "value" in e}
        for k, v in env.items():
            monkeypatch.setenv(k, v)  # the programs read some settings from the environment
        args = [_expand(a, {**sample, **env}) for a in c.get("args", [])]
        assert "$(" not in " ".join(args), f"{c['name']}: unexpanded variable in {args}"
        parsers[c["name"]](args)
        seen.add(c["name"])
    assert {"controller", "worker"} <= seen

