"""Per-job gauges, read from Redis at scrape time (the controller keeps no state of its own).

Only jobs not yet ended get series, so a job's label children vanish when it ends. Every
time is Redis server time, so ages never depend on the controller's clock.
"""

from __future__ import annotations

from collections import Counter

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controller import goodput
from controller.conditions import PHASES
from controller.jobs import Job
from controller.ranks import rank_view, summarize
from services import assignment
from services.api import RankStatus
from services.assignment import RANK_STATES
from services.store import Store

# The states the dashboard and the alerts name, always exported (as 0) so they exist;
# `straggler` is set by the health loop; any other state a rank reports is exported too.
RANK_STATE_LABELS = tuple(dict.fromkeys((*RANK_STATES, "straggler")))
L = ["job_id"]


class JobFamilies:
    """The families of one scrape; `add(store, job, raw, now, alive)` per open job."""

    def __init__(self):
        g, c = GaugeMetricFamily, CounterMetricFamily
        self.phase = g(
            "meshkeeper_job_phase", "1 for the job's current phase", labels=[*L, "phase"]
        )
        self.step = g("meshkeeper_job_step", "Steps done (the slowest rank's)", labels=L)
        self.target = g("meshkeeper_job_target_steps", "Steps the job trains for", labels=L)
        self.generation = g(
            "meshkeeper_job_generation", "Current generation of the job's world", labels=L
        )
        self.loss = g("meshkeeper_train_loss", "Latest training loss", labels=L)
        self.eval_loss = g(
            "meshkeeper_eval_loss", "Latest validation loss (held-out batches)", labels=L
        )
        self.tokens = c(
            "meshkeeper_train_tokens", "Tokens trained (steps done x tokens per step)", labels=L
        )
        self.tps = g("meshkeeper_train_tokens_per_second", "Latest training throughput", labels=L)
        self.ranks = g("meshkeeper_ranks", "Ranks by state", labels=[*L, "state"])
        self.spares = g("meshkeeper_spares", "Spare workers held for the job", labels=L)
        self.ckpt_age = g(
            "meshkeeper_checkpoint_age_seconds",
            "Since the last committed checkpoint (or the job's start, before the first)",
            labels=L,
        )
        self.ckpt_step = g(
            "meshkeeper_checkpoint_step", "Step of the last committed checkpoint", labels=L
        )
        self.ckpt_every = g(
            "meshkeeper_checkpoint_expected_interval_seconds",
            "checkpoint.every_steps x the latest step time",
            labels=L,
        )
        self.restarts = c(
            "meshkeeper_job_restarts",
            "Restarts of the job's world, by cause",
            labels=[*L, "reason"],
        )
        self.max_restarts = g(
            "meshkeeper_job_max_restarts", "fault_tolerance.max_restarts", labels=L
        )
        self.lost = c("meshkeeper_recovery_lost_steps", "Steps redone after recoveries", labels=L)
        self.recovering = g(
            "meshkeeper_job_recovering_seconds",
            "How long the job has been recovering (only while it is)",
            labels=L,
        )
        self.seconds = c(
            "meshkeeper_job_seconds",
            "The job's wall time since admission by where it went (its goodput ledger's "
            "parts, settled): productive, redone, recovery, checkpoint, snapshot, eval, "
            "waiting, suspended",
            labels=[*L, "cause"],
        )
        self.goodput = g(
            "meshkeeper_goodput_ratio",
            "Effective training time ratio (ETTR): productive time over the wall time since "
            "admission less the time suspended or preempted (the goodput ledger)",
            labels=L,
        )

    def families(self):
        return list(vars(self).values())

    def add(self, store: Store, job: Job, now: float, alive: set[str]) -> None:
        jid = [job.id]
        asg = assignment.current(store, job.id, job.generation) if job.generation else None
        ranks = rank_view(asg, store.progress(asg.workers), alive) if asg else []
        job.absorb(summarize(ranks))  # fresher than the controller's last write
        for ph in PHASES:
            self.phase.add_metric([job.id, ph], 1.0 if job.phase == ph else 0.0)
        self.step.add_metric(jid, job.step)
        self.target.add_metric(jid, job.total_steps)
        self.generation.add_metric(jid, job.generation)
        if job.loss is not None:
            self.loss.add_metric(jid, job.loss)
        if job.eval_loss is not None:
            self.eval_loss.add_metric(jid, job.eval_loss)
        tokens_per_step = job.spec.train.global_batch * job.spec.model.seq_len
        self.tokens.add_metric(jid, job.step * tokens_per_step)
        if job.tokens_per_s is not None:
            self.tps.add_metric(jid, job.tokens_per_s)
        states = Counter(rank_state(r, job) for r in ranks)
        for s in dict.fromkeys((*RANK_STATE_LABELS, *states)):
            self.ranks.add_metric([job.id, s], states.get(s, 0))
        self.spares.add_metric(jid, len(asg.spares) if asg else 0)
        self._checkpoint(job, store.checkpoint(job.id), now)
        self._recoveries(job, now)
        for part, seconds in goodput.settled(job, now).items():
            self.seconds.add_metric([job.id, part.removesuffix("_s")], seconds)
        if (ettr := goodput.view(job, now).ettr) is not None:
            self.goodput.add_metric(jid, ettr)

    def _checkpoint(self, job: Job, ckpt: dict[str, str], now: float) -> None:
        jid = [job.id]
        since = float(ckpt["time"]) if ckpt.get("time") else job.started_at
        if since is not None:
            self.ckpt_age.add_metric(jid, max(0.0, now - since))
        if ckpt.get("step"):
            self.ckpt_step.add_metric(jid, int(ckpt["step"]))
        if job.step_s:
            self.ckpt_every.add_metric(jid, job.spec.checkpoint.every_steps * job.step_s)

    def _recoveries(self, job: Job, now: float) -> None:
        """Restarts that count against max_restarts, by cause, from the records (growing dp
        back is a planned restart and does not count); restarts the job counts beyond its
        records (a trimmed list) are `unknown`, so the sum is always the job's count."""
        jid = [job.id]
        faults = [r for r in job.recoveries if r.action != "grow"]
        causes = Counter(r.cause for r in faults)
        causes["unknown"] += max(0, job.restarts - len(faults))
        for cause, n in causes.items():
            if n:
                self.restarts.add_metric([job.id, cause], n)
        self.max_restarts.add_metric(jid, job.spec.fault_tolerance.max_restarts)
        self.lost.add_metric(jid, sum(r.steps_lost or 0 for r in job.recoveries))
        cond = job.condition("Recovering")
        if job.phase == "Recovering" and cond and cond.get("lastTransitionTime"):
            self.recovering.add_metric(jid, max(0.0, now - float(cond["lastTransitionTime"])))


def rank_state(rank: RankStatus, job: Job) -> str:
    """A running rank the controller flagged as a straggler in this generation (reported, not
    replaced: straggler.action is report, or no spare was free) counts as `straggler`."""
    f = job.straggler
    if rank.state == "running" and f and f.rank == rank.rank and f.generation == job.generation:
        return "straggler"
    return rank.state
