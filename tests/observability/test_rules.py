"""The Prometheus configuration and alert rules, judged by promtool: they load, and every
alert has a unit test that shows it firing (tests/observability/rules_test.yml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.observability.queries import ROOT, RULE_FILES

CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
UNIT_TESTS = Path(__file__).with_name("rules_test.yml")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)


def alert_names() -> set[str]:
    return {
        r["alert"]
        for f in RULE_FILES
        for g in yaml.safe_load(f.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }


def test_rule_files_load(promtool):
    assert RULE_FILES, "no rule file (YAML with top-level groups) under deploy/prometheus"
    out = run(promtool, "check", "rules", *map(str, RULE_FILES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_unit_tests_pass(promtool):
    out = run(promtool, "test", "rules", str(UNIT_TESTS))
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_alert_has_a_unit_test_that_fires_it():
    doc = yaml.safe_load(UNIT_TESTS.read_text())
    fired = {
        t["alertname"]
        for case in doc["tests"]
        for t in case["alert_rule_test"]
        if t.get("exp_alerts")
    }
    wanted = {
        "MeshkeeperRankDead",
        "MeshkeeperStraggler",
        "MeshkeeperNoProgress",
        "MeshkeeperCheckpointTooOld",
        "MeshkeeperRecoverySlow",
        "MeshkeeperRestartBudgetNearlySpent",
    }
    assert wanted <= alert_names(), f"missing alerts: {wanted - alert_names()}"
    assert alert_names() <= fired, f"alerts no unit test fires: {alert_names() - fired}"


def test_unit_tests_load_the_shipped_rules():
    doc = yaml.safe_load(UNIT_TESTS.read_text())
    assert {(UNIT_TESTS.parent / f).resolve() for f in doc["rule_files"]} == set(RULE_FILES)


def test_prometheus_config_is_valid_and_discovers_workers_through_the_controller(
    promtool, tmp_path
):
    # promtool opens the scrape token's credentials_file, which exists only in a deployment:
    # check a copy that points at a real file instead
    shutil.copytree(CONFIG.parent, tmp_path / "prometheus")
    token = tmp_path / "scrape-token"
    token.write_text("t" * 40)
    conf = tmp_path / "prometheus" / CONFIG.name
    conf.write_text(CONFIG.read_text().replace("/run/secrets/meshkeeper/scrape-token", str(token)))
    out = run(promtool, "check", "config", str(conf))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in out.stdout, out.stdout
    jobs = {j["job_name"]: j for j in yaml.safe_load(CONFIG.read_text())["scrape_configs"]}
    [sd] = jobs["meshkeeper-worker"]["http_sd_configs"]
    assert sd["url"].endswith("/v1/sd/workers")  # what test_scrapes.py shows the controller serves
