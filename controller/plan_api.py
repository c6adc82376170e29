"""POST /v1/plan: the planner over REST (docs/planner.md, "Command line and API").

The body names a spec and, optionally, a cluster (workers, devices per worker, device profile)
and the fabric between its hosts; without `workers` the plan is for the live pool, as
admission would plan a `parallel.auto` spec (over the fabric the body names).
Any role may plan (it reads nothing and writes nothing). A bad spec or cluster is a 422 that
names the field.
"""

from __future__ import annotations

from fastapi import APIRouter, params
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from controller.admission import live_pool, pool_cluster
from controller.auth import Principal
from controller.plan_gate import PlanGate, PlanRefused
from controller.service import Controller
from services import api, planner
from services.epochs import with_epochs
from services.spec import Problem, SpecError, parse_spec


def _unprocessable(problems: list[Problem]) -> JSONResponse:
    return JSONResponse(
        {
            "detail": f"cannot plan: {len(problems)} problem(s)",
            "problems": [{"field": p.field, "message": p.message} for p in problems],
        },
        status_code=422,
    )


def _cluster(ctl: Controller, body: api.PlanRequest) -> planner.Cluster:
    try:
        fabric = None if body.fabric is None else planner.fabric(body.fabric)
    except ValueError as e:
        raise SpecError([Problem("fabric", str(e))]) from None
    if body.workers is None:
        pool = live_pool(ctl.store, ctl.cfg.scheduler.worker_alive_s)
        if not pool:
            raise SpecError(
                [Problem("workers", "no live worker to plan for; give workers and device")]
            )
        return pool_cluster(pool, fabric=fabric)
    try:
        return planner.cluster(
            body.device or "cpu",
            body.workers,
            body.devices_per_worker or 1,
            body.memory_per_device_bytes,
            fabric or planner.INFINIBAND,
        )
    except ValueError as e:
        raise SpecError([Problem("device", str(e))]) from None


def router(ctl: Controller, reader: params.Depends, gate: PlanGate) -> APIRouter:
    r = APIRouter(tags=["plan"])

    @r.post(
        "/v1/plan",
        response_model=api.PlanResult,
        responses={status: {"model": api.Error} for status in (401, 403, 422, 429)},
    )
    async def plan(body: api.PlanRequest, who: Principal = reader) -> dict | JSONResponse:
        """Every feasible layout of the spec on the cluster, best (fastest) first, and the
        spec's own layout costed as `given` (null when the spec says parallel.auto). At most
        a few plans run at once, and each owner may start only so many a minute (429 with
        Retry-After)."""
        try:
            spec = parse_spec(with_epochs(body.spec, ctl.cfg.admission.data_roots))
        except SpecError as e:  # fields said as paths in the request body
            return _unprocessable([Problem(f"spec.{p.field}", p.message) for p in e.problems])
        try:
            with gate.admit(who.name):
                where = await run_in_threadpool(_cluster, ctl, body)
                return await run_in_threadpool(planner.report, spec, where)
        except SpecError as e:
            return _unprocessable(e.problems)
        except PlanRefused as e:
            return JSONResponse(
                {"detail": e.detail, "problems": []},
                status_code=429,
                headers={"Retry-After": str(e.retry_after_s)},
            )

    return r
