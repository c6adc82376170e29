"""POST /v1/agents/join: how an agent becomes a worker (docs/security.md, "Agents and Redis").

The agent presents the join token (Bearer) and describes itself; the controller, not the
agent, writes the worker's registration (with a controller-set `joined_at`, the mark the
scheduler places only on), creates or rotates the agent's own Redis ACL user `agent-{wid}`
with a fresh random password, and answers with a Redis URL carrying that user's credentials.
A wrong or missing join token gets 401 and nothing is written.

A worker id is bound to the agent that holds it while that agent beats: a join with the id
of a live worker is refused (409) unless it presents that worker's current Redis password
(`credential`: the same agent, restarted, which kept it in its run dir). So the join token
alone cannot take over a live worker, rotate its password and cut it off.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Request, Security
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from controller import quarantine
from controller.auth import JOIN_HOW_TO, Denied, Principal, bearer
from controller.service import Controller
from services.redis_url import with_credentials
from services.store import NO_PROVISIONER, WORKER_ID_RE, agent_user
from services.tokens import new_token

log = logging.getLogger("meshkeeper.agents")
# A worker whose last beat is younger than this is held by its agent: twice the longest beat
# interval an agent may use (a job's fault_tolerance.heartbeat_s is at most 60 s).
HOLD_S = 120.0
Text = Annotated[str, Field(min_length=1, max_length=253)]


class JoinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Annotated[str, Field(pattern=WORKER_ID_RE.pattern, description="worker id")]
    host: Text
    address: Text = Field(description="where other workers reach this one (rendezvous)")
    devices: Annotated[int, Field(ge=1, le=1024)]
    labels: Annotated[
        dict[Annotated[str, Field(max_length=63)], Annotated[str, Field(max_length=253)]],
        Field(max_length=64),
    ] = {}
    memory_bytes: Annotated[
        int, Field(ge=0, description="per device: host RAM / devices on CPU, GPU memory on GPU")
    ]
    device_kind: Literal["cpu", "cuda"]
    snapshot_bytes: Annotated[
        int,
        Field(
            ge=0,
            description="the room for in-memory snapshots: the size of the file system of the "
            "agent's --snapshot-dir, less the shared memory kept for NCCL on a GPU worker; 0: "
            "unknown (admission then does not judge the job's snapshot rings against it)",
        ),
    ] = 0
    fabric: Literal["infiniband", "tcp"] = Field(
        default="infiniband",
        description="the network this host reaches other hosts over: infiniband (RDMA: "
        "InfiniBand or RoCE) or tcp (sockets); the planner costs cross-host traffic by it",
    )
    pid: Annotated[int, Field(ge=1)]
    run_dir: Annotated[str, Field(max_length=4096)] = ""
    credential: Annotated[
        str | None,
        Field(
            max_length=256,
            description="the Redis password this agent got at its last join with this id, "
            "if it kept one: it proves a live worker's id is its own",
        ),
    ] = None


class Joined(BaseModel):
    redis_url: str = Field(description="Redis URL with this agent's own ACL user")
    prefix: str
    id: str


def join_token(request: Request, cred: HTTPAuthorizationCredentials | None = Security(bearer)):
    """401 unless the bearer token is the agents' join token."""
    if not request.app.state.auth.join_ok(cred.credentials if cred else None):
        raise Denied(
            401,
            JOIN_HOW_TO,
            'Bearer realm="meshkeeper", error="invalid_token"',
        )
    request.state.principal = Principal("join token", "agent")  # for the audit log


def router(ctl: Controller) -> APIRouter:
    r = APIRouter(tags=["workers"])

    @r.post(
        "/v1/agents/join",
        response_model=Joined,
        # a dependency runs before the body is validated: an unauthenticated caller learns
        # nothing of the request's schema
        dependencies=[Depends(join_token)],
        responses={
            401: {"description": "no valid join token"},
            409: {"description": "a live agent holds this worker id"},
            503: {"description": "this controller holds no provisioner credential"},
        },
    )
    async def join(body: JoinRequest, request: Request) -> dict:
        """Register a worker (Bearer: the join token). Re-joining with the same id replaces
        its registration and rotates its Redis password; while the id's agent lives, only with
        its `credential` (409 otherwise)."""
        peer = request.client.host if request.client else "?"
        if not ctl.store.provisions:
            raise HTTPException(503, NO_PROVISIONER)
        held = await run_in_threadpool(ctl.store.held_elsewhere, body.id, body.credential, HOLD_S)
        if held is not None:
            log.warning(
                "refused a join as worker %s from %s (claims %s): a live agent holds that id "
                "(last beat %.1fs ago) and the join did not present its credential",
                body.id,
                peer,
                body.address,
                held,
            )
            raise HTTPException(
                409,
                f"worker id {body.id!r} is held by a live agent (last beat {held:.1f}s ago): "
                "give this agent another --id, or stop that one; an id is free once its agent "
                f"stops or has been silent for {HOLD_S:.0f}s",
            )
        password = new_token()
        node = body.labels.get("host", body.host)
        if inherited := await run_in_threadpool(quarantine.inherit, ctl.store, body.id, node):
            log.warning(
                "worker %s joins on node %s, which is quarantined until %s: it stays out of "
                "the pool until its health probe passes after then",
                body.id,
                node,
                inherited["quarantined_until"],
            )
        info = {
            **body.model_dump(exclude={"id", "credential"}),
            "labels": {"host": body.host, **body.labels},
            "state": "idle",
            "started_at": time.time(),
        }
        saved = await run_in_threadpool(ctl.store.join_worker, body.id, info, password)
        if not saved:
            log.warning(
                "Redis has no aclfile: agent user %s lasts only until Redis restarts "
                "(run redis-server with --aclfile; docs/security.md)",
                agent_user(body.id),
            )
        log.info(
            "worker %s joined from %s (claims address %s; %s, %d device(s))",
            body.id,
            peer,
            body.address,
            body.host,
            body.devices,
        )
        url = with_credentials(
            ctl.cfg.agent_redis_url or ctl.cfg.redis_url, agent_user(body.id), password
        )
        return {"redis_url": url, "prefix": ctl.cfg.prefix, "id": body.id}

    return r
