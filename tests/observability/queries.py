"""Every PromQL expression the project ships: the alert rules' and the dashboard's, each with
where it comes from, ready for a parser (Grafana's variables replaced by sample values)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import yaml

ROOT = Path(__file__).resolve().parents[2]
# Rule files are the YAML files with top-level `groups` (what Helm's PrometheusRule takes too).
RULE_FILES = sorted(
    f
    for f in (ROOT / "deploy" / "prometheus").rglob("*.y*ml")
    if "groups" in (yaml.safe_load(f.read_text()) or {})
)
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
LABEL_VALUES = re.compile(r"^label_values\((?P<expr>.+),\s*\w+\)$")


def grafana_to_promql(expr: str) -> str:
    """What Grafana sends: $__rate_interval and friends become durations, `$var` a value
    (every variable here stands inside a regex matcher, where `.*` is what "All" sends)."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def rule_expressions() -> dict[str, str]:
    out = {}
    for f in RULE_FILES:
        for group in yaml.safe_load(f.read_text())["groups"]:
            for rule in group["rules"]:
                out[f"{f.name}: {rule.get('alert') or rule.get('record')}"] = rule["expr"]
    return out


def dashboard_expressions() -> dict[str, str]:
    out = {}
    for f in DASHBOARDS:
        dash = json.loads(f.read_text())
        for p in dash["panels"]:
            for t in p.get("targets", []):
                out[f"{f.name}: panel {p['title']!r} {t['refId']}"] = grafana_to_promql(t["expr"])
        for v in dash.get("templating", {}).get("list", []):
            if v["type"] == "query":  # label_values(SELECTOR, LABEL): the selector is PromQL
                m = LABEL_VALUES.match(
                    v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                )
                assert m, f"{f.name}: variable {v['name']}: not label_values(selector, label)"
                out[f"{f.name}: variable {v['name']}"] = grafana_to_promql(m["expr"])
    return out


def metric_names(expr: str) -> set[str]:
    """The metric of every selector in `expr`, from a real PromQL parser's syntax tree."""
    names: set[str] = set()
    promql_parser.walk(
        promql_parser.parse(expr),
        lambda n: names.add(n.name) if isinstance(n, promql_parser.VectorSelector) else None,
    )
    return names
