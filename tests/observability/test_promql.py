"""Every PromQL expression in the alert rules and the dashboard parses in Prometheus' own
parser (promtool) and names only series the code really exposes, read off real scrapes of a
running controller and agent."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from tests.observability.exposition import series_names
from tests.observability.queries import dashboard_expressions, metric_names, rule_expressions

EXPRESSIONS = {**rule_expressions(), **dashboard_expressions()}


def test_there_is_something_to_check():
    assert len(rule_expressions()) >= 6 and len(dashboard_expressions()) >= 20, EXPRESSIONS.keys()


def test_every_expression_parses_in_promtool(promtool, tmp_path):
    """Each expression becomes a recording rule; `promtool check rules` parses them all."""
    names = {f"check:expr_{i}": where for i, where in enumerate(EXPRESSIONS)}
    rules = [{"record": rec, "expr": EXPRESSIONS[where]} for rec, where in names.items()]
    path = tmp_path / "expressions.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "expressions", "rules": rules}]}))
    out = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    report = out.stdout + out.stderr
    for rec, where in names.items():  # name the panel or alert, not the generated rule
        report = report.replace(rec, where)
    assert out.returncode == 0 and f"SUCCESS: {len(rules)} rules found" in report, report


def test_a_broken_expression_is_caught(promtool, tmp_path):
    """The check above can fail: promtool rejects what Prometheus would."""
    path = tmp_path / "bad.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "bad",
                        "rules": [{"record": "check:bad", "expr": "sum by (le (rate(x[5m]))"}],
                    }
                ]
            }
        )
    )
    out = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0


@pytest.fixture(scope="module")
def exposed(obs_stack) -> set[str]:
    """Series names an idle controller and an idle agent declare (every family is declared,
    with or without samples, so no job needs to run for this)."""
    obs_stack.idle()
    return series_names(obs_stack.scrape_controller()) | series_names(obs_stack.scrape("w0"))


@pytest.mark.parametrize("where", sorted(EXPRESSIONS))
def test_every_expression_names_only_exposed_series(where, exposed):
    names = metric_names(EXPRESSIONS[where])
    assert names, f"{where}: no metric selector in {EXPRESSIONS[where]!r}"
    unknown = sorted(n for n in names if n not in exposed)
    assert not unknown, (
        f"{where} names {unknown}, which no scrape exposes; exposed meshkeeper "
        f"series: {sorted(n for n in exposed if re.match('meshkeeper_', n))}"
    )
