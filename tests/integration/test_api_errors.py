"""Bad REST requests against a real controller: each gets the right status and a message that
names the field and the fix; no traceback ever reaches the client."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.conftest import ENV, ROOT, tiny_spec

GOOD = tiny_spec("ok")
CASES = [
    # (method, path, body, status, field that must be named, words the message must carry)
    ("POST", "/v1/jobs", b"{not json", 422, "(body)", "JSON"),
    ("POST", "/v1/jobs", b"[1, 2]", 422, "(spec)", "mapping"),
    ("POST", "/v1/jobs", b"\xff\x00]", 422, "(body)", "JSON"),
    ("POST", "/v1/plan", b"\xff\x00]", 422, "(body)", "UTF-8"),
    ("POST", "/v1/jobs", {**GOOD, "name": "Bad_Name"}, 422, "name", "lowercase"),
    ("POST", "/v1/jobs", {k: v for k, v in GOOD.items() if k != "train"}, 422, "train", "required"),
    ("POST", "/v1/jobs", {**GOOD, "parallel": {"dp": 2, "tp": 3}}, 422, "parallel.tp", "divisible"),
    ("POST", "/v1/jobs", {**GOOD, "parallel": {"dp": 0}}, 422, "parallel.dp", "greater than"),
    (
        "POST",
        "/v1/jobs",
        {**GOOD, "train": {"steps": 5, "global_batch": 15}},
        422,
        "train.global_batch",
        "divisible",
    ),
    ("POST", "/v1/jobs", {**GOOD, "colour": "red"}, 422, "colour", "unknown key"),
    ("POST", "/v1/jobs", {**GOOD, "model": {"preset": "huge"}}, 422, "model.preset", "tiny"),
    ("GET", "/v1/jobs/no-such-job", None, 404, None, "not found"),
    ("DELETE", "/v1/jobs/no-such-job", None, 404, None, "not found"),
    ("GET", "/v1/jobs/no-such-job/events", None, 404, None, "not found"),
    ("GET", "/v1/jobs/Bad_Id!", None, 422, "path.job_id", "lowercase"),
    ("GET", "/v1/jobs?limit=0", None, 422, "query.limit", "greater than"),
    ("GET", "/v1/jobs?limit=many", None, 422, "query.limit", "integer"),
    ("GET", "/v1/jobs?phase=Sleeping", None, 422, "query.phase", "Pending"),
    ("GET", "/v1/nothing-here", None, 404, None, "no such endpoint"),
    ("PUT", "/v1/jobs", None, 405, None, "not allowed"),
]


@pytest.mark.parametrize(
    "method,path,body,status,field,words", CASES, ids=[f"{c[0]} {c[1]} {c[3]}" for c in CASES]
)
def test_bad_request(stack, method, path, body, status, field, words):
    kw = (
        {"content": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
        if body is not None
        else {}
    )
    r = stack.client.http.request(method, path, **kw)
    assert r.status_code == status, r.text
    doc = r.json()
    assert set(doc) == {"detail", "problems"}
    assert "Traceback" not in r.text
    text = doc["detail"] + " " + " ".join(p["message"] for p in doc["problems"])
    assert words.lower() in text.lower(), doc
    if field is not None:
        assert field in [p["field"] for p in doc["problems"]], doc


def test_every_spec_problem_is_listed(stack):
    bad = {
        **GOOD,
        "model": {"preset": "tiny", "heads": 3},
        "parallel": {"dp": 2, "tp": 2},
        "train": {"steps": 5, "global_batch": 15, "warmup_steps": 9},
    }
    r = stack.client.http.post("/v1/jobs", json=bad)
    assert r.status_code == 422
    fields = [p["field"] for p in r.json()["problems"]]
    for f in ("model.heads", "parallel.tp", "train.global_batch", "train.warmup_steps"):
        assert f in fields, fields


def test_events_after_must_be_an_event_id(stack):
    jid = stack.client.submit(tiny_spec("ev", train={"steps": 100000})).id
    r = stack.client.http.get(f"/v1/jobs/{jid}/events", params={"after": "yesterday"})
    assert r.status_code == 422 and r.json()["problems"][0]["field"] == "query.after"
    stack.client.cancel(jid)


def test_controller_never_imports_torch():
    code = (
        "import sys, controller.app, controller.__main__, controller.service; "
        "assert 'torch' not in sys.modules, 'controller imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, check=True, timeout=60)
