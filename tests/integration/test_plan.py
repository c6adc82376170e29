"""The planner over the live stack: POST /v1/plan (any role), a `parallel.auto` spec planned at
admission, and `meshkeeper plan --measure` running the top candidates on the pool."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.integration.conftest import WORKERS, tiny_spec, wait_phase
from tests.integration.test_cli import meshkeeper
from worker.__main__ import host_fabric


def test_a_viewer_plans_for_the_live_pool(stack):
    with stack.controller.client(stack.secrets.viewer_token) as c:
        r = c.http.post("/v1/plan", json={"spec": tiny_spec("plan")})
    assert r.status_code == 200, r.text
    body = r.json()
    plans = body["plans"]
    assert plans and body["given"]["dp"] == 2
    # the pool: WORKERS agents of one device each, so no TP group can form inside a host
    assert all(p["dp"] * p["pp"] * p["tp"] <= WORKERS and p["tp"] == 1 for p in plans)
    times = [p["step_time_s"] for p in plans]
    assert times == sorted(times)
    # each plan says what its snapshot rings take of a host's memory; none without snapshots
    assert all(p["snapshot_per_rank_bytes"] > p["memory"]["params"] for p in plans)
    spec = {**tiny_spec("plan"), "snapshot": {"enabled": False}}
    with stack.controller.client(stack.secrets.viewer_token) as c:
        off = c.http.post("/v1/plan", json={"spec": spec}).json()
    assert {p["snapshot_per_rank_bytes"] for p in off["plans"]} == {0}


def test_a_bad_plan_request_names_the_field(stack):
    with stack.controller.client(stack.secrets.viewer_token) as c:
        bad_spec = c.http.post("/v1/plan", json={"spec": tiny_spec("p", model={"heads": 3})})
        bad_device = c.http.post(
            "/v1/plan", json={"spec": tiny_spec("p"), "workers": 2, "device": "tpu"}
        )
        bad_fabric = c.http.post(
            "/v1/plan", json={"spec": tiny_spec("p"), "workers": 2, "fabric": "roce"}
        )
    assert bad_spec.status_code == 422
    assert "spec.model.heads" in [p["field"] for p in bad_spec.json()["problems"]]
    assert bad_device.status_code == 422
    assert [p["field"] for p in bad_device.json()["problems"]] == ["device"]
    assert bad_fabric.status_code == 422
    assert bad_fabric.json()["problems"] == [
        {"field": "fabric", "message": "unknown fabric 'roce'; choose one of infiniband, tcp"}
    ]


def test_a_plan_says_which_fabric_it_assumed(stack):
    h100s = {"spec": tiny_spec("p"), "workers": 2, "devices_per_worker": 8, "device": "h100-80gb"}
    with stack.controller.client(stack.secrets.viewer_token) as c:
        ib = c.http.post("/v1/plan", json=h100s).json()
        tcp = c.http.post("/v1/plan", json={**h100s, "fabric": "tcp"}).json()
        pool = c.http.post("/v1/plan", json={"spec": tiny_spec("p"), "fabric": "tcp"}).json()
        joined = c.http.post("/v1/plan", json={"spec": tiny_spec("p")}).json()
    assert (ib["fabric"], tcp["fabric"], pool["fabric"]) == ("infiniband", "tcp", "tcp")
    # unasked, the live pool's: what its agents found on this machine at their join
    assert joined["fabric"] == host_fabric("auto")
    assert {i.get("fabric") for i in stack.store.workers(stack.store.alive_workers(5)).values()}


def test_an_auto_spec_is_stored_with_the_planned_layout(stack):
    c = stack.client
    job = c.submit(tiny_spec("auto", parallel={"auto": True})).id
    stored = c.job(job).spec["parallel"]
    c.cancel(job)  # what admission stored is the behaviour; training it is other tests' work
    assert stored["auto"] is False
    assert stored["dp"] * stored["pp"] * stored["tp"] <= WORKERS
    wait_phase(c, job, ("Cancelled",), 60)


@pytest.mark.slow
def test_measure_runs_the_top_plans_and_prints_the_models_choice_and_the_fastest(stack, tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec("measure")))
    r = meshkeeper(
        "plan",
        str(spec),
        "--workers",
        "1",  # one-rank candidates: the cheapest jobs the pool can run
        "--measure",
        "2",
        "--measure-steps",
        "2",
        url=stack.controller.url,
        token=stack.secrets.admin_token,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rate = r"([\d,]+) tokens/s"
    first = re.search(r"model's first choice: .*: " + rate, r.stdout)
    best = re.search(r"measured best: .*: " + rate, r.stdout)
    assert first and best, r.stdout
    assert float(best[1].replace(",", "")) >= float(first[1].replace(",", "")) > 0
