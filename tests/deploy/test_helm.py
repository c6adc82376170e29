"""The Helm chart: lint, render, kubernetes-validate --strict, and the promises of
docs/architecture.md, "Running it" and issue 7 read off the rendered objects. The values
schema has its own tests (test_values_schema.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import deploytools as dt
import jsonschema
import pytest
import yaml

from tests.stack import wait_until

CASES = dt.ci_values()
STANDARD_LABELS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
}


def objects(values=None, **kw) -> list[dict]:
    return [d for text in dt.render(values, **kw).values() for d in dt.docs(text)]


def one(objs, kind, suffix):
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, (
        f"expected one {kind} *{suffix}, found {[o['metadata']['name'] for o in found]}"
    )
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
    assert not [
        o
        for o in objs
        if o["kind"] == "PodDisruptionBudget" and "controller" in o["metadata"]["name"]
    ]
    pdb = one(objects({"controller": {"replicas": 2}}), "PodDisruptionBudget", "-controller")
    assert pdb["spec"]["minAvailable"] == 1


@pytest.mark.parametrize("case", CASES)
def test_workers_have_a_startup_probe_and_never_a_liveness_probe(case):
    c = container(one(objects(CASES[case]), "Deployment", "-worker"))
    assert "livenessProbe" not in c, (
        "a liveness probe would kill a training pod stuck in a collective"
    )
    assert c["startupProbe"]["httpGet"]["port"] == "metrics"
    env = {e["name"]: e for e in c["env"]}
    # the agent binds 127.0.0.1 by default (the kubelet and Prometheus could not reach it);
    # the pod IP, not every interface
    assert env["MESHKEEPER_METRICS_HOST"]["value"] == "$(MESHKEEPER_POD_IP)"
    assert env["MESHKEEPER_ADDRESS"]["value"] == "$(MESHKEEPER_POD_IP)"
    assert env["MESHKEEPER_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_gpu_values_reach_the_worker_pod():
    """The GPU example is one pod per node with all its GPUs (NVLink only joins GPUs inside
    one container), RDMA-capable, with a dataset mounted and no surge on a full pool."""
    objs = objects(CASES["gpu-values.yaml"])
    worker = one(objs, "Deployment", "-worker")
    pod, c = worker["spec"]["template"]["spec"], container(worker)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and "--devices=8" in c["args"]
    assert c["image"].endswith("-cuda")
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert worker["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["MESHKEEPER_DATA_ROOTS"] == "/datasets" and env["NCCL_IB_HCA"] == "mlx5"
    ctl_env = {
        e["name"]: e.get("value") for e in container(one(objs, "Deployment", "-controller"))["env"]
    }
    assert ctl_env["MESHKEEPER_DATA_ROOTS"] == "/datasets"
    assert {"name": "datasets", "mountPath": "/datasets", "readOnly": True} in c["volumeMounts"]
    default = container(one(objects(), "Deployment", "-worker"))
    assert "nvidia.com/gpu" not in str(default["resources"])
    assert "add" not in default["securityContext"]["capabilities"]


def test_the_gpu_values_run_the_image_dockerfile_cuda_builds():
    """variant cuda renders <repository>:<appVersion>-cuda: the tag that the build command of
    deploy/docker/Dockerfile.cuda (its header, docs/deploy.md) gives. Defaults stay on -cpu."""
    app = yaml.safe_load((dt.CHART / "Chart.yaml").read_text())["appVersion"]
    gpu = container(one(objects(CASES["gpu-values.yaml"]), "Deployment", "-worker"))
    assert gpu["image"] == f"meshkeeper-worker:{app}-cuda"
    build = f"docker build -f deploy/docker/Dockerfile.cuda -t {gpu['image']} ."
    for doc in (dt.REPO / "deploy" / "docker" / "Dockerfile.cuda", dt.REPO / "docs" / "deploy.md"):
        assert build in doc.read_text(), f"{doc.name} does not build {gpu['image']}"
    default = container(one(objects(), "Deployment", "-worker"))
    assert default["image"] == f"meshkeeper-worker:{app}-cpu"


def test_snapshots_get_a_memory_volume_of_their_own():
    worker = one(objects(), "Deployment", "-worker")
    pod, c = worker["spec"]["template"]["spec"], container(worker)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["snapshots"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "1Gi"  # NCCL's, apart
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["MESHKEEPER_SNAPSHOT_DIR"] == mounts["snapshots"]


@pytest.mark.parametrize(
    ("shm", "snapshots", "limit"), [("1Gi", "7Gi", "8Gi"), ("16Gi", "40Gi", "64Gi")]
)
def test_memory_volumes_that_crowd_out_the_trainers_fail_the_render_naming_the_fix(
    shm, snapshots, limit
):
    values = {
        "worker": {
            "shmSize": shm,
            "snapshots": {"size": snapshots},
            "resources": {"limits": {"memory": limit}},
        }
    }
    with pytest.raises(dt.helm().HelmRenderError, match="Raise resources.limits.memory"):
        dt.render(values)
    values["worker"]["resources"]["limits"]["memory"] = "128Gi"  # room enough: renders
    assert one([d for t in dt.render(values).values() for d in dt.docs(t)], "Deployment", "-worker")


def test_rbac_is_namespaced_and_minimal():
    objs = objects()
    assert not [o for o in objs if o["kind"].startswith("Cluster")]
    rules = {o["metadata"]["name"]: o["rules"] for o in objs if o["kind"] == "Role"}
    assert set(rules) == {"mk-meshkeeper-controller", "mk-meshkeeper-operator"}
    for rule in sum(rules.values(), []):
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
    # exactly the calls of controller/k8s.py: read_namespaced_pod, delete_namespaced_pod,
    # create_namespaced_event, list_namespaced_custom_object(trainingjobs)
    grants = {
        (g, res, v)
        for r in rules["mk-meshkeeper-controller"]
        for g in r["apiGroups"]
        for res in r["resources"]
        for v in r["verbs"]
    }
    assert grants == {
        ("", "pods", "get"),
        ("", "pods", "delete"),
        ("", "events", "create"),
        ("meshkeeper.io", "trainingjobs", "list"),
    }
    assert not [
        r
        for r in rules["mk-meshkeeper-operator"]
        if "pods" in r["resources"] or "secrets" in r["resources"]
    ]
    # RBAC cannot select pods by label: the controller is told its pool and checks it itself
    env = {
        e["name"]: e.get("value") for e in container(one(objs, "Deployment", "-controller"))["env"]
    }
    assert (
        env["MESHKEEPER_K8S_WORKER_SELECTOR"]
        == "app.kubernetes.io/instance=mk,app.kubernetes.io/component=worker"
    )
    worker_pod = one(objs, "Deployment", "-worker")["spec"]["template"]["spec"]
    assert worker_pod["automountServiceAccountToken"] is False
    none = objects(CASES["external-redis-values.yaml"])
    assert not [o for o in none if o["kind"] in ("Role", "RoleBinding")]


def test_external_redis_url_lives_in_a_secret():
    objs = objects(CASES["external-redis-values.yaml"])
    assert not [o for o in objs if o["kind"] == "StatefulSet"]
    secret = one(objs, "Secret", "-redis-url")
    assert secret["stringData"]["redis-url"].startswith("rediss://controller:")
    assert secret["stringData"]["redis-provisioner-url"].startswith("rediss://provisioner:")
    env = {e["name"]: e for e in container(one(objs, "Deployment", "-controller"))["env"]}
    assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"],
        "key": "redis-url",
    }
    assert env["REDIS_PROVISIONER_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"],
        "key": "redis-provisioner-url",
        "optional": False,
    }
    assert "s3cret" not in json.dumps([o for o in objs if o["kind"] != "Secret"])


def test_an_external_redis_without_a_provisioner_renders_and_an_existing_secret_may_hold_one():
    """Without a provisioner URL the controller starts (agents cannot join, it warns); from
    your own Secret the key is optional, so a Secret made before it existed still starts."""
    url = {"redis": {"enabled": False}, "externalRedis": {"url": "redis://r:6379/0"}}
    objs = objects(url)
    assert "redis-provisioner-url" not in one(objs, "Secret", "-redis-url")["stringData"]
    env = {e["name"] for e in container(one(objs, "Deployment", "-controller"))["env"]}
    assert "REDIS_URL" in env and "REDIS_PROVISIONER_URL" not in env
    own = {"redis": {"enabled": False}, "externalRedis": {"existingSecret": "my-redis"}}
    env = {e["name"]: e for e in container(one(objects(own), "Deployment", "-controller"))["env"]}
    assert env["REDIS_PROVISIONER_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "my-redis",
        "key": "redis-provisioner-url",
        "optional": True,
    }


def test_contradictory_redis_settings_fail_with_the_fix():
    helm = dt.helm()
    with pytest.raises(helm.HelmRenderError, match="set externalRedis.url"):
        dt.render({"redis": {"enabled": False}})
    with pytest.raises(helm.HelmRenderError, match="redis.enabled=false"):
        dt.render({"externalRedis": {"url": "redis://elsewhere:6379/0"}})
    with pytest.raises(helm.HelmRenderError, match="existingSecretProvisionerKey"):
        dt.render(
            {
                "redis": {"enabled": False},
                "externalRedis": {"existingSecret": "s", "provisionerUrl": "redis://p@r:6379/0"},
            }
        )
    with pytest.raises(helm.HelmRenderError, match="name the same key"):
        dt.render(
            {
                "redis": {"enabled": False},
                "externalRedis": {
                    "existingSecret": "s",
                    "existingSecretProvisionerKey": "redis-url",
                },
            }
        )


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
    assert {
        "name": "checkpoints",
        "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]},
    } in vols
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
    group = {
        "name": "extra",
        "rules": [{"alert": "RankDead", "expr": 'meshkeeper_ranks{state="dead"} > 0'}],
    }
    (chart / "files" / "prometheus" / "rules").mkdir(exist_ok=True)
    (chart / "files" / "prometheus" / "rules" / "test.yml").write_text(
        yaml.safe_dump({"groups": [group]})
    )
    rule = one(
        objects({"metrics": {"prometheusRule": {"enabled": True}}}, chart=chart),
        "PrometheusRule",
        "",
    )
    shipped = yaml.safe_load(
        (dt.REPO / "deploy" / "prometheus" / "rules" / "meshkeeper.yml").read_text()
    )
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


def test_the_crd_keeps_every_section_of_the_job_spec():
    """A spec section the CRD does not list is pruned by the API server without a word (its
    schema is structural): a TrainingJob's `eval:` would vanish before the operator saw it.
    `chaos` alone stays out: fault injection is for tests, never a cluster's resources."""
    from services.spec import JobSpec

    crd = yaml.safe_load((dt.CHART / "crds" / "trainingjobs.meshkeeper.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(spec["properties"]) == set(JobSpec.model_fields) - {"chaos"}


def crd_spec_rules() -> list[str]:
    crd = yaml.safe_load((dt.CHART / "crds" / "trainingjobs.meshkeeper.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return [v["rule"] for v in spec["x-kubernetes-validations"]]


def crd_allows(old: dict, new: dict) -> bool:
    """Whether the API server would take `new` over `old` as a TrainingJob's spec: the CRD's
    transition rules, evaluated by a CEL runtime (cel-python), not by reading them."""
    import celpy

    env = celpy.Environment()
    bound = {"self": celpy.json_to_cel(new), "oldSelf": celpy.json_to_cel(old)}
    return all(bool(env.program(env.compile(r)).evaluate(bound)) for r in crd_spec_rules())


def test_a_trainingjobs_spec_is_immutable_but_for_suspend():
    from services.spec import JobSpec

    job = {"name": "t", "model": {"preset": "tiny"}, "train": {"steps": 10}, "suspend": False}
    assert crd_allows(job, {**job, "suspend": True})  # what Kueue and people flip
    assert crd_allows(job, {k: v for k, v in job.items() if k != "suspend"})
    assert not crd_allows(job, {**job, "train": {"steps": 11}})
    assert not crd_allows(job, {**job, "eval": {"every_steps": 5}})  # a section added
    assert not crd_allows({**job, "eval": {"every_steps": 5}}, job)  # or taken away
    # every section but suspend (and chaos, which the CRD never carries) has its rule
    guarded = {f for f in JobSpec.model_fields for r in crd_spec_rules() if f"self.{f})" in r}
    assert guarded == set(JobSpec.model_fields) - {"suspend", "chaos"}


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

    sample = {
        "MESHKEEPER_REDIS_PASSWORD": "pw",
        "MESHKEEPER_REDIS_PROVISIONER_PASSWORD": "ppw",
        "MESHKEEPER_REDIS_SENTINEL_PASSWORD": "spw",
        "MESHKEEPER_POD_NAME": "p-1",
        "MESHKEEPER_NODE_NAME": "n-1",
        "MESHKEEPER_NAMESPACE": "ml",
        "MESHKEEPER_POD_IP": "10.0.0.9",
    }
    parsers = {"controller": controller_args, "operator": operator_args, "worker": worker_args}
    seen = set()
    for o in objects(CASES[case]):
        if o["kind"] != "Deployment":
            continue
        c = container(o)
        env = {
            e["name"]: _expand(e["value"], sample)
            if "value" in e
            else f"secret-{e['name'].lower()}"
            for e in c.get("env", [])
            if "value" in e or "secretKeyRef" in e["valueFrom"]
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)  # the programs read some settings from the environment
        args = [_expand(a, {**sample, **env}) for a in c.get("args", [])]
        assert "$(" not in " ".join(args), f"{c['name']}: unexpanded variable in {args}"
        parsers[c["name"]](args)
        seen.add(c["name"])
    assert {"controller", "worker"} <= seen


# --- secure by default (issue 11) -------------------------------------------------------

AUTH_KEYS = {
    "api-token",
    "scrape-token",
    "join-token",
    "redis-admin-password",
    "redis-controller-password",
    "redis-provisioner-password",
}


def secret_refs(c: dict) -> dict[str, tuple[str, str]]:
    """Env name -> (Secret, key) for the container's secretKeyRef variables."""
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def test_the_auth_secret_is_generated_when_values_give_none():
    import base64

    def data(objs):
        return {
            k: base64.b64decode(v).decode() for k, v in one(objs, "Secret", "-auth")["data"].items()
        }

    first, second = data(objects()), data(objects())
    assert set(first) == AUTH_KEYS
    assert all(len(v) >= 32 and v.isalnum() for v in first.values()), first
    assert len(set(first.values())) == len(first), "two secrets share a value"
    assert not set(first.values()) & set(second.values()), (
        "helm template must not render fixed secrets"
    )


def test_given_auth_values_are_used_and_an_existing_secret_replaces_the_chart_s():
    import base64

    given = {
        "apiToken": "a" * 40,
        "scrapeToken": "s" * 40,
        "joinToken": "j" * 40,
        "redisAdminPassword": "ra-" + "x" * 30,
        "redisControllerPassword": "rc-" + "y" * 30,
        "redisProvisionerPassword": "rp-" + "z" * 30,
    }
    secret = one(objects({"auth": given}), "Secret", "-auth")
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {
        "api-token": "a" * 40,
        "scrape-token": "s" * 40,
        "join-token": "j" * 40,
        "redis-admin-password": "ra-" + "x" * 30,
        "redis-controller-password": "rc-" + "y" * 30,
        "redis-provisioner-password": "rp-" + "z" * 30,
    }
    objs = objects(CASES["ha-monitoring-values.yaml"])
    assert not [o for o in objs if o["kind"] == "Secret"]
    refs = [
        r
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
        for r in secret_refs(c).values()
    ]
    assert refs and {name for name, _ in refs} == {"meshkeeper-secrets"}
    assert {key for _, key in refs} == AUTH_KEYS
    # a password inside a redis:// URL must not need escaping: test_values_schema.REFUSED


@pytest.mark.parametrize("case", CASES)
def test_workers_never_receive_a_redis_password(case):
    objs = objects(CASES[case])
    c = container(one(objs, "Deployment", "-worker"))
    assert {key for _, key in secret_refs(c).values()} == {"join-token"}
    assert not [a for a in c["args"] if a.startswith("--redis-url")]
    assert "--controller=http://mk-meshkeeper-controller:8080" in c["args"]
    assert not [e for e in c["env"] if "REDIS" in e["name"]]
    ctl = secret_refs(container(one(objs, "Deployment", "-controller")))
    assert {
        k: v[1] for k, v in ctl.items() if k.startswith("MESHKEEPER_") and k.endswith("_TOKEN")
    } == {
        "MESHKEEPER_API_TOKEN": "api-token",
        "MESHKEEPER_SCRAPE_TOKEN": "scrape-token",
        "MESHKEEPER_JOIN_TOKEN": "join-token",
    }
    if any(o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-operator") for o in objs):
        op = secret_refs(container(one(objs, "Deployment", "-operator")))
        assert {key for _, key in op.values()} == {"api-token"}


def test_pods_roll_when_the_generated_secret_changes():
    objs = objects({"auth": {"apiToken": "t" * 40}})
    sums = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"]["checksum/auth"]
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    assert len(sums) == 4 and len(set(sums.values())) == 1, sums
    other = objects({"auth": {"apiToken": "u" * 40}})
    assert (
        one(other, "Deployment", "-controller")["spec"]["template"]["metadata"]["annotations"][
            "checksum/auth"
        ]
        != sums["mk-meshkeeper-controller"]
    )


def redis_script(objs, name: str) -> str:
    """A data node's start-up script, as the chart's ConfigMap mounts it at /scripts."""
    return one(objs, "ConfigMap", "-redis-scripts")["data"][name]


def _redis_acl_script(objs) -> tuple[str, dict[str, str], list[str]]:
    sts = one(objs, "StatefulSet", "-redis")
    [init] = sts["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["sh", "/scripts/aclfile.sh"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    return redis_script(objs, "aclfile.sh"), env, container(sts)["args"]


def test_the_controller_redis_user_matches_the_store():
    from services.store import controller_acl

    _, env, _ = _redis_acl_script(objects({"keyPrefix": "team1:"}))
    assert env["CONTROLLER_ACL"].split() == controller_acl("team1:")
    _, env, _ = _redis_acl_script(objects())
    assert env["CONTROLLER_ACL"].split() == controller_acl("mk:")


def test_the_provisioner_redis_user_matches_the_store():
    from services.store import provisioner_acl

    for case in ("default", "sentinel-values.yaml"):
        sts = one(objects(CASES[case]), "StatefulSet", "-redis")
        [init] = sts["spec"]["template"]["spec"]["initContainers"]
        env = {e["name"]: e.get("value") for e in init["env"]}
        assert env["PROVISIONER_ACL"].split() == provisioner_acl(), case


@pytest.mark.parametrize("case", ["default", "sentinel-values.yaml"])
def test_the_controller_gets_the_provisioner_s_url_from_a_password_of_its_own(case):
    """REDIS_URL and REDIS_PROVISIONER_URL, as the kubelet expands them: one user each, each
    password from its own Secret key through its own variable."""
    c = container(one(objects(CASES[case]), "Deployment", "-controller"))
    secrets = {k: f"<{key}>" for k, (_, key) in secret_refs(c).items()}
    env = {e["name"]: _expand(e["value"], secrets) for e in c["env"] if "value" in e}
    scheme = "redis+sentinel" if case.startswith("sentinel") else "redis"
    assert env["REDIS_URL"].startswith(f"{scheme}://controller:<redis-controller-password>@")
    assert env["REDIS_PROVISIONER_URL"].startswith(
        f"{scheme}://provisioner:<redis-provisioner-password>@"
    )
    assert "$(" not in env["REDIS_URL"] + env["REDIS_PROVISIONER_URL"]
    # the same server (or Sentinels and master set) behind both
    assert env["REDIS_URL"].partition("@")[2] == env["REDIS_PROVISIONER_URL"].partition("@")[2]


def test_redis_starts_with_auth_required_and_keeps_joined_agents(tmp_path):
    """The init container's script and Redis's args, run for real: a fresh aclfile, then one
    that the controller had extended with an agent (ACL SAVE) and a rotated password."""
    import redis as redislib

    from services.procs import free_port

    redis_server = dt.tool("redis-server")
    script, env, args = _redis_acl_script(objects())
    data = tmp_path / "data"
    data.mkdir()
    env["DATA"] = str(data)
    args = [a.replace("/data", str(data)) for a in args]

    def start(admin: str, controller: str, provisioner: str):
        passwords = {
            "ADMIN_PASSWORD": admin,
            "CONTROLLER_PASSWORD": controller,
            "PROVISIONER_PASSWORD": provisioner,
        }
        out = subprocess.run(
            ["sh", "-ec", script],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **env, **passwords},
        )
        assert out.returncode == 0, out.stderr
        port = free_port()
        proc = subprocess.Popen(
            [redis_server, "--port", str(port), "--bind", "127.0.0.1", *args],
            stdout=subprocess.DEVNULL,
            cwd=data,
        )
        r = redislib.Redis(port=port, username="admin", password=admin, decode_responses=True)
        wait_until(r.ping, 5, "redis-server to answer")
        return proc, port, r

    proc, port, admin = start("admin-pw-1", "ctl-pw-1", "prov-pw-1")
    try:
        with pytest.raises(redislib.AuthenticationError):
            redislib.Redis(port=port).ping()  # the default user is off
        ctl = redislib.Redis(port=port, username="controller", password="ctl-pw-1")
        ctl.set("mk:x", 1)
        ctl.info("server")  # the uptime: Redis restarts
        for refused in (
            ("SET", "other:x", 1),
            ("FLUSHALL",),
            ("ACL", "SETUSER", "agent-w9", "on", ">pw", "+@all", "~*"),
            ("ACL", "LIST"),
            ("CONFIG", "GET", "requirepass"),
            ("CLIENT", "KILL", "USER", "admin"),
            ("SCRIPT", "KILL"),
            ("SCRIPT", "FLUSH"),
            ("FUNCTION", "FLUSH"),
        ):
            with pytest.raises(redislib.exceptions.NoPermissionError):
                ctl.execute_command(*refused)  # NOPERM: the controller's password makes no user
        prov = redislib.Redis(port=port, username="provisioner", password="prov-pw-1")
        prov.execute_command(
            "ACL", "SETUSER", "agent-w1", "on", ">agent-pw", "~mk:worker:w1*", "+ping"
        )
        prov.execute_command("CLIENT", "KILL", "USER", "agent-w1")
        prov.execute_command("ACL", "SAVE")
        for refused in (("GET", "mk:x"), ("SET", "mk:y", 1), ("CONFIG", "GET", "dir")):
            with pytest.raises(redislib.exceptions.NoPermissionError):
                prov.execute_command(*refused)  # the provisioner reads and writes no key
        probe = subprocess.run(
            ["sh", "-c", f"redis-cli -p {port} --user admin ping | grep -q PONG"],
            env={**os.environ, "REDISCLI_AUTH": "admin-pw-1"},
        )
        assert probe.returncode == 0
        wrong = subprocess.run(
            ["sh", "-c", f"redis-cli -p {port} --user admin ping | grep -q PONG"],
            env={**os.environ, "REDISCLI_AUTH": "nope"},
        )
        assert wrong.returncode != 0, "the probe must fail without the right password"
    finally:
        admin.shutdown(nosave=True)
        proc.wait(10)
    proc, port, admin = start("admin-pw-2", "ctl-pw-2", "prov-pw-2")  # rotated in the Secret
    try:
        redislib.Redis(port=port, username="agent-w1", password="agent-pw").ping()
        with pytest.raises(redislib.AuthenticationError):
            redislib.Redis(port=port, username="controller", password="ctl-pw-1").ping()
        with pytest.raises(redislib.AuthenticationError):
            redislib.Redis(port=port, username="provisioner", password="prov-pw-1").ping()
        redislib.Redis(port=port, username="controller", password="ctl-pw-2").ping()
        redislib.Redis(port=port, username="provisioner", password="prov-pw-2").ping()
    finally:
        admin.shutdown(nosave=True)
        proc.wait(10)


def test_service_monitor_sends_the_scrape_token_to_the_controller_only():
    objs = objects(CASES["ha-monitoring-values.yaml"])
    ctl = one(objs, "ServiceMonitor", "-controller")["spec"]["endpoints"][0]
    assert ctl["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "meshkeeper-secrets", "key": "scrape-token"},
    }
    assert "authorization" not in one(objs, "ServiceMonitor", "-worker")["spec"]["endpoints"][0]


# --- network policies: who may reach whom, read off the rendered policies ----------------


def _selects(selector: dict | None, labels: dict) -> bool:
    return (selector or {}).get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict, pod: dict) -> bool:
    """A NetworkPolicyPeer against a pod {labels, ns, ns_labels}; an ipBlock stands for no pod."""
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        ns_ok = _selects(peer["namespaceSelector"], pod["ns_labels"])
    else:
        ns_ok = pod["ns"] == "ml"
    return ns_ok and _selects(peer.get("podSelector"), pod["labels"])


def _rule_admits(rule: dict, side: str, other: dict, port: int) -> bool:
    peers = rule.get(side)
    ports = rule.get("ports")
    return (not peers or any(_peer_matches(p, other) for p in peers)) and (
        not ports or any(p["port"] == port for p in ports)
    )


def reachable(policies: list[dict], src: dict, dst: dict, port: int) -> bool:
    """Kubernetes' semantics: a pod selected by no policy of a direction allows it all;
    otherwise some rule of some selecting policy must allow it; both ends must agree."""

    def side(pod, direction, other, key):
        selecting = [
            p
            for p in policies
            if direction in p["spec"]["policyTypes"]
            and pod["ns"] == "ml"
            and _selects(p["spec"]["podSelector"], pod["labels"])
        ]
        rules = [r for p in selecting for r in p["spec"].get(direction.lower(), [])]
        return not selecting or any(_rule_admits(r, key, other, port) for r in rules)

    return side(src, "Egress", dst, "to") and side(dst, "Ingress", src, "from")


def _pod(component=None, ns="ml", **labels):
    if component:
        labels.update(
            {
                "app.kubernetes.io/name": "meshkeeper",
                "app.kubernetes.io/instance": "mk",
                "app.kubernetes.io/component": component,
            }
        )
    return {"labels": labels, "ns": ns, "ns_labels": {"kubernetes.io/metadata.name": ns}}


def test_network_policies_by_default_allow_only_what_each_part_needs():
    objs = objects()
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert {p["metadata"]["name"] for p in policies} == {
        f"mk-meshkeeper-{c}" for c in ("controller", "worker", "redis", "operator")
    }
    # each policy selects exactly its workload's pods
    for kind, name in [
        ("Deployment", "controller"),
        ("Deployment", "worker"),
        ("StatefulSet", "redis"),
        ("Deployment", "operator"),
    ]:
        pod_labels = one(objs, kind, f"-{name}")["spec"]["template"]["metadata"]["labels"]
        sel = one(policies, "NetworkPolicy", f"-{name}")["spec"]["podSelector"]
        assert _selects(sel, pod_labels)
        assert sel["matchLabels"]["app.kubernetes.io/component"] == name
    ctl, worker, redis, operator = (_pod(c) for c in ("controller", "worker", "redis", "operator"))
    prometheus = _pod(ns="monitoring", **{"app.kubernetes.io/name": "prometheus"})
    stranger = _pod(app="something-else")  # any other pod, even in the release's namespace
    other_release = _pod(**{**_pod("worker")["labels"], "app.kubernetes.io/instance": "other"})
    dns = _pod(ns="kube-system", **{"k8s-app": "kube-dns"})
    allowed = [
        (worker, ctl, 8080),
        (operator, ctl, 8080),
        (prometheus, ctl, 8080),
        (ctl, redis, 6379),
        (worker, redis, 6379),
        (worker, worker, 29500),
        (worker, worker, 40123),
        (prometheus, worker, 9400),
        (ctl, dns, 53),
        (worker, dns, 53),
        (operator, dns, 53),
    ]
    denied = [
        (stranger, ctl, 8080),
        (stranger, redis, 6379),
        (stranger, worker, 9400),
        (stranger, worker, 29500),
        (other_release, redis, 6379),
        (other_release, worker, 29500),
        (operator, redis, 6379),
        (prometheus, redis, 6379),
        (prometheus, worker, 29500),
        (ctl, worker, 29500),
        (ctl, ctl, 6379),
        (worker, stranger, 443),
        (redis, stranger, 80),
        (worker, ctl, 9999),
        (stranger, operator, 8081),
    ]
    for src, dst, port in allowed:
        assert reachable(policies, src, dst, port), (src["labels"], dst["labels"], port)
    for src, dst, port in denied:
        assert not reachable(policies, src, dst, port), (src["labels"], dst["labels"], port)


def test_network_policy_sources_are_configurable_and_can_be_turned_off():
    client = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ci"}}}
    objs = objects({"networkPolicy": {"apiClients": [client]}})
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert reachable(policies, _pod(ns="ci", app="runner"), _pod("controller"), 8080)
    assert not reachable(policies, _pod(ns="ci", app="runner"), _pod("redis"), 6379)
    ingress_only = [
        o for o in objects(CASES["ha-monitoring-values.yaml"]) if o["kind"] == "NetworkPolicy"
    ]
    assert ingress_only and all(p["spec"]["policyTypes"] == ["Ingress"] for p in ingress_only)
    assert not [
        o for o in objects({"networkPolicy": {"enabled": False}}) if o["kind"] == "NetworkPolicy"
    ]
