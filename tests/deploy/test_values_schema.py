"""values.schema.json: generated from the @schema annotations in values.yaml by
scripts/gen_values_schema.py, kept in step with them, and refusing bad values through Helm's
own validation (helm-python-sdk), the path `helm install` takes."""

from __future__ import annotations

import json
import subprocess
import sys

import deploytools as dt
import jsonschema
import pytest
import yaml

GENERATOR = dt.REPO / "scripts" / "gen_values_schema.py"
SCHEMA = dt.CHART / "values.schema.json"


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(GENERATOR), *args],
        cwd=dt.REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_committed_schema_is_the_generated_one():
    out = generate("--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_check_fails_with_a_diff_when_an_annotation_changed(tmp_path):
    values = tmp_path / "values.yaml"
    text = (dt.CHART / "values.yaml").read_text()
    bound = "  # @schema minimum: 1, maximum: 65535\n  port: 8080\n"
    assert text.count(bound) == 1
    values.write_text(text.replace(bound, bound.replace("65535", "65000")))
    out = generate("--check", "--values", str(values), "--schema", str(SCHEMA))
    assert out.returncode == 1
    assert '-          "maximum": 65535' in out.stdout.splitlines()
    assert '+          "maximum": 65000' in out.stdout.splitlines()
    assert "is stale (2 lines differ)" in out.stderr
    assert "python scripts/gen_values_schema.py" in out.stderr


def test_the_convention_on_a_small_file(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(
        "# A header, kept apart by the blank line.\n"
        "\n"
        "# How many.\n"
        "# @schema minimum: 1\n"
        "replicas: 2\n"
        "image:\n"
        "  # @schema minLength: 1, required: true\n"
        "  repository: r\n"
        '  tag: ""  # empty: the chart\'s version\n'
        "# @schema additionalProperties: {type: string}\n"
        "labels: {team: ml}\n"
        "# @schema items: {type: string}\n"
        "# @schema items: {enum: [a, b]}\n"
        "modes: [a]\n"
    )
    schema_file = tmp_path / "values.schema.json"
    out = generate("--values", str(values), "--schema", str(schema_file))
    assert out.returncode == 0, out.stderr
    assert json.loads(schema_file.read_text()) == {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "meshkeeper chart values",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "replicas": {"type": "integer", "description": "How many.", "minimum": 1},
            "image": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "repository": {"type": "string", "minLength": 1},
                    "tag": {"type": "string", "description": "empty: the chart's version"},
                },
                "required": ["repository"],
            },
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "modes": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
        },
    }


@pytest.mark.parametrize(
    "text, says",
    [
        ("# @schema minimun: 1\nn: 1\n", "values.yaml:2: unknown @schema keyword(s) ['minimun']"),
        ("affinity: {}\n", "affinity is an empty map; say what it may hold with"),
        (
            "# @schema pattern: ^[a-z]+$\nn: x\n",
            "values.yaml:2: `# @schema pattern: ^[a-z]+$` is not",
        ),
        ("port: ~\n", "port has no type to infer from its default; add `# @schema type: ...`"),
    ],
)
def test_a_bad_annotation_is_refused_with_its_line_and_the_fix(tmp_path, text, says):
    values = tmp_path / "values.yaml"
    values.write_text(text)
    out = generate("--values", str(values), "--schema", str(tmp_path / "schema.json"))
    assert out.returncode == 2
    assert says in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "schema.json").exists()


def test_the_schema_is_draft_7_and_the_default_values_pass_it():
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((dt.CHART / "values.yaml").read_text())
    assert not [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(defaults)]
    helm = dt.helm()
    with helm.Chart.load(str(dt.CHART)) as chart:
        for values in dt.ci_values().values():
            chart.validate_schema(values)  # raises HelmValuesError naming the value


# Each kind of rule the hand-written schema had: unknown keys at every depth, types, bounds,
# enums, patterns (the Redis passwords go into a URL), required keys and free-form maps.
REFUSED = [
    ({"controler": {"replicas": 2}}, "additional properties 'controler' not allowed"),
    ({"worker": {"replicaz": 3}}, "replicaz"),
    ({"metrics": {"serviceMonitor": {"enable": True}}}, "enable"),
    ({"imagePullSecrets": [{"nam": "x"}]}, "/imagePullSecrets/0': missing property 'name'"),
    ({"controller": {"replicas": "two"}}, "/controller/replicas': got string, want integer"),
    ({"worker": {"shmSize": True}}, "/worker/shmSize': got boolean, want integer or string"),
    ({"commonLabels": {"team": 1}}, "/commonLabels/team': got number, want string"),
    ({"controller": {"tolerations": ["x"]}}, "/controller/tolerations/0': got string, want object"),
    ({"controller": {"replicas": 0}}, "/controller/replicas': minimum: got 0, want 1"),
    ({"operator": {"livenessPort": 70000}}, "/operator/livenessPort': maximum: got 70,000"),
    ({"worker": {"replicas": -1}}, "/worker/replicas': minimum: got -1, want 0"),
    ({"checkpoints": {"persistence": {"accessModes": []}}}, "accessModes': minItems: got 0"),
    ({"worker": {"image": {"variant": "rocm"}}}, "/worker/image/variant': value must be one of"),
    ({"redis": {"image": {"pullPolicy": "Sometimes"}}}, "/redis/image/pullPolicy': value must be"),
    (
        {"checkpoints": {"persistence": {"accessModes": ["ReadWriteSometimes"]}}},
        "/checkpoints/persistence/accessModes/0': value must be one of",
    ),
    ({"auth": {"redisControllerPassword": "p@ss/word"}}, "/auth/redisControllerPassword'"),
    ({"auth": {"redisProvisionerPassword": "p@ss/word"}}, "/auth/redisProvisionerPassword'"),
    (
        {"externalRedis": {"provisionerUrl": "http://x"}},
        "/externalRedis/provisionerUrl': 'http://x' does not match",
    ),
    ({"keyPrefix": "mk:*"}, "/keyPrefix': 'mk:*' does not match pattern"),
    ({"externalRedis": {"url": "http://x"}}, "/externalRedis/url': 'http://x' does not match"),
    ({"checkpoints": {"mountPath": "ckpt"}}, "/checkpoints/mountPath': 'ckpt' does not match"),
    ({"controller": {"image": {"repository": None}}}, "missing property 'repository'"),
    ({"worker": {"image": {"repository": ""}}}, "/worker/image/repository': minLength: got 0"),
]


@pytest.mark.parametrize("values, says", REFUSED)
def test_the_schema_refuses_bad_values(values, says):
    helm = dt.helm()
    with helm.Chart.load(str(dt.CHART)) as chart, pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema(values)
    assert says in str(e.value)
    with pytest.raises(helm.HelmValuesError) as e:
        dt.render(values)
    assert says in str(e.value)


def test_free_form_maps_take_any_keys():
    """The maps annotated `additionalProperties` accept what Kubernetes accepts there."""
    helm = dt.helm()
    with helm.Chart.load(str(dt.CHART)) as chart:
        chart.validate_schema(
            {
                "podSecurityContext": {"supplementalGroups": [5]},
                "worker": {
                    "resources": {"limits": {"cpu": 4}},
                    "podAnnotations": {"a/b": "c"},
                    "updateStrategy": {"type": "Recreate"},
                },
                "global": {"imageRegistry": "r.example"},
            }
        )
