"""Fault injection (`chaos`: bit flips in a rank's state) is admitted only from an admin token
and only by a controller started with --allow-chaos (controller/chaos_gate.py, docs/security.md,
"Fault injection"). Real controllers over one real Redis: the module's own (no flag) and a
second replica started with --allow-chaos, real HTTP."""

from __future__ import annotations

import pytest

from controller.auth import Principal
from controller.chaos_gate import chaos_refusal
from services.spec import parse_spec
from tests.stack import ApiStack, Controller, tiny_spec

CHAOS = {"bitflip": [{"rank": 1, "step": 3, "tensor": "grad"}]}


def chaos_spec(name: str) -> dict:
    return tiny_spec(name, parallel={"dp": 2, "zero": 0}, chaos=CHAOS)


@pytest.fixture(scope="module")
def chaos_controller(api: ApiStack, tmp_path_factory) -> Controller:
    """A second controller replica on the same Redis, started with --allow-chaos."""
    c = Controller(
        api.redis,
        tmp_path_factory.mktemp("chaos-logs"),
        "controller-allow-chaos",
        api.secrets,
        ["--allow-chaos"],
    )
    yield c
    c.proc.stop(5)


def refused(controller: Controller, token: str, spec: dict, status: int, api: ApiStack) -> dict:
    with controller.client(token) as c:
        r = c.http.post("/v1/jobs", json=spec)
    assert r.status_code == status, r.text
    with api.controller.client() as admin:
        assert spec["name"] not in [j.name for j in admin.jobs()], "a refused job was stored"
    (problem,) = r.json()["problems"]
    assert problem["field"] == "chaos", problem
    return problem


def test_a_controller_without_allow_chaos_refuses_even_an_admin(api):
    problem = refused(api.controller, api.secrets.admin_token, chaos_spec("flip-noflag"), 422, api)
    assert "--allow-chaos" in problem["message"] and "remove chaos" in problem["message"]


def test_a_submitter_may_not_inject_faults_even_where_chaos_is_allowed(api, chaos_controller):
    token = api.secrets.submitter_token
    problem = refused(chaos_controller, token, chaos_spec("flip-submitter"), 403, api)
    assert "admin token" in problem["message"], problem


def test_an_admin_injects_faults_where_chaos_is_allowed(api, chaos_controller):
    """The refusals above are the gate, not a controller that refuses every chaos spec."""
    with chaos_controller.client() as c:
        jid = c.submit(chaos_spec("flip-admin")).id
        stored = c.job(jid).spec
        c.cancel(jid)
    assert stored["chaos"]["bitflip"][0] == {"rank": 1, "step": 3, "tensor": "grad", "bit": 30}


def test_the_role_is_judged_before_the_controllers_flag():
    """A non-admin learns nothing about the controller's flags: 403 whether or not chaos is
    allowed; a spec without chaos passes the gate for anyone."""
    spec = parse_spec(chaos_spec("flip"))
    submitter, admin = Principal("s", "submitter"), Principal("a", "admin")
    assert [chaos_refusal(spec, submitter, allowed).status for allowed in (False, True)] == [
        403,
        403,
    ]
    assert chaos_refusal(spec, admin, False).status == 422
    assert chaos_refusal(spec, admin, True) is None
    plain = parse_spec(tiny_spec("plain", parallel={"dp": 2}))
    assert chaos_refusal(plain, submitter, False) is None
