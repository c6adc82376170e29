"""A job's validation loss and epoch, from the trainer's step records to every reader (real
redis-server, real `Scheduler`): the agent's fold of the lines the trainer writes
(worker/agent/rank_progress.py) is published as each agent publishes it, and the pass, the
REST status and history, the controller's /metrics and the CLI's views all show the eval the
job's slowest rank had seen, with the step it was measured at."""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client import generate_latest
from rich.console import Console

from cli import render
from controller.history import job_history
from controller.metrics import ControllerMetrics, Scraped
from controller.scheduler import Scheduler, SchedulerConfig
from controller.status import job_status
from services import api
from services.records import StepRecord
from services.store import Store
from tests.integration.test_scheduler_race import agent_up, job, tiny_job
from tests.observability.exposition import value
from worker.agent.metrics_tail import parse_line
from worker.agent.rank_progress import RankProgress

EVERY = 2  # the trainer's eval.every_steps in this story
EVAL_LOSS = {2: 3.5, 4: 3.25}  # step -> the held-out loss the trainer measured after it


@pytest.fixture
def store(redis_server):
    s = Store(redis_server.url, prefix="eval:")
    yield s
    s.close()


def trainer_line(rank: int, n: int) -> str:
    """Step n's line in rank `rank`'s metrics file, as the trainer writes it: every rank
    evaluates (the held-out loss is all-reduced like the training loss)."""
    evaluated = n % EVERY == 0
    return json.dumps(
        StepRecord(
            step=n,
            loss=5.0 - n / 10,
            tokens_per_s=1000.0,
            step_s=0.5,
            compute_s=0.4,
            wait_s=0.1,
            lr=1e-3,
            rank=rank,
            time=1000.0 + n,
            epoch=(n - 1) // 3,
            eval_loss=EVAL_LOSS[n] if evaluated else None,
            eval_s=0.25 if evaluated else None,
        ).model_dump()
    )


class Agent:
    """One worker's agent, running one rank: the trainer's lines folded and published."""

    def __init__(self, store: Store, wid: str, rank: int):
        self.store, self.wid, self.rank = store, wid, rank
        self.progress = RankProgress(started_at=store.now())

    def trained_to(self, jid: str, upto: int) -> None:
        for n in range(self.progress.step + 1, upto + 1):
            self.progress.absorb(parse_line(trainer_line(self.rank, n)), self.store.now(), 0.0)
        report = self.progress.fields()
        self.store.heartbeat(self.wid, jid, 1)
        self.store.write_progress(
            self.wid,
            {"job": jid, "generation": 1, "state": "running", "ranks": {str(self.rank): report}},
        )


def test_eval_loss_and_epoch_reach_status_history_metrics_and_cli(store):
    sched = Scheduler(store, SchedulerConfig(worker_alive_s=30), "ctl")
    lease = store.acquire_lease("ctl", ttl_s=60)
    for wid in ("w1", "w2"):
        agent_up(store, wid)
    jid = tiny_job(store, "evals", dp=2)
    sched.run_once(lease)  # placed: generation 1
    agents = [Agent(store, "w1", 0), Agent(store, "w2", 1)]

    agents[0].trained_to(jid, 3)
    agents[1].trained_to(jid, 1)
    sched.run_once(lease)
    j = job(store, jid)
    assert (j.step, j.eval_loss, j.eval_step, j.epoch) == (1, None, None, 0)  # rank 1's, no eval

    agents[0].trained_to(jid, 4)  # rank 0 has evaluated at 4; rank 1, the slowest, at 2
    agents[1].trained_to(jid, 3)
    sched.run_once(lease)
    j = job(store, jid)
    assert (j.step, j.eval_loss, j.eval_step, j.epoch) == (3, 3.5, 2, 0)

    agents[1].trained_to(jid, 5)
    agents[0].trained_to(jid, 5)
    sched.run_once(lease)
    j = job(store, jid)
    assert (j.step, j.eval_loss, j.eval_step, j.epoch) == (5, 3.25, 4, 1)

    # REST: the status as a client parses it
    status = api.JobStatus.model_validate_json(job_status(store, j, 30).model_dump_json())
    assert (status.eval_loss, status.eval_step, status.epoch) == (3.25, 4, 1)
    assert status.eval_perplexity == pytest.approx(math.exp(3.25), rel=1e-12)
    [rank0] = [r for r in status.mesh.ranks if r.rank == 0]
    assert (rank0.eval_loss, rank0.eval_step, rank0.eval_s) == (3.25, 4, 0.25)

    # history: every point carries the job's newest eval then, with the step it was taken at
    hist = api.JobHistory.model_validate(job_history(store, j, 1000))
    assert [(p.step, p.eval_loss, p.eval_step) for p in hist.points] == [
        (1, None, None),
        (3, 3.5, 2),
        (5, 3.25, 4),
    ]

    # /metrics: the gauge beside the training loss
    metrics = ControllerMetrics(Scraped(store, "ctl", lambda: True, 30))
    text = generate_latest(metrics.registry).decode()
    assert value(text, "meshkeeper_eval_loss", job_id=jid) == 3.25
    assert value(text, "meshkeeper_train_loss", job_id=jid) == pytest.approx(4.5)

    # the CLI: `meshkeeper status JOB`, and `watch`'s progress line
    shown = f"eval loss 3.2500 (perplexity {math.exp(3.25):,.2f}) at step 4  epoch 1"
    assert f"\n  {shown}\n" in printed(render.job_detail(status))
    assert render.progress_line(status).startswith(f"step 5/100  loss 4.5000  {shown}  ")


def printed(view) -> str:
    console = Console(width=200, record=True)
    console.print(view)
    return console.export_text()
