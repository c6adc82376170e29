"""The control plane loses a part mid-job: training goes on and the state survives.

- the controller is killed: trainers keep training; a new controller shows the job intact;
- two controller replicas: only the lease holder acts; kill it and the other takes over;
- Redis is killed and restarted (AOF): agents and controller reconnect; the job completes.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import psutil
import pytest

from tests.integration.conftest import process_groups_alive, tiny_spec, wait_phase, wait_until


def max_progress_step(stack, job_id: str) -> int:
    """The highest step any worker reports for the job, read straight from Redis."""
    steps = [0]
    for h in stack.store.progress(list(stack.agents)).values():
        if h.get("job") == job_id:
            steps += [int(r.get("step") or 0) for r in json.loads(h["ranks"]).values()]
    return max(steps)


def controller_sources(stack, job_id: str) -> dict[str, set[str]]:
    """Event reason -> the controllers that wrote it; a job is placed exactly once."""
    events = stack.client.events(job_id)
    assert [e.reason for e in events].count("Placed") == 1, events
    out: dict[str, set[str]] = {}
    for e in events:
        if e.source.startswith("controller/"):
            out.setdefault(e.reason, set()).add(e.source.removeprefix("controller/"))
    return out


def judges_silence(stack, dead_after_s: float) -> bool:
    """Redis and the lease-holding controller have been up for longer than dead_after_s."""
    controller_up = time.time() - psutil.Process(stack.controller.proc.pid).create_time()
    return min(stack.store.uptime_s(), controller_up) > dead_after_s + 1


# First in this module: the tests below restart the controller and Redis, and this one
# waits until both have been up for longer than its dead_after_s.
@pytest.mark.slow
def test_agent_restarted_with_its_id_does_not_rejoin_the_old_world(stack):
    """Its trainers died with it; the restarted agent reports those ranks failed instead of
    starting new ones into the running world's rendezvous. The controller then recovers the job
    into a new generation, restarting the same workers: nothing says the worker is at fault
    (TrainerFailed; before fault tolerance, the job failed here). dead_after_s is far longer
    than the restart takes, so its silence is never judged: the agent's own report is what
    the controller acts on."""
    dead_after = 15
    spec = tiny_spec(
        "orphan", train={"steps": 100000}, fault_tolerance={"dead_after_s": dead_after}
    )
    # Silence is judged only once Redis and the controller have both been up for dead_after_s
    # (controller/availability.py); before that, nothing holds back the peers' restart in
    # place, and a Redis restarted by an earlier test would decide what this one sees.
    wait_until(lambda: judges_silence(stack, dead_after), 60, "heartbeat silence to be judged")
    jid = stack.client.submit(spec).id
    j = wait_until(lambda: (j := stack.client.job(jid)).step >= 2 and j, 120, "training")
    victim = next(r for r in j.mesh.ranks if r.rank == 1)
    stack.agents[victim.worker].kill(signal.SIGKILL)
    wait_until(lambda: not process_groups_alive([victim.pid]), 10, "its trainer to die with it")
    stack.agents[victim.worker] = stack._agent(victim.worker)
    j2 = wait_until(
        lambda: (
            (j := stack.client.job(jid)).generation >= 2
            and j.step > 0
            and all(r.state == "running" for r in j.mesh.ranks)
            and j
        ),
        120,
        "the job to train again in a new generation",
    )
    assert (j2.restarts, j2.generation) == (1, 2), (j2.restarts, j2.generation)
    rec = j2.recoveries[0]
    assert (rec.from_generation, rec.cause, rec.action) == (1, "TrainerFailed", "restart"), rec
    assert victim.worker in {f.worker for f in rec.faults}, rec.faults
    assert {r.worker for r in j2.mesh.ranks} == {r.worker for r in j.mesh.ranks}
    started = [
        e
        for e in stack.client.events(jid, limit=1000)
        if e.reason == "TrainerStarted" and e.source == f"agent/{victim.worker}"
    ]
    assert [e.generation for e in started].count(1) == 1, started  # only the first agent's
    stack.client.cancel(jid)
    wait_phase(stack.client, jid, ("Cancelled",), 30)


@pytest.mark.slow
def test_controller_killed_mid_job_training_goes_on(stack):
    """The job cannot end by itself (100000 steps), so the new controller must find it
    Running, exactly as the old one left it; the new controller then acts on it (cancels)."""
    spec = tiny_spec("ctl-kill", train={"steps": 100000})
    jid = stack.client.submit(spec).id
    before = wait_until(lambda: (j := stack.client.job(jid)).step >= 2 and j, 120, "training")
    stack.controller.proc.kill(signal.SIGKILL)
    step_at_kill = max_progress_step(stack, jid)
    wait_until(
        lambda: max_progress_step(stack, jid) >= step_at_kill + 3,
        60,
        "training to go on without a controller",
    )
    stack.use(stack.start_controller())
    after = stack.client.job(jid)
    assert after.phase == "Running", after.conditions
    assert (after.generation, after.restarts) == (before.generation, before.restarts) == (1, 0)
    assert after.submitted_at == before.submitted_at and after.started_at == before.started_at
    assert after.step >= step_at_kill
    assert after.mesh.rendezvous == before.mesh.rendezvous
    assert [(r.rank, r.worker) for r in after.mesh.ranks] == [
        (r.rank, r.worker) for r in before.mesh.ranks
    ]
    admitted = (before.condition("Admitted"), after.condition("Admitted"))
    assert admitted[0] == admitted[1]
    stack.client.cancel(jid)
    done = wait_phase(stack.client, jid, ("Succeeded", "Failed", "Cancelled"), 60)
    assert done.phase == "Cancelled", done.conditions
    now = stack.controller.health()["controller"]
    sources = controller_sources(stack, jid)
    assert sources["Cancelled"] == {now} and now not in sources["Placed"]


@pytest.mark.slow
def test_two_replicas_only_the_lease_holder_acts(stack):
    first = stack.controller
    wait_until(lambda: first.health()["leader"], 10, "the stack's controller to lead")
    second = stack.start_controller()
    leaders = [c.health()["leader"] for c in (first, second)]
    assert leaders == [True, False]
    # a job submitted through the standby is placed by the leader
    stack.use(second)
    jid = stack.client.submit(tiny_spec("replica-a", train={"steps": 4})).id
    wait_phase(stack.client, jid, ("Succeeded",), 90)
    assert set().union(*controller_sources(stack, jid).values()) == {first.health()["controller"]}
    standby_id = second.health()["controller"]
    with second.client() as c:
        metrics = c.http.get("/metrics").text
    assert f'meshkeeper_controller_leader{{controller="{standby_id}"}} 0.0' in metrics
    # the leader dies: the standby takes over once the lease runs out
    first.proc.kill(signal.SIGKILL)
    wait_until(lambda: second.health()["leader"], 15, "the standby to take the lease")
    jid2 = stack.client.submit(tiny_spec("replica-b", train={"steps": 4})).id
    wait_phase(stack.client, jid2, ("Succeeded",), 90)
    assert set().union(*controller_sources(stack, jid2).values()) == {standby_id}


@pytest.mark.slow
def test_redis_restart_mid_job(stack):
    jid = stack.client.submit(tiny_spec("redis-blip", train={"steps": 60})).id
    wait_until(lambda: stack.client.job(jid).step >= 3, 120, "training")
    stack.redis.kill()
    time.sleep(1.5)
    # the API answers 503 with one clear line while Redis is away, never a traceback
    r = stack.client.http.get(f"/v1/jobs/{jid}")
    assert r.status_code == 503
    assert "cannot reach Redis" in r.json()["detail"]
    assert httpx.get(f"{stack.controller.url}/readyz").status_code == 503
    assert httpx.get(f"{stack.controller.url}/healthz").status_code == 200
    stack.redis.start()  # same port, same AOF directory
    wait_until(lambda: stack.client.ready(), 20, "the controller to see Redis again")
    wait_until(
        lambda: all(w.alive for w in stack.client.workers()), 20, "every agent to heartbeat again"
    )
    done = wait_phase(stack.client, jid, ("Succeeded", "Failed", "Cancelled"), 180)
    assert done.phase == "Succeeded" and done.step == 60
    assert done.generation == 1  # nothing restarted: the trainers never noticed
    assert stack.controller.proc.alive()
