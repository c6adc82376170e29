"""The REST API (FastAPI). Every handler reads or writes Redis through the controller's store.

Errors always have the shape {"detail": "one line", "problems": [{"field", "message"}]}:
422 for bad input (every problem listed), 404 for an unknown job, 503 while Redis is away,
500 with a reference id for a bug; never a traceback.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from contextlib import asynccontextmanager
from typing import Annotated

import redis
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from controller import jobs, web
from controller.conditions import PHASES, TERMINAL
from controller.discovery import worker_targets
from controller.jobs import JOB_ID_RE, Job
from controller.service import Controller
from controller.status import job_status, job_summary, workers_status
from services import api
from services.spec import JobSpec, SpecError, parse_spec

log = logging.getLogger("meshkeeper.api")
MAX_BODY = 1 << 20
STREAM_ID_RE = re.compile(r"^\d+-\d+$")


class ApiError(Exception):
    def __init__(self, status: int, detail: str, problems: list[dict] | None = None):
        self.status, self.detail, self.problems = status, detail, problems or []


def _error(status: int, detail: str, problems: list[dict] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail, "problems": problems or []}, status_code=status)


def create_app(ctl: Controller) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        ctl.start()
        yield
        ctl.stop()

    errors = {status: {"model": api.Error} for status in (404, 409, 413, 422, 503)}
    app = FastAPI(title="meshkeeper controller", version="0.1.0", lifespan=lifespan, responses=errors,
                  description="Elastic, fault-tolerant 3D-parallel training. See DESIGN.md.")
    _install_error_handlers(app)
    alive_s = ctl.cfg.scheduler.worker_alive_s

    @app.middleware("http")
    async def timing(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        ctl.metrics.http_seconds.labels(request.method, getattr(route, "path", "unmatched")).observe(
            time.perf_counter() - t0)
        return response

    def load_job(job_id: str) -> Job:
        if not JOB_ID_RE.match(job_id):
            raise ApiError(422, f"job id {job_id!r} is malformed",
                           [{"field": "path.job_id", "message": "a job id is lowercase letters, "
                             "digits and '-' (as returned by POST /v1/jobs)"}])
        job = Job.from_hash(job_id, ctl.store.job(job_id))
        if job is None:
            raise ApiError(404, f"job {job_id!r} not found; list jobs with GET /v1/jobs")
        return job

    @app.post("/v1/jobs", status_code=201, tags=["jobs"], response_model=api.Submitted,
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": JobSpec.model_json_schema()}}}})
    async def submit(request: Request) -> dict:
        """Submit a job spec (JSON). 201 with the job id; 422 lists every problem."""
        body = await request.body()
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the spec is {len(body)} bytes; the limit is {MAX_BODY}")
        try:
            data = json.loads(body)
        except ValueError as e:
            raise ApiError(422, "the request body is not valid JSON",
                           [{"field": "(body)", "message": f"{e}; send the spec as a JSON object"}])
        try:
            spec = parse_spec(data)
        except SpecError as e:
            raise ApiError(422, f"invalid job spec: {len(e.problems)} problem(s)",
                           [{"field": p.field, "message": p.message} for p in e.problems])
        job = await run_in_threadpool(jobs.submit, ctl.store, spec)  # Redis is blocking I/O
        return {"id": job.id, "phase": job.phase}

    @app.get("/v1/jobs", tags=["jobs"], response_model=api.JobList)
    def list_jobs(phase: Annotated[str | None, Query(description=f"one of {', '.join(PHASES)}")] = None,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict:
        if phase is not None and phase not in PHASES:
            raise ApiError(422, f"unknown phase {phase!r}",
                           [{"field": "query.phase", "message": f"use one of {', '.join(PHASES)}"}])
        ids = ctl.store.job_ids(last=0 if phase else limit)  # a phase filter reads them all
        out = [job_summary(j) for j in (Job.from_hash(i, h) for i, h in ctl.store.jobs(ids).items())
               if j and (phase is None or j.phase == phase)]
        return {"jobs": out[-limit:]}

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], response_model=api.JobStatus)
    def get_job(job_id: str) -> dict:
        return job_status(ctl.store, load_job(job_id), alive_s)

    @app.delete("/v1/jobs/{job_id}", status_code=202, tags=["jobs"], response_model=api.CancelAccepted)
    def cancel_job(job_id: str) -> dict:
        """Request cancellation; the lease holder stops every rank and frees the workers."""
        job = load_job(job_id)
        if job.phase in TERMINAL:
            raise ApiError(409, f"job {job_id} is already {job.phase}; nothing to cancel")
        ctl.store.request_cancel(job_id)
        return {"id": job_id, "phase": job.phase, "cancel_requested": True}

    @app.get("/v1/jobs/{job_id}/events", tags=["jobs"], response_model=api.EventList)
    def job_events(job_id: str, after: Annotated[str, Query(description="a stream id")] = "-",
                   limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict:
        load_job(job_id)
        if after != "-" and not STREAM_ID_RE.match(after):
            raise ApiError(422, f"after={after!r} is not an event id",
                           [{"field": "query.after", "message": "use an event 'id' from an earlier "
                             "answer (like 1700000000000-0), or omit it"}])
        return {"events": ctl.store.events(job_id, after, limit)}

    @app.get("/v1/workers", tags=["workers"], response_model=api.WorkerList)
    def list_workers() -> dict:
        return {"workers": workers_status(ctl.store, alive_s)}

    @app.get("/v1/agent/bootstrap", tags=["workers"])
    def bootstrap() -> dict:
        """Where agents started with --controller find Redis. Guard with the admin token once
        API auth lands (DESIGN.md section 10): the URL may carry credentials."""
        return {"redis_url": ctl.cfg.agent_redis_url or ctl.cfg.redis_url, "prefix": ctl.cfg.prefix}

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict:
        return {"status": "ok", "controller": ctl.id, "leader": ctl.leading}

    @app.get("/readyz", tags=["ops"])
    def readyz() -> dict:
        ctl.store.ping()  # RedisError -> 503 through the handler
        return {"status": "ready", "redis": "ok", "leader": ctl.leading}

    @app.get("/metrics", tags=["ops"])
    def metrics() -> Response:
        return Response(generate_latest(ctl.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/sd/workers", tags=["ops"])
    def sd_workers() -> list[dict]:
        """Prometheus HTTP service discovery: every live worker's metrics endpoint."""
        return worker_targets(ctl.store, alive_s)

    web.mount(app)  # the mesh page at /ui/
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.detail, e.problems)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, e: RequestValidationError) -> JSONResponse:
        problems = [{"field": ".".join(str(x) for x in err["loc"]), "message": err["msg"]}
                    for err in e.errors()]
        return _error(422, "invalid request: " + "; ".join(f"{p['field']}: {p['message']}"
                                                           for p in problems), problems)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        detail = e.detail
        if e.status_code == 404:
            detail = f"no such endpoint: {request.method} {request.url.path}; see /docs"
        elif e.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path}; see /docs"
        return _error(e.status_code, str(detail))

    @app.exception_handler(redis.RedisError)
    async def redis_down(_: Request, e: redis.RedisError) -> JSONResponse:
        log.warning("Redis error answering a request: %s", e)
        return _error(503, "the controller cannot reach Redis right now; retry shortly")

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSONResponse:
        ref = secrets.token_hex(4)
        log.exception("internal error %s on %s %s", ref, request.method, request.url.path)
        return _error(500, f"internal error (reference {ref} in the controller log)")
