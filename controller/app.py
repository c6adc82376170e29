"""The REST API (FastAPI). Every handler reads or writes Redis through the controller's store.

Errors always have the shape {"detail": "one line", "problems": [{"field", "message"}]}:
401 without a valid bearer token, 403 for the wrong role (controller/auth.py), 415 for a body
that is not `application/json`, 413 for one over MAX_BODY, 422 for bad input (every problem
listed), 404 for an unknown job, 503 while Redis is away, 500 with a reference id for a bug;
never a traceback.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from contextlib import asynccontextmanager
from typing import Annotated, Any

import redis
from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Match

from controller import agents_api, history, jobs, plan_api, web
from controller.admission import admit
from controller.api_docs import install_docs
from controller.auth import ADMIN, METRICS, READ, SUBMIT, Auth, Denied, Principal, may_cancel
from controller.body_limit import BodyLimit
from controller.chaos_gate import chaos_refusal
from controller.conditions import PHASES, TERMINAL
from controller.discovery import worker_targets
from controller.jobs import Job
from controller.plan_gate import PlanGate
from controller.pool_limits import limit_problems, pending_problem
from controller.service import Controller
from controller.status import job_status, job_summary, workers_status
from controller.token_before_body import TokenBeforeBody
from services import api
from services.epochs import with_epochs
from services.redis_url import without_credentials
from services.spec import JobSpec, SpecError, parse_spec
from services.store import JOB_ID_RE

log = logging.getLogger("meshkeeper.api")
audit_log = logging.getLogger("meshkeeper.audit")
# a valid spec, shown in the OpenAPI document (and a fuzzer's first example)
EXAMPLE_SPEC = {
    "name": "tiny",
    "model": {"preset": "tiny"},
    "parallel": {"dp": 2},
    "train": {"steps": 12, "global_batch": 16},
}
MAX_BODY = 1 << 20
MAX_DEPTH = 32  # a job spec nests 3 levels; deeper JSON is an attack on the parser
# documented in the OpenAPI schema, enforced by load_job (with a message that says the fix)
JobId = Annotated[str, Path(json_schema_extra={"pattern": JOB_ID_RE.pattern, "maxLength": 80})]
# ASCII digits only (\d also matches '１'), at most 20 each: a stream id is two unsigned
# 64-bit halves
STREAM_ID_RE = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}$")
MAX_STREAM_PART = (1 << 64) - 1
# where a read of a stream (events, logs) goes on from: `stream_cursor` checks it
StreamCursor = Annotated[
    str,
    Query(
        description="the id of the last entry already seen (like 1700000000000-0), or '-' for "
        "the oldest kept",
        json_schema_extra={"pattern": f"^(-|{STREAM_ID_RE.pattern[1:-1]})$"},
    ),
]
MAX_HISTORY_POINTS = 5000  # a chart is a few thousand pixels wide; more points only cost
# the mesh page's own origin only, and never inside a frame (clickjacking)
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


class ApiError(Exception):
    def __init__(self, status: int, detail: str, problems: list[dict] | None = None):
        self.status, self.detail, self.problems = status, detail, problems or []


def _error(status: int, detail: str, problems: list[dict] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail, "problems": problems or []}, status_code=status)


def create_app(ctl: Controller, auth: Auth, hosts: list[str] = ("*",)) -> FastAPI:
    """The REST API; `hosts`: the Host header values it answers (TrustedHostMiddleware)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        ctl.start()
        yield
        ctl.stop()

    app = FastAPI(
        title="meshkeeper controller",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # served from the package instead (controller/api_docs.py)
        redoc_url=None,
        responses=_errors(404, 409, 422, 503),
        description="Elastic, fault-tolerant 3D-parallel training (docs/architecture.md). "
        "Every /v1 endpoint and /metrics needs a bearer token (docs/security.md).",
    )
    app.state.auth = auth  # the agents' join router checks the join token with it
    app.add_middleware(TokenBeforeBody, auth=auth)  # inside the limit: 413 needs no token
    app.add_middleware(BodyLimit, limit=MAX_BODY)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(hosts))  # outermost: first
    _install_error_handlers(app)
    _install_openapi(app)
    install_docs(app)
    alive_s = ctl.cfg.scheduler.worker_alive_s
    reader, submitter, admin, scraper = (
        Depends(auth.require(r)) for r in (READ, SUBMIT, ADMIN, METRICS)
    )
    denied = _errors(401, 403)

    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        """nosniff on every answer; the mesh page also gets its CSP and may not be framed."""
        response = await call_next(request)
        response.headers["X-Content-Type-Options"] = "nosniff"
        if request.url.path == "/" or request.url.path.startswith("/ui"):
            response.headers.update(PAGE_HEADERS)
        return response

    @app.middleware("http")
    async def audit(request: Request, call_next):
        """Every call that changes something, with who made it and how it ended: a job
        cancelled names the token that cancelled it (never the token itself)."""
        response = await call_next(request)
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            who = getattr(request.state, "principal", None)
            audit_log.info(
                "%s %s by %s from %s: %d",
                request.method,
                request.url.path,
                f"{who.name} ({who.role})" if who else "an unauthenticated caller",
                request.client.host if request.client else "?",
                response.status_code,
            )
        return response

    @app.middleware("http")
    async def timing(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        ctl.metrics.http_seconds.labels(
            request.method, getattr(route, "path", "unmatched")
        ).observe(time.perf_counter() - t0)
        return response

    def load_job(job_id: str) -> Job:
        if not JOB_ID_RE.fullmatch(job_id):
            raise ApiError(
                422,
                f"job id {job_id!r} is malformed",
                [
                    {
                        "field": "path.job_id",
                        "message": "a job id is lowercase letters, "
                        "digits and '-' (as returned by POST /v1/jobs)",
                    }
                ],
            )
        job = Job.from_hash(job_id, ctl.store.job(job_id))
        if job is None:
            raise ApiError(404, f"job {job_id!r} not found; list jobs with GET /v1/jobs")
        return job

    def owned_job(job_id: str, who: Principal) -> Job:
        """The job, if `who` may cancel, suspend or resume it (its owner, or an admin)."""
        job = load_job(job_id)
        may_cancel(who, job_id, job.owner)
        return job

    @app.post(
        "/v1/jobs",
        status_code=201,
        tags=["jobs"],
        response_model=api.Submitted,
        responses={
            **denied,
            **_errors(413, 415, 429),
            200: {"model": api.Submitted, "description": "a retry: the Idempotency-Key's job"},
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": "#/components/schemas/JobSpec"},
                        "examples": {
                            "tiny": {"summary": "a tiny 2-rank job", "value": EXAMPLE_SPEC}
                        },
                    }
                },
            }
        },
    )
    async def submit(
        request: Request,
        response: Response,
        who: Principal = submitter,
        idempotency_key: Annotated[
            str | None,
            Header(
                description="names this submission: a retry with the same key (same token) "
                "returns the job the first one made, with 200 instead of 201",
                json_schema_extra={"pattern": jobs.IDEMPOTENCY_KEY_RE.pattern},
            ),
        ] = None,
    ) -> dict:
        """Submit a job spec (JSON, `Content-Type: application/json`). 201 with the job id;
        422 lists every problem. The job's owner is the token's name. A spec with `chaos`
        (fault injection) needs an admin token (else 403) and a controller started with
        `--allow-chaos` (else 422)."""
        if idempotency_key is not None and not jobs.IDEMPOTENCY_KEY_RE.fullmatch(idempotency_key):
            raise ApiError(
                422,
                "invalid Idempotency-Key header",
                [
                    {
                        "field": "header.Idempotency-Key",
                        "message": "use 1 to 128 of A-Z a-z 0-9 . _ : -, like a UUID",
                    }
                ],
            )
        data = await _read_json(request)
        try:
            spec = parse_spec(with_epochs(data, ctl.cfg.admission.data_roots))
            classes = ctl.cfg.scheduler.priorities
            refused = chaos_refusal(spec, who, ctl.cfg.admission.allow_chaos)
            if no := refused or classes.refusal(spec, who):
                problem = {"field": no.problem.field, "message": no.problem.message}
                raise ApiError(no.status, no.detail, [problem])
            limits = ctl.cfg.pool_limits
            if over := limit_problems(spec, who, limits) + classes.problems(spec):
                raise SpecError(over)
            if not who.admin:
                waiting = await run_in_threadpool(jobs.waiting_of, ctl.store, who.name)
                if no_room := pending_problem(who.name, waiting, limits):
                    raise ApiError(
                        429, no_room.message, [{"field": no_room.field, "message": no_room.message}]
                    )
            # what can never run here: paths outside the roots, over quota, beyond the pool;
            # a `parallel.auto` spec comes back with the planner's layout
            spec = await run_in_threadpool(
                admit,
                spec,
                who.name,
                ctl.store,
                ctl.cfg.admission,
                ctl.cfg.scheduler.quotas,
                alive_s,
            )
        except SpecError as e:
            raise ApiError(
                422,
                f"invalid job spec: {len(e.problems)} problem(s)",
                [{"field": p.field, "message": p.message} for p in e.problems],
            ) from None
        # Redis is blocking I/O
        jid, created = await run_in_threadpool(
            jobs.submit,
            ctl.store,
            spec,
            who.name,
            idempotency_key,
            ctl.cfg.retention.job_retention_s,
        )
        if not created:
            response.status_code = 200
            return {"id": jid, "phase": (await run_in_threadpool(load_job, jid)).phase}
        return {"id": jid, "phase": "Pending"}  # what every new job is

    @app.get(
        "/v1/jobs",
        tags=["jobs"],
        response_model=api.JobList,
        responses=denied,
        dependencies=[reader],
    )
    def list_jobs(
        phase: Annotated[
            str | None,
            Query(
                description=f"one of {', '.join(PHASES)}", json_schema_extra={"enum": list(PHASES)}
            ),
        ] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict:
        if phase is not None and phase not in PHASES:
            raise ApiError(
                422,
                f"unknown phase {phase!r}",
                [{"field": "query.phase", "message": f"use one of {', '.join(PHASES)}"}],
            )
        # a phase filter reads only its index: the open jobs, or the finished ones (bounded by
        # retention, controller/retention.py), never every job ever stored
        if phase is None:
            ids = ctl.store.job_ids(last=limit)
        elif phase in TERMINAL:
            ids = ctl.store.finished_job_ids()
        else:
            ids = ctl.store.job_ids(open_only=True)
        out = [
            job_summary(j)
            for j in (Job.from_hash(i, h) for i, h in ctl.store.jobs(ids).items())
            if j and (phase is None or j.phase == phase)
        ]
        return {"jobs": out[-limit:]}

    @app.get(
        "/v1/jobs/{job_id}",
        tags=["jobs"],
        response_model=api.JobStatus,
        responses=denied,
        dependencies=[reader],
    )
    def get_job(job_id: JobId) -> Response:
        # Serialized once, by pydantic-core: FastAPI's own path dumps the document to dicts,
        # validates them again and encodes them in Python, several times the work for a
        # 1,024-rank mesh (issue 15: GET job p99 at 16,384 ranks).
        status = job_status(ctl.store, load_job(job_id), alive_s)
        return Response(status.model_dump_json(), media_type="application/json")

    @app.delete(
        "/v1/jobs/{job_id}",
        status_code=202,
        tags=["jobs"],
        response_model=api.CancelAccepted,
        responses=denied,
    )
    def cancel_job(job_id: JobId, who: Principal = submitter) -> dict:
        """Request cancellation; the lease holder stops every rank and frees the workers.
        A submitter cancels only its own jobs; an admin any."""
        job = owned_job(job_id, who)
        if job.phase in TERMINAL:
            raise ApiError(409, f"job {job_id} is already {job.phase}; nothing to cancel")
        ctl.store.request_cancel(job_id)
        return {"id": job_id, "phase": job.phase, "cancel_requested": True}

    @app.post(
        "/v1/jobs/{job_id}/suspend",
        status_code=202,
        tags=["jobs"],
        response_model=api.SuspendAccepted,
        responses=denied,
    )
    def suspend_job(job_id: JobId, who: Principal = submitter) -> dict:
        """Request a suspend: the ranks stop after a step chosen a little ahead, commit it and
        exit, and the job frees its workers (phase Suspended) until resumed; a pending job is
        suspended at once. Who may cancel a job may suspend it."""
        job = owned_job(job_id, who)
        if job.phase in TERMINAL:
            raise ApiError(
                409,
                f"job {job_id} is already {job.phase}; only a pending or running job can be "
                "suspended",
            )
        ctl.store.request_suspend(job_id, True)
        return {"id": job_id, "phase": job.phase, "suspend_requested": True}

    @app.post(
        "/v1/jobs/{job_id}/resume",
        status_code=202,
        tags=["jobs"],
        response_model=api.SuspendAccepted,
        responses=denied,
    )
    def resume_job(job_id: JobId, who: Principal = submitter) -> dict:
        """Withdraw a suspend: a suspended job queues again and resumes from the step it
        committed; one still stopping finishes suspending first, then queues."""
        job = owned_job(job_id, who)
        if not job.suspend_requested:
            raise ApiError(409, f"job {job_id} is {job.phase}, not suspended; nothing to resume")
        ctl.store.request_suspend(job_id, False)
        return {"id": job_id, "phase": job.phase, "suspend_requested": False}

    @app.get(
        "/v1/jobs/{job_id}/events",
        tags=["jobs"],
        response_model=api.EventList,
        responses=denied,
        dependencies=[reader],
    )
    def job_events(
        job_id: JobId,
        after: StreamCursor = "-",
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict:
        load_job(job_id)
        start = stream_cursor(after, "an event")
        return {"events": ctl.store.events(job_id, start, limit) if start else []}

    @app.get(
        "/v1/jobs/{job_id}/logs",
        tags=["jobs"],
        response_model=api.LogList,
        responses=denied,
        dependencies=[reader],
    )
    def job_logs(
        job_id: JobId,
        after: StreamCursor = "-",
        limit: Annotated[int, Query(ge=1, le=5000)] = 100,
        rank: Annotated[int | None, Query(ge=0, description="only this rank's lines")] = None,
        newest: Annotated[bool, Query(description="the newest `limit` lines instead")] = False,
    ) -> dict:
        """What the job's trainers printed (every generation's; at most the newest 20,000
        lines are kept: a rank's whole log stays in its file on its worker)."""
        load_job(job_id)
        start = stream_cursor(after, "a log line")
        if start is None:
            return {"lines": []}
        return {"lines": ctl.store.log_lines(job_id, start, limit, rank, newest)}

    @app.get(
        "/v1/jobs/{job_id}/history",
        tags=["jobs"],
        response_model=api.JobHistory,
        responses=denied,
        dependencies=[reader],
    )
    def job_history(
        job_id: JobId,
        max_points: Annotated[
            int,
            Query(
                ge=2,
                le=MAX_HISTORY_POINTS,
                description="at most this many points: the first, the last, and the "
                "last point of each bucket of steps between them",
            ),
        ] = 1000,
    ) -> dict:
        """The job's whole training history (loss, throughput, step time per step),
        downsampled, with its recoveries and checkpoint commits (the mesh page's charts)."""
        return history.job_history(ctl.store, load_job(job_id), max_points)

    @app.get(
        "/v1/workers",
        tags=["workers"],
        response_model=api.WorkerList,
        responses=denied,
        dependencies=[reader],
    )
    def list_workers() -> dict:
        return {"workers": workers_status(ctl.store, alive_s)}

    @app.get("/v1/agent/bootstrap", tags=["workers"], responses=denied, dependencies=[admin])
    def bootstrap() -> dict:
        """Where Redis is, for operators (admin only; never with credentials: agents get
        their own with POST /v1/agents/join)."""
        return {
            "redis_url": without_credentials(ctl.cfg.agent_redis_url or ctl.cfg.redis_url),
            "prefix": ctl.cfg.prefix,
        }

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict:
        return {"status": "ok", "controller": ctl.id, "leader": ctl.leading}

    @app.get("/readyz", tags=["ops"], responses=_errors(503))
    def readyz() -> dict:
        """Ready: Redis answers, and reconcile passes complete (a pass failing again and
        again, on Redis or on a bug, is 503 after controller/service.py PASS_OVERDUE_S)."""
        ctl.store.ping()  # RedisError -> 503 through the handler
        if (overdue := ctl.pass_overdue_s()) is not None:
            raise ApiError(
                503,
                f"no reconcile pass has completed for {overdue:.0f}s; see the controller's log",
            )
        return {"status": "ready", "redis": "ok", "leader": ctl.leading}

    @app.get(
        "/metrics", tags=["ops"], responses=denied, dependencies=[scraper], response_class=Response
    )
    def metrics() -> Response:
        return Response(generate_latest(ctl.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/sd/workers", tags=["ops"], responses=denied, dependencies=[scraper])
    def sd_workers() -> list[dict]:
        """Prometheus HTTP service discovery: every live worker's metrics endpoint."""
        return worker_targets(ctl.store, alive_s)

    app.include_router(agents_api.router(ctl))  # POST /v1/agents/join
    limits = ctl.cfg.pool_limits
    gate = PlanGate(limits.plan_concurrency, limits.plans_per_minute)
    app.include_router(plan_api.router(ctl, reader, gate))  # POST /v1/plan
    web.mount(app)  # the mesh page at /ui/
    return app


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries: each status answers the Error document."""
    return {status: {"model": api.Error} for status in statuses}


def stream_cursor(after: str, what: str) -> str | None:
    """A read cursor into a stream from `after` ('-' or an id from an earlier answer); None
    when nothing can follow it (Redis refuses a bound past its last possible id)."""
    if after == "-":
        return after
    if not STREAM_ID_RE.fullmatch(after):
        raise ApiError(
            422,
            f"after={after!r} is not {what} id",
            [
                {
                    "field": "query.after",
                    "message": f"use {what} 'id' from an earlier answer (like "
                    "1700000000000-0), or omit it",
                }
            ],
        )
    ms, seq = (int(x) for x in after.split("-"))
    if ms > MAX_STREAM_PART or (ms == MAX_STREAM_PART and seq >= MAX_STREAM_PART):
        return None
    return f"{ms}-{min(seq, MAX_STREAM_PART)}"


async def _read_json(request: Request) -> Any:
    """The body as JSON: only `application/json` (a cross-site form cannot send it without a
    CORS preflight, which this API never grants), nested at most MAX_DEPTH deep."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise ApiError(
            415,
            f"the body must be sent as Content-Type: application/json, not {ctype or 'none'!r}",
            [{"field": "header.content-type", "message": "use application/json"}],
        )
    body = await request.body()  # at most MAX_BODY: controller/body_limit.py
    try:
        data = json.loads(body)
    except RecursionError:
        data = None  # nested past the parser's own limit: reported below as too deep
        depth = MAX_DEPTH + 1
    except ValueError as e:
        raise ApiError(
            422,
            "the request body is not valid JSON",
            [{"field": "(body)", "message": f"{e}; send the spec as a JSON object"}],
        ) from None
    else:
        depth = _depth(data, MAX_DEPTH)
    if depth > MAX_DEPTH:
        raise ApiError(
            422,
            f"the JSON body is nested deeper than {MAX_DEPTH} levels",
            [{"field": "(body)", "message": f"nest objects and arrays at most {MAX_DEPTH} deep"}],
        )
    return data


def _depth(value: Any, limit: int) -> int:
    """How deep `value` nests, counted up to limit + 1 (iterative: no recursion to exhaust)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > limit:
                return d
            todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _install_openapi(app: FastAPI) -> None:
    """The JobSpec schema with its definitions in components/schemas, so every $ref resolves
    (pydantic puts them under a local $defs that means nothing inside an OpenAPI document)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            spec = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            clash = (set(spec.get("$defs", {})) | {"JobSpec"}) & set(schemas)
            if clash:  # a bug caught by any test that reads /openapi.json
                raise RuntimeError(f"JobSpec definitions clash with API schemas: {clash}")
            schemas.update(spec.pop("$defs", {}))
            schemas["JobSpec"] = {**spec, "examples": [EXAMPLE_SPEC]}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.detail, e.problems)

    @app.exception_handler(Denied)
    async def denied(_: Request, e: Denied) -> JSONResponse:
        response = _error(e.status, e.detail)
        if e.challenge:
            response.headers["WWW-Authenticate"] = e.challenge
        return response

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, e: RequestValidationError) -> JSONResponse:
        problems = [
            {"field": ".".join(str(x) for x in err["loc"]), "message": err["msg"]}
            for err in e.errors()
        ]
        return _error(
            422,
            "invalid request: " + "; ".join(f"{p['field']}: {p['message']}" for p in problems),
            problems,
        )

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        detail = e.detail
        if e.status_code == 400 and detail == "There was an error parsing the body":
            # FastAPI's answer to a body that is not UTF-8 (routes whose body it parses): a
            # malformed body like any other, as POST /v1/jobs answers it
            why = "not valid JSON: not UTF-8; send a JSON object"
            return _error(
                422, "the request body is not valid JSON", [{"field": "(body)", "message": why}]
            )
        if e.status_code == 404:
            detail = f"no such endpoint: {request.method} {request.url.path}; see /docs"
        elif e.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path}; see /docs"
        response = _error(e.status_code, str(detail))
        response.headers.update(e.headers or {})
        if e.status_code == 405:  # every method of the path (starlette names one route's only)
            response.headers["Allow"] = ", ".join(
                sorted(
                    {
                        m
                        for r in request.app.router.routes
                        if isinstance(r, APIRoute) and r.matches(request.scope)[0] != Match.NONE
                        for m in r.methods
                    }
                )
            )
        return response

    @app.exception_handler(redis.RedisError)
    async def redis_down(_: Request, e: redis.RedisError) -> JSONResponse:
        log.warning("Redis error answering a request: %s", e)
        return _error(503, "the controller cannot reach Redis right now; retry shortly")

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSONResponse:
        ref = secrets.token_hex(4)
        log.exception("internal error %s on %s %s", ref, request.method, request.url.path)
        return _error(500, f"internal error (reference {ref} in the controller log)")
