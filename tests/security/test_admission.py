"""Admission refuses what can never run, with 422 naming the field and the fix: a rank larger
than the pool's devices, more ranks or spares than the pool's workers, more ranks than the
owner's quota. Against a real controller (`--quota submitter=1`) with two real agents joined
on this CPU host (each reports host RAM per device), real Redis and real HTTP."""

from __future__ import annotations

import pytest

from services.planner import Layout, cluster
from services.planner.memory import rank_memory
from services.spec import parse_spec
from tests.security.smallpool import SmallPool
from tests.stack import tiny_spec


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = SmallPool(
        tmp_path_factory.mktemp("admission"), 2, controller_flags=["--quota", "submitter=1"]
    )
    yield p
    p.close()


def refused(pool: SmallPool, spec: dict, token: str | None = None) -> list[dict]:
    with pool.client_as(token or pool.secrets.admin_token) as c:
        r = c.http.post("/v1/jobs", json=spec)
    assert r.status_code == 422, r.text
    assert not pool.client.jobs(), "a refused job must not be stored"
    return r.json()["problems"]


def test_a_70b_job_on_the_cpu_pool_gets_422(pool):
    for parallel in ({"dp": 1}, {"dp": 2, "zero": 3, "microbatches": 1}):
        spec = {
            "name": "big",
            "model": {"preset": "70b"},
            "parallel": parallel,
            "train": {"steps": 10, "global_batch": 2},
        }
        problems = refused(pool, spec)
        assert [p["field"] for p in problems] == ["model.preset"], problems
        msg = problems[0]["message"]
        assert "GiB" in msg and "cpu" in msg and "raise parallel.tp or parallel.pp" in msg, msg


def test_more_ranks_than_the_pool_has_workers_gets_422(pool):
    problems = refused(pool, tiny_spec("wide", parallel={"dp": 4}))
    assert [p["field"] for p in problems] == ["parallel.dp"], problems
    assert "4 ranks" in problems[0]["message"] and "2 live workers" in problems[0]["message"]
    problems = refused(pool, tiny_spec("spare", parallel={"dp": 2}, fault_tolerance={"spares": 1}))
    assert [p["field"] for p in problems] == ["fault_tolerance.spares"], problems


def test_a_job_larger_than_its_owners_whole_quota_gets_422(pool):
    problems = refused(pool, tiny_spec("two", parallel={"dp": 2}), pool.secrets.submitter_token)
    assert [p["field"] for p in problems] == ["parallel.dp"], problems
    assert "quota of submitter (1 running ranks)" in problems[0]["message"], problems


def test_a_job_that_fits_is_admitted(pool):
    """The same dp=2 job is fine for an owner without a quota: the refusals above are the
    checks, not a controller that refuses everything."""
    jid = pool.client.submit(tiny_spec("fits", parallel={"dp": 2})).id
    pool.client.cancel(jid)


def test_the_estimate_shrinks_with_sharding():
    """The planner's estimate follows the spec's knobs the messages suggest turning."""

    def need(**parallel) -> int:
        spec = parse_spec(
            {
                "name": "m",
                "model": {"preset": "8b"},
                "parallel": parallel,
                "train": {"steps": 1, "global_batch": 8},
            }
        )
        return rank_memory(spec, Layout.of(spec.parallel), cluster("h100-80gb", 1, 8)).total

    base = need(dp=1, zero=3)
    assert need(dp=2, zero=3) < base  # ZeRO-3 shards over dp
    assert need(dp=1, tp=2, zero=3) < base
    assert need(dp=2, zero=0) > need(dp=2, zero=2) > need(dp=2, zero=3)
    assert need(dp=1, zero=3, activation_checkpointing=True) < base
