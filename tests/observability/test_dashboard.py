"""The Grafana dashboard and its provisioning: a stable uid, the data source as a variable
(no hard-wired data source uid), the panels the issue asks for, a layout without overlaps,
and provisioning that points where docker-compose.yml mounts the files."""

from __future__ import annotations

import json

import yaml

from tests.observability.queries import DASHBOARDS, ROOT

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = json.loads((GRAFANA / "dashboards" / "meshkeeper.json").read_text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def test_one_dashboard_with_a_stable_uid():
    assert [d.name for d in DASHBOARDS] == ["meshkeeper.json"]
    assert DASHBOARD["uid"] == "meshkeeper-overview"


def test_every_query_takes_the_data_source_from_the_variable():
    [var] = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == "prometheus"
    ref = {"type": "prometheus", "uid": f"${{{var['name']}}}"}
    for p in PANELS:
        assert p["datasource"] == ref, p["title"]
        for t in p["targets"]:
            assert t["datasource"] == ref, f"{p['title']} {t['refId']}"
    for v in DASHBOARD["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"] == ref, v["name"]


def test_the_panels_the_issue_asks_for():
    by_title = {p["title"]: p for p in PANELS}
    for title in (
        "Throughput",
        "Loss",
        "Step time per rank",
        "Ranks by state",
        "Restarts by cause",
        "Recovery and detection time",
        "Recovery phases (p90, last 6h)",
        "Checkpoint age",
        "Goodput",
        "MFU",
        "Trainer memory per rank",
        "Compute vs collective wait",
        "Where the wall time went",
    ):
        assert title in by_title, f"no {title!r} panel"
    heat = by_title["Step time per rank"]
    assert heat["type"] == "heatmap"
    # per rank from a gauge: histograms carry no rank label (docs/architecture.md, "Observability")
    assert all(
        "meshkeeper_rank_step_seconds" in t["expr"] and "_bucket" not in t["expr"]
        for t in heat["targets"]
    )
    # the validation loss beside the training loss, on one chart (issue: data, "every screen")
    loss = [t["expr"] for t in by_title["Loss"]["targets"]]
    assert any("meshkeeper_train_loss" in e for e in loss), loss
    assert any("meshkeeper_eval_loss" in e for e in loss), loss
    # the goodput ledger (issue 47): every cause of each job's wall time, stacked to its share
    ledger = by_title["Where the wall time went"]
    [target] = ledger["targets"]
    assert "meshkeeper_job_seconds_total" in target["expr"] and "by (cause)" in target["expr"]
    assert ledger["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "percent"


def test_panels_have_unique_ids_and_do_not_overlap():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_provisioning_matches_the_compose_mounts():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(
        v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("./")
    )
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    [provider] = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "meshkeeper.yml").read_text()
    )["providers"]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    [ds] = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    assert "prometheus" in compose["services"]
