"""The TrainingJob operator and the controller's Kubernetes actions, against kmock (an HTTP
Kubernetes API emulator) with a real controller process and a real redis-server behind it."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import aiohttp
import deploytools as dt
import kmock
import kopf
import kubernetes
import pytest
import pytest_asyncio

from controller import operator
from controller.k8s import KubernetesActions
from controller.operator import TERMINAL
from controller.passes import SchedulerConfig
from controller.scheduler import Scheduler
from services.client import Client
from services.procs import free_port, stop_all
from services.store import Store
from services.tokens import new_token
from tests.chaos.chaos import paced_spec, resumed_once
from tests.security.smallpool import SmallPool
from tests.stack import ENV, Proc, RedisServer, agent_argv, tiny_spec
from worker.progress import CHAOS_ENV

NS = "ml"
TJ = "meshkeeper.io/v1alpha1/trainingjobs"
TJ_URL = f"/apis/meshkeeper.io/v1alpha1/namespaces/{NS}/trainingjobs"
SPEC = {
    "model": {"preset": "tiny"},
    "parallel": {"dp": 2, "pp": 1, "tp": 1},
    "train": {"steps": 20, "global_batch": 8},
    "fault_tolerance": {"spares": 1},
}


# --- the real back end: redis-server and the controller, once per module -----------------


@pytest.fixture(scope="module")
def redis(tmp_path_factory) -> RedisServer:
    """redis-server with auth on, as deployed: users admin and controller (prefix op:)."""
    if not shutil.which("redis-server"):
        raise dt.MissingTool("redis-server not found; install it: apt-get install redis-server")
    server = RedisServer(tmp_path_factory.mktemp("redis"), prefix="op:")
    server.start()
    yield server
    server.proc.stop(5)


@pytest.fixture(scope="module")
def redis_url(redis) -> str:
    """As user admin: the tests write recoveries the way the controller's loop would."""
    return redis.url


@pytest.fixture(scope="module")
def api_token() -> str:
    return new_token()


@pytest.fixture(scope="module")
def controller_url(redis, api_token, tmp_path_factory):
    """The controller as the chart runs it: its admin token from MESHKEEPER_API_TOKEN."""
    port = free_port()
    log = (tmp_path_factory.mktemp("controller") / "controller.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "controller",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prefix",
            "op:",
        ],
        env={**os.environ, "MESHKEEPER_API_TOKEN": api_token, "REDIS_URL": redis.controller_url},
        cwd=dt.REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    with Client(url, timeout=2) as c:
        until(c.ready, 30, f"the controller did not become ready; see {log.name}")
    yield url
    stop_all([proc], 10)
    log.close()


def until(check: Callable[[], object], timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(what)


async def eventually(check: Callable[[], object], what: str, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(check)
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


# --- the Kubernetes side: kmock with our resources, and the operator on it ----------------


def declare(kmock) -> None:
    kmock.resources[TJ] = kmock.ResourceInfo(
        kind="TrainingJob",
        singular="trainingjob",
        namespaced=True,
        subresources={"status"},
        verbs={"list", "watch", "get", "patch", "create", "delete"},
    )
    kmock.resources["v1/events"] = kmock.ResourceInfo(
        kind="Event", namespaced=True, verbs={"create", "list"}
    )
    kmock.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", namespaced=False, verbs={"list", "watch"}
    )
    kmock.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod", namespaced=True, verbs={"get", "list", "delete"}
    )


class ApiServer(kmock.KubernetesEmulator):
    """kmock, plus one thing a real API server does: it names objects created with
    generateName (kopf and the kubernetes client create Events that way)."""

    async def _handle(self, request):
        meta = request.data.get("metadata") if isinstance(request.data, dict) else None
        if (
            request.action == kmock.action.CREATE
            and meta
            and not meta.get("name")
            and meta.get("generateName")
        ):
            meta["name"] = meta["generateName"] + secrets.token_hex(4)
        return await super()._handle(request)


pytestmark = pytest.mark.kmock(cls=ApiServer)


@pytest_asyncio.fixture
async def run_operator(kmock, api_token):
    """Start the real operator (kopf with our registry) against kmock, in its own thread and
    event loop as in production (kopf cancels every task of its loop when it stops)."""
    declare(kmock)
    started: list[tuple[threading.Thread, threading.Event, Client]] = []

    async def start(url: str, poll_s: float = 0.2) -> None:
        def login(**_):
            return kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"), insecure=True)

        stop, ready = threading.Event(), threading.Event()
        client = operator.make_client(url, api_token)
        run = kopf.operator(
            registry=operator.build_registry(poll_s, login=login),
            standalone=True,
            namespaces=[NS],
            stop_flag=stop,
            ready_flag=ready,
            memo=kopf.Memo(client=client),
        )
        thread = threading.Thread(target=asyncio.run, args=(run,), name="kopf", daemon=True)
        thread.start()
        started.append((thread, stop, client))
        assert await asyncio.to_thread(ready.wait, 20), "the operator did not start"

    yield start
    for thread, stop, client in started:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
        client.close()
        assert not thread.is_alive(), "the operator did not stop"


async def k8s(kmock, method: str, path: str, body: dict | None = None) -> dict:
    async with aiohttp.ClientSession(base_url=str(kmock.url)) as s:
        async with s.request(method, path, json=body) as r:
            assert r.status < 400, await r.text()
            return await r.json()


def tj_obj(kmock, name: str) -> dict | None:
    try:
        obj = kmock.objects[TJ, NS, name]
    except KeyError:
        return None
    return None if obj.deleted else obj.raw


def status(kmock, name: str) -> dict:
    return (tj_obj(kmock, name) or {}).get("status") or {}


def events(kmock, reason: str) -> list[dict]:
    return [
        o.raw
        for (res, _, _), o in kmock.objects.items()
        if res.plural == "events" and not o.deleted and o.raw.get("reason") == reason
    ]


def condition(st: dict, type_: str) -> dict | None:
    return next((c for c in st.get("conditions", []) if c["type"] == type_), None)


async def create_tj(kmock, name: str, spec: dict = SPEC, **extra) -> None:
    await k8s(
        kmock,
        "POST",
        TJ_URL,
        {
            "apiVersion": "meshkeeper.io/v1alpha1",
            "kind": "TrainingJob",
            # what an API server adds (kmock stores what it is given)
            "metadata": {
                "name": name,
                "namespace": NS,
                "resourceVersion": "1",
                "uid": f"uid-{name}",
                "generation": 1,
                "creationTimestamp": "2020-01-01T00:00:00Z",
            },
            "spec": spec,
            **extra,
        },
    )


# --- tests --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_create_submits_the_job_and_writes_conditions(
    kmock, run_operator, controller_url, api_token
):
    await run_operator(controller_url)
    await create_tj(kmock, "tiny")
    st = await eventually(
        lambda: status(kmock, "tiny").get("jobID") and status(kmock, "tiny"), "status.jobID"
    )
    admitted = condition(st, "Admitted")
    assert admitted["status"] == "True" and admitted["lastTransitionTime"].endswith("Z")
    with Client(controller_url, api_token) as c:
        job = c.job(st["jobID"])
    assert job.name == "tiny" and job.spec["parallel"]["dp"] == 2
    # the mirror follows: the controller's own conditions (no workers: waiting for capacity)
    await eventually(
        lambda: (
            (condition(status(kmock, "tiny"), "Running") or {}).get("reason")
            == "WaitingForCapacity"
        ),
        "the Running condition mirrored",
    )
    assert operator.FINALIZER in tj_obj(kmock, "tiny")["metadata"]["finalizers"]
    assert events(kmock, "Submitted")[0]["involvedObject"]["name"] == "tiny"


@pytest.mark.asyncio
async def test_an_operator_that_died_after_submitting_adopts_its_job(
    kmock, run_operator, controller_url, api_token
):
    """The operator submits under the TrainingJob's UID (an Idempotency-Key): a job already
    submitted for this object, by an operator that died before writing status.jobID, is the
    one it records; no second job, whatever the clocks or names say."""
    spec = operator.job_spec("adopted", dict(SPEC))
    with Client(controller_url, api_token) as c:
        earlier = c.submit(spec, idempotency_key="uid-adopted").id
        before = len(c.jobs(limit=1000))
    await run_operator(controller_url)
    await create_tj(kmock, "adopted")  # its metadata.uid is uid-adopted
    job_id = await eventually(lambda: status(kmock, "adopted").get("jobID"), "status.jobID")
    assert job_id == earlier
    with Client(controller_url, api_token) as c:
        assert len(c.jobs(limit=1000)) == before


@pytest.mark.asyncio
async def test_delete_cancels_the_job_and_releases_the_object(
    kmock, run_operator, controller_url, api_token
):
    await run_operator(controller_url)
    await create_tj(kmock, "cancelled")
    job_id = await eventually(lambda: status(kmock, "cancelled").get("jobID"), "status.jobID")
    await k8s(kmock, "DELETE", f"{TJ_URL}/cancelled")
    await eventually(lambda: tj_obj(kmock, "cancelled") is None, "the finalizer released")
    with Client(controller_url, api_token) as c:
        await eventually(lambda: c.job(job_id).phase == "Cancelled", "the job cancelled")


@pytest.mark.asyncio
async def test_an_invalid_spec_is_refused_with_the_field(
    kmock, run_operator, controller_url, api_token
):
    await run_operator(controller_url)
    bad = {**SPEC, "parallel": {"dp": 3, "pp": 1, "tp": 1}}  # global_batch 8 % dp 3
    await create_tj(kmock, "bad")
    await create_tj(kmock, "worse", bad)
    st = await eventually(lambda: condition(status(kmock, "worse"), "Admitted"), "the refusal")
    assert (
        st["status"] == "False"
        and st["reason"] == "InvalidSpec"
        and "train.global_batch" in st["message"]
    )
    assert status(kmock, "worse")["phase"] == "Failed" and "jobID" not in status(kmock, "worse")
    with Client(controller_url, api_token) as c:
        assert [j.name for j in c.jobs()].count("worse") == 0


@pytest.mark.asyncio
async def test_delete_is_never_stuck_on_an_unreachable_controller(kmock, run_operator, monkeypatch):
    monkeypatch.setattr(operator, "RETRY_DELAY_S", 0.1)
    await run_operator(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    await create_tj(kmock, "orphan", status={"jobID": "orphan-abc123", "phase": "Running"})
    await eventually(
        lambda: (
            operator.FINALIZER
            in (tj_obj(kmock, "orphan") or {}).get("metadata", {}).get("finalizers", [])
        ),
        "the finalizer added",
    )
    await k8s(kmock, "DELETE", f"{TJ_URL}/orphan")
    await eventually(lambda: tj_obj(kmock, "orphan") is None, "the object released", timeout=30)
    assert events(kmock, "CancelFailed")


# --- controller/k8s.py --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_replace_worker_deletes_only_pool_pods_and_records_an_event(kmock):
    declare(kmock)
    pool = {"app.kubernetes.io/instance": "mk", "app.kubernetes.io/component": "worker"}
    kmock.objects["v1/pods", NS, "mk-worker-abc"] = {
        "metadata": {"name": "mk-worker-abc", "namespace": NS, "labels": pool}
    }
    kmock.objects["v1/pods", NS, "redis-0"] = {
        "metadata": {
            "name": "redis-0",
            "namespace": NS,
            "labels": {"app.kubernetes.io/component": "redis"},
        }
    }
    kmock.objects[TJ, NS, "tiny"] = {
        "apiVersion": "meshkeeper.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "tiny", "namespace": NS, "uid": "u-1"},
        "status": {"jobID": "tiny-0a1b2c"},
    }
    config = kubernetes.client.Configuration(host=str(kmock.url).rstrip("/"))
    actions = KubernetesActions(
        kubernetes.client.ApiClient(config),
        NS,
        "app.kubernetes.io/instance=mk,app.kubernetes.io/component=worker",
    )
    worker = {"id": "w-1", "host": "ignored", "labels": {"k8s.pod": "mk-worker-abc"}}
    assert (
        await asyncio.to_thread(actions.replace_worker, worker, "tiny-0a1b2c", "heartbeat lost")
        == "mk-worker-abc"
    )
    assert kmock.objects["v1/pods", NS, "mk-worker-abc"].deleted
    ev = events(kmock, "WorkerReplaced")
    assert (
        ev and ev[0]["involvedObject"]["name"] == "tiny" and ev[0]["involvedObject"]["uid"] == "u-1"
    )
    # a worker whose pod is not in the pool (here: the Redis pod) is never deleted
    foreign = {"id": "w-2", "host": "redis-0", "labels": {}}
    assert (
        await asyncio.to_thread(actions.replace_worker, foreign, "tiny-0a1b2c", "straggler") is None
    )
    assert not kmock.objects["v1/pods", NS, "redis-0"].deleted


def test_no_kubernetes_actions_outside_a_cluster():
    assert KubernetesActions.from_environment({}) is None
    assert KubernetesActions.from_environment({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is None
    with pytest.raises(ValueError, match="every pod"):
        KubernetesActions(kubernetes.client.ApiClient(), NS, " , ")


def test_operator_cli_refuses_to_guess_its_namespace(monkeypatch, capsys):
    monkeypatch.delenv("MESHKEEPER_NAMESPACE", raising=False)
    with pytest.raises(SystemExit):
        operator.parse_args(["--controller-url", "http://x:8080"])
    assert "--namespace" in capsys.readouterr().err


# --- a real kill under the real controller: the dead worker's pod goes, an Event says so ----
POOL_SELECTOR = {"app.kubernetes.io/component": "worker"}
KILL_SPEC = tiny_spec(
    "k8s-kill",
    train={"steps": 400},
    checkpoint={"every_steps": 5},
    fault_tolerance={
        "spares": 1,
        "dead_after_s": 2.0,
        "quarantine_s": 0,
        "straggler": {"action": "report"},
    },
)


def kubeconfig(path, server: str):
    """A kubeconfig for kmock (no auth), as an out-of-cluster controller would be given."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "anon", "user": {}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "anon"}}],
                "current-context": "kmock",
            }
        )
    )
    return path


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_killed_worker_is_replaced_on_kubernetes_and_the_operator_mirrors_it(
    kmock, run_operator, api_token, tmp_path, monkeypatch
):
    """A TrainingJob through the real operator onto a real controller and agents; SIGKILL one
    worker (agent and trainer). The controller, acting on Kubernetes (kmock, through
    MESHKEEPER_KUBECONFIG), deletes that worker's pod and only it once the recovery moved it
    out, with a WorkerReplaced Event on the TrainingJob; the operator mirrors the restart."""
    for i in range(3):
        kmock.objects["v1/pods", NS, f"pod-p{i}"] = {
            "metadata": {"name": f"pod-p{i}", "namespace": NS, "labels": POOL_SELECTOR}
        }
    env = {
        "MESHKEEPER_KUBECONFIG": str(kubeconfig(tmp_path / "kubeconfig", str(kmock.url))),
        "MESHKEEPER_NAMESPACE": NS,
        "MESHKEEPER_K8S_WORKER_SELECTOR": "app.kubernetes.io/component=worker",
        "MESHKEEPER_API_TOKEN": api_token,  # the operator's token, as the chart gives it
    }
    for k, v in env.items():
        monkeypatch.setitem(ENV, k, v)
    pool = await asyncio.to_thread(SmallPool, tmp_path, 0)
    agents = [
        Proc(
            f"agent-p{i}",
            [
                *agent_argv(pool.controller.url, pool.secrets, f"p{i}", tmp_path),
                *("--warm", "1", "--label", f"k8s.pod=pod-p{i}"),
            ],
            tmp_path / "logs",
        )
        for i in range(3)
    ]
    try:
        await run_operator(pool.controller.url)
        await eventually(lambda: sum(w.alive for w in pool.client.workers()) == 3, "3 agents", 60)
        spec = {k: v for k, v in KILL_SPEC.items() if k != "name"}
        await create_tj(kmock, "k8s-kill", spec)
        jid = await eventually(lambda: status(kmock, "k8s-kill").get("jobID"), "status.jobID")
        job = await eventually(
            lambda: (j := pool.client.job(jid)).step >= 2 and j, "the job training", 120
        )
        victim = next(r for r in job.mesh.ranks if r.rank == 1)
        agent = next(a for a in agents if a.name == f"agent-{victim.worker}")
        for pgid in (agent.p.pid, victim.pid):  # the host is lost
            os.killpg(pgid, signal.SIGKILL)

        await eventually(
            lambda: kmock.objects["v1/pods", NS, f"pod-{victim.worker}"].deleted,
            f"pod-{victim.worker} deleted",
            60,
        )
        ev = await eventually(lambda: events(kmock, "WorkerReplaced"), "the Event", 20)
        assert ev[0]["involvedObject"]["uid"] == "uid-k8s-kill", ev
        assert victim.worker in ev[0]["message"]
        j = pool.client.job(jid)
        assert [(r.cause, r.action) for r in j.recoveries] == [("WorkerDead", "replace")]
        others = [f"pod-p{i}" for i in range(3) if f"p{i}" != victim.worker]
        assert not any(kmock.objects["v1/pods", NS, p].deleted for p in others)
        # the operator mirrors the controller's restart onto the TrainingJob
        await eventually(lambda: status(kmock, "k8s-kill").get("restarts") == 1, "restarts")
        assert await eventually(lambda: events(kmock, "Recovering"), "a Recovering event")
    finally:
        stop_all([a.p for a in agents], 10)
        pool.close()


def node_agent(pool: SmallPool, wid: str, node: str, work) -> Proc:
    """An agent as a pod of the pool on Kubernetes node `node` (its pod `pod-{wid}`), with the
    trainers' chaos hooks armed (the busy-loop fault of tests/chaos/test_blame.py)."""
    argv = [
        *agent_argv(pool.controller.url, pool.secrets, wid, work),
        *("--warm", "1", "--label", f"k8s.pod=pod-{wid}", "--host-name", node),
    ]
    return Proc(f"agent-{wid}", argv, work / "logs", {**ENV, CHAOS_ENV: "1"})


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_node_quarantine_outlives_the_pod_replacement(kmock, tmp_path, monkeypatch):
    """A rank caught in a busy loop is blamed (RankHung), its worker quarantined and its pod
    deleted on Kubernetes (kmock). The Deployment's new pod lands on the same node with a new
    worker id: it joins, beats, and stays out of the pool until the quarantine has ended and
    its own health probe passed. Before node-keyed quarantine it was free at once."""
    nodes = {f"p{i}": f"node-{i}" for i in range(3)}
    for wid in [*nodes, "p9"]:
        kmock.objects["v1/pods", NS, f"pod-{wid}"] = {
            "metadata": {"name": f"pod-{wid}", "namespace": NS, "labels": POOL_SELECTOR}
        }
    monkeypatch.setitem(
        ENV, "MESHKEEPER_KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", str(kmock.url)))
    )
    monkeypatch.setitem(ENV, "MESHKEEPER_NAMESPACE", NS)
    monkeypatch.setitem(ENV, "MESHKEEPER_K8S_WORKER_SELECTOR", "app.kubernetes.io/component=worker")
    pool = await asyncio.to_thread(SmallPool, tmp_path, 0)
    agents = {wid: node_agent(pool, wid, node, tmp_path) for wid, node in nodes.items()}
    store = Store(pool.redis.url)
    spec = {
        **KILL_SPEC,
        "name": "k8s-hang",
        "fault_tolerance": {**KILL_SPEC["fault_tolerance"], "hang_after_s": 6, "quarantine_s": 20},
    }
    try:
        await eventually(lambda: sum(w.alive for w in pool.client.workers()) == 3, "3 agents", 60)
        jid = pool.client.submit(spec).id
        job = await eventually(
            lambda: (j := pool.client.job(jid)).step >= 2 and j, "the job training", 120
        )
        victim = next(r for r in job.mesh.ranks if r.rank == 1)
        os.kill(victim.pid, signal.SIGUSR2)  # it spins at its next step boundary
        await eventually(
            lambda: kmock.objects["v1/pods", NS, f"pod-{victim.worker}"].deleted,
            f"pod-{victim.worker} deleted",
            90,
        )
        rec = pool.client.job(jid).recoveries[0]
        assert (rec.cause, [q.worker for q in rec.quarantined]) == ("RankHung", [victim.worker])
        until = float(store.r.hget(f"mk:worker:{victim.worker}:health", "quarantined_until"))
        # the pod is gone with its agent; its Deployment starts a new one on the same node
        stop_all([agents.pop(victim.worker).p], 10)
        agents["p9"] = node_agent(pool, "p9", nodes[victim.worker], tmp_path)
        await eventually(lambda: "p9" in store.alive_workers(5.0), "p9 joined and beating", 60)
        health = store.r.hgetall("mk:worker:p9:health")
        assert health["cause"] == "NodeQuarantined", health
        assert float(health["quarantined_until"]) == until, (health, until)
        assert victim.worker in health["detail"] and "RankHung" in health["detail"], health
        assert store.now() < until  # still inside the quarantine: the check below means it
        scheduler = Scheduler(store, SchedulerConfig(), "test")
        assert "p9" not in {w.wid for w in scheduler.free_workers(store.now())}
        await eventually(
            lambda: "p9" in {w.wid for w in scheduler.free_workers(store.now())},
            "p9 admitted after the quarantine and its probe",
            until - store.now() + 60,
        )
        probe = store.r.hgetall("mk:worker:p9:probe")
        assert probe.get("passed") == "1" and float(probe["at"]) >= until, probe
        pool.client.cancel(jid)
    finally:
        store.close()
        stop_all([a.p for a in agents.values()], 10)
        pool.close()


async def set_suspend(kmock, name: str, suspend: bool) -> None:
    """What Kueue (or a person with kubectl) does: flip the TrainingJob's spec.suspend."""
    await k8s(kmock, "PATCH", f"{TJ_URL}/{name}", {"spec": {"suspend": suspend}})


@pytest.mark.slow
@pytest.mark.asyncio
async def test_spec_suspend_holds_a_new_job_and_stops_and_resumes_a_running_one(
    kmock, run_operator, api_token, tmp_path, monkeypatch, uninterrupted
):
    """Kueue's contract for a workload: created with spec.suspend true, the job waits and
    holds no worker; set false, it runs; true again, it commits a step and frees its workers;
    false, it resumes from that step and ends with the uninterrupted loss curve, bit for bit,
    no restart counted. The operator follows the field (real controller and agents)."""
    monkeypatch.setitem(ENV, "MESHKEEPER_API_TOKEN", api_token)  # the operator's, an admin's
    pool = await asyncio.to_thread(SmallPool, tmp_path, 3, ["--allow-chaos"])
    try:
        await run_operator(pool.controller.url)
        job_spec = paced_spec("tj-suspend")
        want = await asyncio.to_thread(uninterrupted, job_spec)
        spec = {**{k: v for k, v in job_spec.items() if k != "name"}, "suspend": True}
        await create_tj(kmock, "tj-suspend", spec)
        jid = await eventually(lambda: status(kmock, "tj-suspend").get("jobID"), "status.jobID")
        await eventually(lambda: status(kmock, "tj-suspend").get("phase") == "Suspended", "held")
        held = pool.client.job(jid)
        assert (held.phase, held.generation, held.mesh.ranks) == ("Suspended", 0, [])

        await set_suspend(kmock, "tj-suspend", False)  # admitted
        await eventually(lambda: pool.client.job(jid).step >= 4, "training", 120)
        await set_suspend(kmock, "tj-suspend", True)  # evicted
        stopped = await eventually(
            lambda: (j := pool.client.job(jid)).phase == "Suspended" and j, "suspended", 90
        )
        assert stopped.step == stopped.last_checkpoint.step and stopped.generation == 1
        assert events(kmock, "Suspending") and events(kmock, "Resuming")

        await set_suspend(kmock, "tj-suspend", False)  # admitted again
        done = await eventually(
            lambda: (j := pool.client.job(jid)).phase in TERMINAL and j, "the end", 180
        )
        await asyncio.to_thread(resumed_once, pool, done, want)
    finally:
        await asyncio.to_thread(pool.close)
