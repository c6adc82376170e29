"""What one tenant's spec may ask of the shared pool (controller/pool_limits.py): a submitter
cannot quarantine shared workers for a week, call every rank a straggler, ask for heartbeats
no agent can keep, or queue without end. An admin may go beyond the operator's bounds, not
below what agents can do. Real Redis, a real controller (`--max-pending-jobs 2`), real HTTP,
with the submitter's own token."""

from __future__ import annotations

import httpx
import pytest

from tests.stack import ApiStack, Controller, tiny_spec


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    s = ApiStack(tmp_path_factory.mktemp("tenants"))
    c = Controller(
        s.redis,
        s.redis.work / "logs",
        "capped",
        s.secrets,
        ["--max-pending-jobs", "2", "--plans-per-minute", "3"],
    )
    yield s, c
    c.proc.stop(5)
    s.close()


def post(c: Controller, token: str, spec: dict) -> httpx.Response:
    return httpx.post(
        c.url + "/v1/jobs", json=spec, headers={"Authorization": f"Bearer {token}"}, timeout=10
    )


def fields(r: httpx.Response) -> set[str]:
    return {p["field"] for p in r.json()["problems"]}


def test_a_submitter_cannot_take_shared_workers_out_for_a_week(capped):
    s, c = capped
    week = tiny_spec(
        "week",
        fault_tolerance={
            "quarantine_s": 604800,
            "straggler": {"slowdown": 1.01, "window_steps": 1, "action": "replace"},
        },
    )
    r = post(c, s.secrets.submitter_token, week)
    assert r.status_code == 422, r.text
    assert fields(r) == {
        "fault_tolerance.quarantine_s",
        "fault_tolerance.straggler.slowdown",
        "fault_tolerance.straggler.window_steps",
    }, r.text
    assert "3600s" in r.text and "admin" in r.text
    with c.client() as admin:
        assert not [j for j in admin.jobs() if j.name == "week"]  # nothing stored
        # within the bounds, or only reporting stragglers: admitted
        ok = tiny_spec(
            "tight",
            fault_tolerance={
                "quarantine_s": 600,
                "straggler": {"slowdown": 1.01, "action": "report"},
            },
        )
        r = post(c, s.secrets.submitter_token, ok)
        assert r.status_code == 201, r.text
        admin.cancel(r.json()["id"])
        # the admin may go beyond the operator's bounds
        r = post(c, s.secrets.admin_token, week)
        assert r.status_code == 201, r.text
        admin.cancel(r.json()["id"])


def test_detector_timings_no_agent_can_keep_are_refused_even_to_an_admin(capped):
    s, c = capped
    for ft, field in (
        ({"heartbeat_s": 4e-7}, "fault_tolerance.heartbeat_s"),
        ({"heartbeat_s": 0.05, "dead_after_s": 1e-6}, "fault_tolerance.dead_after_s"),
    ):
        r = post(c, s.secrets.admin_token, tiny_spec("fast", fault_tolerance=ft))
        assert r.status_code == 422 and field in fields(r), (ft, r.text)


def test_one_owner_may_keep_only_so_many_jobs_waiting(capped):
    s, c = capped
    made = []
    with c.client() as admin:
        try:
            for n in range(2):  # no agent joined: they stay Pending
                r = post(c, s.secrets.submitter_token, tiny_spec(f"q{n}"))
                assert r.status_code == 201, r.text
                made.append(r.json()["id"])
            r = post(c, s.secrets.submitter_token, tiny_spec("q2"))
            assert r.status_code == 429, r.text
            assert "2 jobs waiting" in r.json()["detail"] and "cap is 2" in r.json()["detail"]
            r = post(c, s.secrets.admin_token, tiny_spec("q-admin"))  # admins are not capped
            assert r.status_code == 201, r.text
            made.append(r.json()["id"])
            admin.cancel(made[0])
            # a cancelled job no longer waits: room for one more
            r = post(c, s.secrets.submitter_token, tiny_spec("q3"))
            assert r.status_code == 201, r.text
            made.append(r.json()["id"])
        finally:
            for jid in made[1:]:
                admin.cancel(jid)


def test_one_owner_may_start_only_so_many_plans_a_minute(capped):
    """A plan is seconds of CPU in the API process: each owner starts at most
    --plans-per-minute (3 here), then gets 429 with Retry-After; other owners still plan."""
    s, c = capped
    body = {"spec": tiny_spec("plan"), "workers": 2, "device": "cpu"}

    def plan(token: str) -> httpx.Response:
        return httpx.post(
            c.url + "/v1/plan", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60
        )

    for _ in range(3):
        assert plan(s.secrets.viewer_token).status_code == 200
    r = plan(s.secrets.viewer_token)
    assert r.status_code == 429, r.text
    assert "'viewer' started 3 plans in the last minute" in r.json()["detail"], r.text
    assert 1 <= int(r.headers["Retry-After"]) <= 61
    assert plan(s.secrets.submitter_token).status_code == 200
    assert httpx.get(c.url + "/readyz", timeout=5).status_code == 200
